#!lua
-- decision_append.lua: append a batch of entries to the decision log (SPEC Q3) for
-- the services that do not decide admission: the substrate's Activate and
-- affinity's Place (turnstile_platform.decision_log). Admission's own decisions
-- are appended by its decision script (admission's _decision_log.lua), with the
-- same bounds.
--
-- KEYS: 1 the decision log (<prefix>{adm}:decisions).
-- ARGV: max entries (0: off), max age in ms, F (fields per entry), then the
--       entries, each F field names and values (2F values).
-- Bounded by length (XADD MAXLEN ~) and by age (XTRIM MINID ~ Redis TIME - max
-- age: entry ids are Redis TIME), once per batch. The stream expires one trim
-- period (a second, or a tenth of max age when shorter) past max age after its
-- last entry, as admission's appends set it: admission trims by age only once its
-- TTL falls below max age (_decision_log.lua), so a shorter expiry set here would
-- make its next decision trim again.
-- Returns the number of entries appended.

local max_entries, max_age, f = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
if max_entries <= 0 then return 0 end
local n = 0
local at = 4
while at + 2 * f - 1 <= #ARGV do
  redis.call('XADD', KEYS[1], 'MAXLEN', '~', max_entries, '*', unpack(ARGV, at, at + 2 * f - 1))
  at = at + 2 * f
  n = n + 1
end
if n > 0 then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  redis.call('XTRIM', KEYS[1], 'MINID', '~', math.max(0, now - max_age))
  redis.call('PEXPIRE', KEYS[1], max_age + math.min(1000, math.floor(max_age / 10)))
end
return n
