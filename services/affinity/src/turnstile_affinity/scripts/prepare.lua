-- Prepare a session's next turn (SPEC W2): start its absent sandbox's wake, atomically.
--
-- The absence test is place.lua's, minus everything a turn does: no lease, no
-- record renewal, no adoption of an ownerless record (only a Place adopts one,
-- for a client owning the sandbox it names). What it may write is what place.lua
-- writes on the same absence, so a Prepare then a Place, or the reverse, send one
-- wake: the detach mark at first sight of the absence (grace counts from it, as
-- it would from that Place's), and the wake marker (SET NX, attach clears it).
--
-- KEYS: 5 session:<client>/<id>.
-- ARGV: 2 grace ms, 3 detach-mark ttl ms.
--
-- Returns one of:
--   {"none"}                                   no record of this client's session
--   {"running", sandbox, tier}                 present: nothing to do
--   {"moves", sandbox, tier}                   absent past the grace: Place moves it
--   {"pending", sandbox, tier, remaining_grace_ms, woke}   woke=1: this call owns the wake
local grace_ms, mark_ttl_ms = tonumber(ARGV[2]), tonumber(ARGV[3])

local record = redis.call("HMGET", KEYS[5], "sandbox", "tier")
local sb, tier = record[1], record[2] or ""
if not sb then return {"none"} end

local now = now_ms()
if presence(sb, now) then return {"running", sb, tier} end

local mark = tonumber(redis.call("GET", k_detached(sb)))
if not mark or mark ~= math.floor(mark) or mark < 0 or mark > now then
  mark = now
  redis.call("SET", k_detached(sb), mark, "PX", mark_ttl_ms)
end
local remaining = grace_ms - (now - mark)
if remaining <= 0 then return {"moves", sb, tier} end
local woke = redis.call("SET", k_wake(sb), mark, "NX", "PX", remaining) and 1 or 0
return {"pending", sb, tier, remaining, woke}
