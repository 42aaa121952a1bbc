-- A worker's Hello: put its presence (SPEC T1, T5, Z3).
--
-- The relay has verified the worker's sandbox credential before this runs
-- (signature, sandbox id, expiry). This script checks what a signature cannot:
-- that the credential is not revoked. The sandbox's credential record names its
-- current runtime's generation, or "revoked" once the runtime ended; a record
-- naming anything but this credential's generation refuses it. No record at all
-- (Redis lost its data, or the record expired with the credentials it covered)
-- leaves the credential's own signed expiry as the bound. A refusal returns
-- before any write.
--
-- Proof decides who may replace a live presence. With a credential (ARGV 9 a
-- generation) a Hello replaces any presence of the sandbox: it proved it is the
-- sandbox's current runtime, so a worker reconnecting through another replica
-- (or after a relay restart) takes its presence over at once. Without one
-- (ARGV 9 empty: attestation off) a Hello never replaces a live presence of
-- another stream; it waits until that presence expires.
--
-- The detach mark (and the wake marker of the absence it ended) is cleared
-- before presence is put; both happen in this one script, so no reader ever
-- sees presence beside a stale mark.
--
-- KEYS: 5 presence:<sandbox>, 6 detached:<sandbox>, 7 wake:<sandbox>,
-- 8 credential:<sandbox> (written by the substrate, turnstile_platform.sandbox_credentials:
-- the generation of the sandbox's current runtime, or "revoked" once it ended),
-- 9 load:own:<scope>:<client> (the owner index it joins), 10 leases:<sandbox>.
-- ARGV: 2 sandbox id, 3 owner (the relay stream's id), 4 tier label value ("" for
-- none), 5 capacity, 6 labels as JSON, 7 endpoint, 8 presence ttl ms,
-- 9 the credential's generation ("" when attestation is off), 10 the sandbox's
-- owner as its credential attests it (SPEC O3: a client id, "native", or "" for
-- none; tier, capacity and endpoint are the credential's too, resolved by the relay),
-- 11 its owner index's scope (its tier when tiers filter, "*" when they do not).
--
-- Returns {"ok", previous owner or ""}, {"revoked", ""} (the credential record
-- names another generation, or "revoked") or {"taken", owner} (no proof, and
-- another stream's presence is live).
local sb, owner, tier, capacity = ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local labels, endpoint, ttl_ms = ARGV[6], ARGV[7], tonumber(ARGV[8])
local generation, client, scope = ARGV[9], ARGV[10] or "", ARGV[11] or tier

local now = now_ms()
local key = KEYS[5]
local old = redis.call("HMGET", key, "owner", "tier", "expires", "client", "scope")

if generation ~= "" then
  local current = redis.call("GET", KEYS[8])
  if current and current ~= generation then return {"revoked", ""} end
elseif old[1] and old[1] ~= owner and old[3] and tonumber(old[3]) > now then
  return {"taken", old[1]}
end

prune(now)

redis.call("DEL", KEYS[6], KEYS[7])

-- A presence of another scope or owner (a new runtime, or one written before owners)
-- leaves the indexes it was in.
if old[2] then
  local old_client, old_scope = old[4] or "", old[5] or old[2]
  if not old[4] then
    redis.call("ZREM", k_load_tier(old[2]), sb)
    redis.call("ZREM", K_PRESENCE_EXPIRY, old[2] .. "/" .. sb)
  elseif old_scope ~= scope or old_client ~= client then
    if old_client ~= "" then redis.call("ZREM", k_load_own(old_scope, old_client), sb) end
    redis.call("ZREM", K_PRESENCE_EXPIRY, expiry_member(old_scope, sb, old_client))
  end
end
local expires = now + ttl_ms
redis.call("HSET", key, "owner", owner, "client", client, "scope", scope, "tier", tier,
  "capacity", capacity, "labels", labels, "endpoint", endpoint, "expires", expires)
redis.call("PEXPIRE", key, ttl_ms)
redis.call("ZADD", K_PRESENCE_EXPIRY, expires, expiry_member(scope, sb, client))
refresh_load(sb, now)
return {"ok", old[1] or ""}
