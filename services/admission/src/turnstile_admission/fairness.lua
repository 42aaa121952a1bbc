-- fairness.lua: the fair queue's counts of the last minute, for the fairness
-- index (fairness.py, SPEC Q1): the windows _queue.lua's count_fairness writes,
-- the current one (partial) and the FAIRNESS_WINDOWS - 1 before it. Read-only.
--
-- KEYS: 1 limits hash (its base names the windows), then (clock).
-- ARGV: none.
-- Returns: the windows' fields and values, flattened ({field, value, ...}), each
--          window's in turn (a field may repeat across windows).
local FAIRNESS_WINDOWS = 6
local base = base_of(KEYS[1])
local now = now_ms()
local out = {}
for n = 0, FAIRNESS_WINDOWS - 1 do
  local fields = redis.call('HGETALL', fairness_key(base, now - n * FAIRNESS_WINDOW_MS))
  for _, v in ipairs(fields) do out[#out + 1] = v end
end
return out
