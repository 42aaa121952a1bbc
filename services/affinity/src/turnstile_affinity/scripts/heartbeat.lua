-- A worker's heartbeat: keep its presence alive for another ttl.
--
-- KEYS: 5 presence:<sandbox>, 6 credential:<sandbox>.
-- ARGV: 2 sandbox id, 3 owner, 4 presence ttl ms, 5 the stream's credential
-- generation ("" when attestation is off).
--
-- Returns "ok"; "revoked" when the sandbox's credential record names another
-- generation or "revoked" (a newer runtime, or Deactivate; see attach.lua for a
-- missing record): the relay ends the stream, and nothing is written; "missing" when
-- the presence is gone or expired (Redis restarted, or heartbeats stalled past
-- the ttl): the relay attaches again, which clears any detach mark written
-- meanwhile; "superseded" when a newer stream owns it.
local sb, owner, ttl_ms, generation = ARGV[2], ARGV[3], tonumber(ARGV[4]), ARGV[5]

if generation ~= "" then
  local current = redis.call("GET", KEYS[6])
  if current and current ~= generation then return "revoked" end
end

local now = now_ms()
prune(now)

local key = KEYS[5]
local p = redis.call("HMGET", key, "owner", "tier", "expires", "client", "scope")
if not p[1] or tonumber(p[3]) <= now then return "missing" end
if p[1] ~= owner then return "superseded" end
local expires = now + ttl_ms
redis.call("HSET", key, "expires", expires)
redis.call("PEXPIRE", key, ttl_ms)
if p[4] then
  redis.call("ZADD", K_PRESENCE_EXPIRY, expires, expiry_member(p[5] or p[2], sb, p[4]))
else  -- written before owners
  redis.call("ZADD", K_PRESENCE_EXPIRY, expires, p[2] .. "/" .. sb)
end
return "ok"
