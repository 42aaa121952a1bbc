-- A worker's stream ended (Goodbye, disconnect or relay shutdown): remove its
-- presence, then write its detach mark (SPEC T4, T5), in that order, atomically.
--
-- KEYS: 5 presence:<sandbox>, 6 detached:<sandbox>.
-- ARGV: 2 sandbox id, 3 owner, 4 detach-mark ttl ms.
--
-- Returns 1 when this stream's presence was removed and the mark written. A
-- stream that no longer owns the presence (a newer stream took over) changes
-- nothing. When the presence already expired, a mark is written only if none
-- exists, so an earlier mark is not pushed later.
local sb, owner, mark_ttl_ms = ARGV[2], ARGV[3], tonumber(ARGV[4])

local now = now_ms()
local key = KEYS[5]
local p = redis.call("HMGET", key, "owner", "tier", "client", "scope")
if not p[1] then
  redis.call("SET", KEYS[6], now, "NX", "PX", mark_ttl_ms)
  return 0
end
if p[1] ~= owner then return 0 end
redis.call("DEL", key)
if p[3] then
  redis.call("ZREM", K_PRESENCE_EXPIRY, expiry_member(p[4] or p[2], sb, p[3]))
  unindex(sb, p[4] or p[2], p[3])
else  -- written before owners
  redis.call("ZREM", K_PRESENCE_EXPIRY, p[2] .. "/" .. sb)
  redis.call("ZREM", k_load_tier(p[2]), sb)
  unindex(sb, p[2], "")
end
redis.call("SET", KEYS[6], now, "PX", mark_ttl_ms)
return 1
