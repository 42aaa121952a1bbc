-- _decision_log.lua: the decision log's append, prepended to the decision script
-- (admit.lua) after _common.lua (SPEC Q3). Not a script itself.
--
-- The log is a stream in admission's hash slot (<prefix>{adm}:decisions, declared
-- in the script's KEYS), appended by the script that decides, just before it
-- returns: a decision that happened is logged exactly once, in the same atomic
-- step as what it took; a script that takes nothing for a settled hold (its
-- caller gave up) or a dry run returns before it and logs nothing.
--
-- Bounded twice: by length on every append (XADD MAXLEN ~ max_entries) and by
-- age (XTRIM MINID ~ now - max_age) at least once per trim period (LOG_TRIM_MS,
-- a tenth of max_age when that is shorter). Every append is paid for by the
-- decision it logs, so the age trim and the expiry's refresh run only when the
-- stream's TTL says a period has passed: one PTTL per append instead of TIME,
-- XTRIM and PEXPIRE (docs/admission.md, "The decision log's cost").
-- Entry ids are Redis TIME (XADD '*'), so age is measured on Redis TIME too,
-- never on the test clock: the entry's own 'at' field carries the decision's
-- clock. '~' trims whole stream nodes only (stream-node-max-entries, 100 by
-- default), so the stream may exceed the length bound by less than one node and
-- the age bound by less than one node plus one trim period. The stream expires
-- between max_age and max_age + one period after its last entry: a log nobody
-- writes to goes on its own, never before its entries are max_age old. The
-- substrate's and affinity's batches (decision_append.lua) set the same expiry,
-- so their writes do not make the next decision trim again.
-- max_entries 0 turns the log off: nothing is written.

local LOG_POLICIES = {'node_slots', 'concurrency', 'cap', 'rate'}
local LOG_VERDICTS = {[0] = 'skipped', 'pass', 'over', 'unknown'}
local LOG_MODES = {[0] = 'off', 'shadow', 'enforce'}

-- What the decision was, in one word: refused; shadow_refused (admitted, but a
-- policy in shadow mode or a shadow limit was over); admitted. An UNKNOWN verdict
-- (the cap on a substrate that cannot count) admits by design and is in the
-- verdicts; a real fail-open (Redis unreachable) never reaches this script.
-- results: per policy in LOG_POLICIES order {code, limit, current, retry_ms, detail};
-- modes: the script modes in the same order; shadow: {policy = {code, limit, current}}.
local function decision_kind(outcome, results, modes, shadow)
  if outcome ~= 'admit' then return 'refused' end
  for j, r in ipairs(results) do
    if r[1] == 2 and modes[j] == 1 then return 'shadow_refused' end
  end
  for _, s in pairs(shadow) do
    if s[1] == 2 then return 'shadow_refused' end
  end
  return 'admitted'
end

-- The evaluated policies' verdicts as one JSON array: [{p, m, v, l, c, r?, d?}, ...]
-- (policy, mode, verdict, limit, current, retry hint in ms, detail), a shadow
-- limit's verdict {v, l, c} under 's' of the policy it shadows. A policy not
-- evaluated (mode 0) is left out, as are an empty detail and no retry hint (-1):
-- an entry's size is most of the log's memory.
local function verdicts_json(results, modes, shadow)
  local out = {}
  for j, r in ipairs(results) do
    if modes[j] > 0 then
      local name = LOG_POLICIES[j]
      local entry = {p = name, m = LOG_MODES[modes[j]], v = LOG_VERDICTS[r[1]] or 'skipped',
                     l = r[2], c = r[3]}
      if r[4] >= 0 then entry.r = r[4] end
      if r[5] ~= '' then entry.d = r[5] end
      local s = shadow[name]
      if s and s[1] > 0 then
        entry.s = {v = LOG_VERDICTS[s[1]], l = s[2], c = s[3]}
      end
      out[#out + 1] = entry
    end
  end
  if #out == 0 then return '[]' end
  return cjson.encode(out)
end

-- The age trim's period in ms (the head comment): at most a second.
local LOG_TRIM_MS = 1000

-- Append one decision (fields: a flat list of name, value) and keep the bounds.
local function log_decision(stream, max_entries, max_age_ms, fields)
  if max_entries <= 0 then return end
  redis.call('XADD', stream, 'MAXLEN', '~', max_entries, '*', unpack(fields))
  -- The expiry is set one period past max_age, so it drops below max_age once a
  -- period has passed since the last trim (or was never set: -1).
  if redis.call('PTTL', stream) < max_age_ms then
    local t = redis.call('TIME')
    local redis_now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
    redis.call('XTRIM', stream, 'MINID', '~', math.max(0, redis_now - max_age_ms))
    redis.call('PEXPIRE', stream, max_age_ms + math.min(LOG_TRIM_MS, math.floor(max_age_ms / 10)))
  end
end
