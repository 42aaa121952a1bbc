-- Fallback: move a session off a sandbox gone past the grace or re-tiered, to
-- the least-loaded sandbox of its tier, recording the workspace reset (SPEC T7).
--
-- Compare-and-set: the record is replaced only if it still names the sandbox
-- the caller saw, so two concurrent fallbacks move the session once.
--
-- KEYS: 5 session:<id>, 6 load:tier:<session tier>.
-- ARGV: 2 session id, 3 session tier, 4 filtered, 5 lease ttl ms, 6 lease id,
-- 7 record ttl ms, 8 expected sandbox, 9 reset reason.
--
-- Returns {"fallback", sandbox, tier, lease_expires, endpoint, reset_at} (a
-- lease was taken), {"changed", sandbox} (the record moved meanwhile: run
-- place.lua again) or {"exhausted"} (the record is left as it was).
local session, session_tier, filtered = ARGV[2], ARGV[3], ARGV[4]
local lease_ttl_ms, lease, record_ttl_ms = tonumber(ARGV[5]), ARGV[6], tonumber(ARGV[7])
local expected, reason = ARGV[8], ARGV[9]

local now = now_ms()
prune(now)

local key = KEYS[5]
local current = redis.call("HGET", key, "sandbox")
if current ~= expected then return {"changed", current or ""} end

local sb, p = pick(session_tier, filtered, now)
if not sb then return {"exhausted"} end
redis.call("HSET", key, "sandbox", sb, "tier", session_tier,
  "reset_from", expected, "reset_to", sb, "reset_at", now, "reset_reason", reason)
redis.call("PEXPIRE", key, record_ttl_ms)
return {"fallback", sb, p.tier, take_lease(sb, p, lease, lease_ttl_ms, now), p.endpoint, now}
