-- Place a session's turn on its recorded sandbox (SPEC T7, O2), atomically.
--
-- Sessions are per client: the record of client C's session S is
-- session:<C>/<S>, so another client's session of the same id is another record,
-- and a turn for it answers as a missing session does (SPEC O2).
--
-- KEYS: 5 session:<client>/<id>, 6 load:own:<scope>:<client>,
-- 7 load:own:<scope>:native, 8 session:<id> (the record of an ownerless session,
-- written before sessions had owners).
-- ARGV: 2 session id, 3 session tier, 4 filtered ("1" when tiers filter),
-- 5 lease ttl ms, 6 lease id, 7 record ttl ms, 8 client, 9 shared ("1" when the
-- tier lets sessions use the native pool), 10 grace ms, 11 detach-mark ttl ms.
--
-- Returns one of:
--   {"first"}                                     no record: claim.lua picks one
--   {"hit", sandbox, tier, lease_expires, endpoint}   a lease was taken
--   {"busy", sandbox, tier, leases, capacity}
--   {"pending", sandbox, remaining_grace_ms, woke}     woke=1: this call owns the wake
--   {"fallback", sandbox, reason}                 "grace" | "retiered" | "not_owned":
--                                                 replace.lua moves it
-- Only "hit" takes a lease.
local session, session_tier, filtered = ARGV[2], ARGV[3], ARGV[4]
local lease_ttl_ms, lease, record_ttl_ms = tonumber(ARGV[5]), ARGV[6], tonumber(ARGV[7])
local client, shared = ARGV[8], ARGV[9]
local grace_ms, mark_ttl_ms = tonumber(ARGV[10]), tonumber(ARGV[11])

local now = now_ms()
prune(now)

local key = KEYS[5]
local record = redis.call("HMGET", key, "sandbox", "tier")
local sb = record[1]
if not sb then
  -- An ownerless record (written before owners) is adopted by the first turn whose
  -- client owns the sandbox it names, present now; for any other client it stays
  -- as it is, and this turn is a first turn of the client's own session.
  local legacy = redis.call("HMGET", KEYS[8], "sandbox", "tier")
  if not legacy[1] then return {"first"} end
  local lp = presence(legacy[1], now)
  if not lp or lp.client ~= client then return {"first"} end
  redis.call("RENAME", KEYS[8], key)
  redis.call("HSET", key, "client", client)
  sb, record[2] = legacy[1], legacy[2]
end
redis.call("PEXPIRE", key, record_ttl_ms)

local p = presence(sb, now)
if p then
  if filtered == "1" and p.tier ~= session_tier then
    return {"fallback", sb, "retiered"}
  end
  if not usable(p, client, shared) then
    return {"fallback", sb, "not_owned"}
  end
  local leases = redis.call("ZCARD", k_leases(sb))
  if leases >= p.capacity then
    return {"busy", sb, p.tier, leases, p.capacity}
  end
  -- A record written in another tier is honoured: its sandbox is in this one.
  if record[2] ~= session_tier then redis.call("HSET", key, "tier", session_tier) end
  return {"hit", sb, p.tier, take_lease(sb, p, lease, lease_ttl_ms, now, client), p.endpoint}
end

-- Absent. Grace counts from the detach mark, or from first sight of the
-- absence when there is none (a relay restart wipes presence, not marks). A
-- garbage or future mark counts as "now".
local mark = tonumber(redis.call("GET", k_detached(sb)))
if not mark or mark ~= math.floor(mark) or mark < 0 or mark > now then
  mark = now
  redis.call("SET", k_detached(sb), mark, "PX", mark_ttl_ms)
end
local remaining = grace_ms - (now - mark)
if remaining <= 0 then
  return {"fallback", sb, "grace"}
end
-- One wake per absence, whichever replica sees it first; attach clears it.
local woke = redis.call("SET", k_wake(sb), mark, "NX", "PX", remaining) and 1 or 0
return {"pending", sb, remaining, woke}
