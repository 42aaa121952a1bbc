-- A worker's heartbeat: keep its presence alive for another ttl.
--
-- ARGV: 3 sandbox id, 4 owner, 5 presence ttl ms, 6 the stream's credential
-- generation ("" when attestation is off).
--
-- Returns "ok"; "revoked" when the sandbox's credential record names another
-- generation or "revoked" (a newer runtime, or Deactivate; see attach.lua for a
-- missing record): the relay ends the stream, and nothing is written; "missing" when
-- the presence is gone or expired (Redis restarted, or heartbeats stalled past
-- the ttl): the relay attaches again, which clears any detach mark written
-- meanwhile; "superseded" when a newer stream owns it.
local sb, owner, ttl_ms, generation = ARGV[3], ARGV[4], tonumber(ARGV[5]), ARGV[6]

if generation ~= "" then
  local current = redis.call("GET", k_credential(sb))
  if current and current ~= generation then return "revoked" end
end

local now = now_ms()
prune(now)

local key = k_presence(sb)
local p = redis.call("HMGET", key, "owner", "tier", "expires")
if not p[1] or tonumber(p[3]) <= now then return "missing" end
if p[1] ~= owner then return "superseded" end
local expires = now + ttl_ms
redis.call("HSET", key, "expires", expires)
redis.call("PEXPIRE", key, ttl_ms)
redis.call("ZADD", K_PRESENCE_EXPIRY, expires, p[2] .. "/" .. sb)
return "ok"
