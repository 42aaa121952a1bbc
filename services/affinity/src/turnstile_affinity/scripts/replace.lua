-- Fallback: move a session off a sandbox gone past the grace, re-tiered or no
-- longer usable by its client, to the least-loaded usable sandbox of its tier
-- (its client's own, or the native pool's where the tier shares it: SPEC O2),
-- recording the workspace reset (SPEC T7).
--
-- Compare-and-set: the record is replaced only if it still names the sandbox
-- the caller saw, so two concurrent fallbacks move the session once.
--
-- KEYS: 5 session:<client>/<id>, 6 load:own:<scope>:<client>, 7 load:own:<scope>:native.
-- ARGV: 2 session id, 3 session tier, 4 filtered, 5 lease ttl ms, 6 lease id,
-- 7 record ttl ms, 8 client, 9 shared, 10 expected sandbox, 11 reset reason.
--
-- Returns {"fallback", sandbox, tier, lease_expires, endpoint, reset_at} (a
-- lease was taken), {"changed", sandbox} (the record moved meanwhile: run
-- place.lua again) or {"exhausted"} (the record is left as it was).
local session, session_tier, filtered = ARGV[2], ARGV[3], ARGV[4]
local lease_ttl_ms, lease, record_ttl_ms = tonumber(ARGV[5]), ARGV[6], tonumber(ARGV[7])
local client, shared = ARGV[8], ARGV[9]
local expected, reason = ARGV[10], ARGV[11]

local now = now_ms()
prune(now)

local key = KEYS[5]
local current = redis.call("HGET", key, "sandbox")
if current ~= expected then return {"changed", current or ""} end

local sb, p = pick(session_tier, filtered, client, shared, now)
if not sb then return {"exhausted"} end
redis.call("HSET", key, "sandbox", sb, "tier", session_tier, "client", client,
  "reset_from", expected, "reset_to", sb, "reset_at", now, "reset_reason", reason)
redis.call("PEXPIRE", key, record_ttl_ms)
return {"fallback", sb, p.tier, take_lease(sb, p, lease, lease_ttl_ms, now, client), p.endpoint,
  now}
