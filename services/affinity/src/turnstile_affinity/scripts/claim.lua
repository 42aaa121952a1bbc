-- First turn: claim the least-loaded sandbox of the session's tier (SPEC T7).
--
-- Compare-and-claim: the record is written only if the session has none, so
-- concurrent first turns converge on whichever claim landed first.
--
-- KEYS: 5 session:<id>, 6 load:tier:<session tier>.
-- ARGV: 2 session id, 3 session tier, 4 filtered, 5 lease ttl ms, 6 lease id,
-- 7 record ttl ms.
--
-- Returns {"first", sandbox, tier, lease_expires, endpoint} (a lease was
-- taken), {"exists", sandbox} (another turn claimed first: run place.lua again)
-- or {"exhausted"} (no sandbox of the tier has a free slot).
local session, session_tier, filtered = ARGV[2], ARGV[3], ARGV[4]
local lease_ttl_ms, lease, record_ttl_ms = tonumber(ARGV[5]), ARGV[6], tonumber(ARGV[7])

local now = now_ms()
prune(now)

local key = KEYS[5]
local current = redis.call("HGET", key, "sandbox")
if current then return {"exists", current} end

local sb, p = pick(session_tier, filtered, now)
if not sb then return {"exhausted"} end
redis.call("HSET", key, "sandbox", sb, "tier", session_tier)
redis.call("PEXPIRE", key, record_ttl_ms)
return {"first", sb, p.tier, take_lease(sb, p, lease, lease_ttl_ms, now), p.endpoint}
