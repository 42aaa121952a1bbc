-- Place a session's turn on its recorded sandbox (SPEC T7), atomically.
--
-- ARGV: 3 session id, 4 session tier, 5 filtered ("1" when tiers filter),
-- 6 grace ms, 7 lease ttl ms, 8 lease id, 9 record ttl ms, 10 detach-mark ttl ms.
--
-- Returns one of:
--   {"first"}                                     no record: claim.lua picks one
--   {"hit", sandbox, tier, lease_expires, endpoint}   a lease was taken
--   {"busy", sandbox, tier, leases, capacity}
--   {"pending", sandbox, remaining_grace_ms, woke}     woke=1: this call owns the wake
--   {"fallback", sandbox, reason}                 "grace" | "retiered": replace.lua moves it
-- Only "hit" takes a lease.
local session, session_tier, filtered = ARGV[3], ARGV[4], ARGV[5]
local grace_ms, lease_ttl_ms, lease = tonumber(ARGV[6]), tonumber(ARGV[7]), ARGV[8]
local record_ttl_ms, mark_ttl_ms = tonumber(ARGV[9]), tonumber(ARGV[10])

local now = now_ms()
prune(now)

local key = k_session(session)
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
