-- First turn: claim the least-loaded usable sandbox of the session's tier for its
-- client (SPEC T7, O2): the client's own, or the native pool's where the tier
-- shares it (_lib.lua's pick); never another client's.
--
-- Compare-and-claim: the record is written only if the session has none, so
-- concurrent first turns converge on whichever claim landed first.
--
-- KEYS: 5 session:<client>/<id>, 6 load:own:<scope>:<client>, 7 load:own:<scope>:native.
-- ARGV: 2 session id, 3 session tier, 4 filtered, 5 lease ttl ms, 6 lease id,
-- 7 record ttl ms, 8 client, 9 shared.
--
-- Returns {"first", sandbox, tier, lease_expires, endpoint} (a lease was
-- taken), {"exists", sandbox} (another turn claimed first: run place.lua again)
-- or {"exhausted"} (no usable sandbox of the tier has a free slot).
local session, session_tier, filtered = ARGV[2], ARGV[3], ARGV[4]
local lease_ttl_ms, lease, record_ttl_ms = tonumber(ARGV[5]), ARGV[6], tonumber(ARGV[7])
local client, shared = ARGV[8], ARGV[9]

local now = now_ms()
prune(now)

local key = KEYS[5]
local current = redis.call("HGET", key, "sandbox")
if current then return {"exists", current} end

local sb, p = pick(session_tier, filtered, client, shared, now)
if not sb then return {"exhausted"} end
redis.call("HSET", key, "sandbox", sb, "tier", session_tier, "client", client)
redis.call("PEXPIRE", key, record_ttl_ms)
return {"first", sb, p.tier, take_lease(sb, p, lease, lease_ttl_ms, now, client), p.endpoint}
