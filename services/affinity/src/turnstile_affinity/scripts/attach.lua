-- A worker's Hello: put its presence (SPEC T1, T5).
--
-- The detach mark (and the wake marker of the absence it ended) is cleared
-- before presence is put; both happen in this one script, so no reader ever
-- sees presence beside a stale mark.
--
-- ARGV: 3 sandbox id, 4 owner (the relay stream's id), 5 tier label value ("" for
-- none), 6 capacity, 7 labels as JSON, 8 endpoint, 9 presence ttl ms.
--
-- Returns the previous owner's id ("" if none was present): a newer stream takes
-- over from an older one whose teardown has not run yet.
local sb, owner, tier, capacity = ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local labels, endpoint, ttl_ms = ARGV[7], ARGV[8], tonumber(ARGV[9])

local now = now_ms()
prune(now)

redis.call("DEL", k_detached(sb), k_wake(sb))

local key = k_presence(sb)
local old = redis.call("HMGET", key, "owner", "tier")
if old[2] and old[2] ~= tier then
  redis.call("ZREM", k_load_tier(old[2]), sb)
  redis.call("ZREM", K_PRESENCE_EXPIRY, old[2] .. "/" .. sb)
end
local expires = now + ttl_ms
redis.call("HSET", key, "owner", owner, "tier", tier, "capacity", capacity,
  "labels", labels, "endpoint", endpoint, "expires", expires)
redis.call("PEXPIRE", key, ttl_ms)
redis.call("ZADD", K_PRESENCE_EXPIRY, expires, tier .. "/" .. sb)
refresh_load(sb, now)
return old[1] or ""
