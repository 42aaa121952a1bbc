-- _decision_log.lua: the decision log's append, prepended to the decision script
-- (admit.lua) after _common.lua (SPEC Q3). Not a script itself.
--
-- The log is a stream per bounded key in admission's hash slot
-- (<prefix>{adm}:decisions:k:<key>, declared in the script's KEYS; its sandbox
-- streams and the log's index are built from it and from base_of(KEYS[1]), in
-- the same slot: _decision_stream.lua), appended by the script that decides, just before it
-- returns: a decision that happened is logged exactly once, in the same atomic
-- step as what it took; a script that takes nothing for a settled hold (its
-- caller gave up) or a dry run returns before it and logs nothing.
--
-- The bounds, the expiry and the trim period are _decision_stream.lua's (shared
-- with the substrate's and affinity's appends): every append is paid for by the
-- decision it logs, so the age trim runs once per period, found by one PTTL
-- (docs/admission.md, "The decision log's cost").
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

-- Append one decision (fields: a flat list of name, value) to its key's stream
-- (bounds: max entries, max age in ms, per-sandbox entries, sandboxes kept), with
-- the stream's bounds and the sandbox's stream (_decision_stream.lua).
local function log_decision(stream, bounds, sandbox, fields)
  log_append(stream, base_of(KEYS[1]) .. 'decisions:streams', sandbox, bounds, fields)
end
