-- Place a session's turn on its recorded sandbox (SPEC T7), atomically.
--
-- KEYS: 5 session:<id>, 6 load:tier:<session tier>.
-- ARGV: 2 session id, 3 session tier, 4 filtered ("1" when tiers filter),
-- 5 lease ttl ms, 6 lease id, 7 record ttl ms, 8 grace ms, 9 detach-mark ttl ms.
--
-- Returns one of:
--   {"first"}                                     no record: claim.lua picks one
--   {"hit", sandbox, tier, lease_expires, endpoint}   a lease was taken
--   {"busy", sandbox, tier, leases, capacity}
--   {"pending", sandbox, remaining_grace_ms, woke}     woke=1: this call owns the wake
--   {"fallback", sandbox, reason}                 "grace" | "retiered": replace.lua moves it
-- Only "hit" takes a lease.
local session, session_tier, filtered = ARGV[2], ARGV[3], ARGV[4]
local lease_ttl_ms, lease, record_ttl_ms = tonumber(ARGV[5]), ARGV[6], tonumber(ARGV[7])
local grace_ms, mark_ttl_ms = tonumber(ARGV[8]), tonumber(ARGV[9])

local now = now_ms()
prune(now)

local key = KEYS[5]
local record = redis.call("HMGET", key, "sandbox", "tier")
local sb = record[1]
if not sb then return {"first"} end
redis.call("PEXPIRE", key, record_ttl_ms)

local p = presence(sb, now)
if p then
  if filtered == "1" and p.tier ~= session_tier then
    return {"fallback", sb, "retiered"}
  end
  local leases = redis.call("ZCARD", k_leases(sb))
  if leases >= p.capacity then
    return {"busy", sb, p.tier, leases, p.capacity}
  end
  -- A record written in another tier is honoured: its sandbox is in this one.
  if record[2] ~= session_tier then redis.call("HSET", key, "tier", session_tier) end
  return {"hit", sb, p.tier, take_lease(sb, p, lease, lease_ttl_ms, now), p.endpoint}
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
