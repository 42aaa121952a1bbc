#!lua
-- decision_append.lua: append a batch of entries to the decision log (SPEC Q3, N3)
-- for what admission's decision scripts do not log: the substrate's Activate,
-- affinity's Place (turnstile_platform.decision_log.DecisionLogWriter) and the
-- platform's own audit entries (append_platform_entry). Prepended with
-- _decision_stream.lua, whose log_append keeps each stream's bounds.
--
-- KEYS: 1 the log's index (<prefix>{adm}:decisions:streams), 2 the platform's
--       stream; every other stream is named per entry, in the same slot.
-- ARGV: max entries (0: off), max age in ms, entries per sandbox stream (0:
--       none), sandboxes kept per key, F (fields per entry), then the entries,
--       each: its stream, the stream to use instead when that one does not exist
--       ('' none: a client id whose own key admission has not logged is the
--       shared key's), its sandbox id (''), then F field names and values.
-- Returns the appended entries' ids, in order.

local bounds = {tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])}
local f = tonumber(ARGV[5])
if bounds[1] <= 0 then return {} end
local ids = {}
local at = 6
while at + 2 + 2 * f <= #ARGV do
  local stream, instead, sandbox = ARGV[at], ARGV[at + 1], ARGV[at + 2]
  if instead ~= '' and redis.call('EXISTS', stream) == 0 then stream = instead end
  ids[#ids + 1] = log_append(stream, KEYS[1], sandbox, bounds,
                             {unpack(ARGV, at + 3, at + 2 + 2 * f)})
  at = at + 3 + 2 * f
end
return ids
