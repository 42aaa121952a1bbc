-- Fallback: move a session off a sandbox gone past the grace or re-tiered, to
-- the least-loaded sandbox of its tier, recording the workspace reset (SPEC T7).
--
-- Compare-and-set: the record is replaced only if it still names the sandbox
-- the caller saw, so two concurrent fallbacks move the session once.
--
-- ARGV: 3 session id, 4 session tier, 5 filtered, 6 lease ttl ms, 7 lease id,
-- 8 record ttl ms, 9 expected sandbox, 10 reset reason.
--
-- Returns {"fallback", sandbox, tier, lease_expires, endpoint, reset_at} (a
-- lease was taken), {"changed", sandbox} (the record moved meanwhile: run
-- place.lua again) or {"exhausted"} (the record is left as it was).
local session, session_tier, filtered = ARGV[3], ARGV[4], ARGV[5]
local lease_ttl_ms, lease, record_ttl_ms = tonumber(ARGV[6]), ARGV[7], tonumber(ARGV[8])
local expected, reason = ARGV[9], ARGV[10]

local now = now_ms()
prune(now)

local key = k_session(session)
local current = redis.call("HGET", key, "sandbox")
if current ~= expected then return {"changed", current or ""} end

local sb, p = pick(session_tier, filtered, now)
if not sb then return {"exhausted"} end
redis.call("HSET", key, "sandbox", sb, "tier", session_tier,
  "reset_from", expected, "reset_to", sb, "reset_at", now, "reset_reason", reason)
redis.call("PEXPIRE", key, record_ttl_ms)
return {"fallback", sb, p.tier, take_lease(sb, p, lease, lease_ttl_ms, now), p.endpoint, now}
