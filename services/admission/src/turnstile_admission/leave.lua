-- leave.lua: a waiter leaves the fair queue (its budget ended, its caller
-- cancelled): its entry goes, and a grant it had not claimed goes back: tokens
-- to the cluster bucket, a slot to its node's next waiter (SPEC Q1: nothing
-- outlives a waiter).
--
-- KEYS: 1 limits hash, 2 cluster bucket, then (clock).
-- ARGV: waiter id, cluster rate default, cluster burst default.
-- Returns: {1 if it was queued, tokens returned}.
local wid = ARGV[1]
local base = base_of(KEYS[1])
local q = queue_keys(base)
local present = redis.call('HEXISTS', q.info, wid)
local now = now_ms()
local tokens = drop_waiter(base, q, wid, now)
if tokens > 0 then
  local rate, burst = cluster_limits(KEYS[1], tonumber(ARGV[2]), tonumber(ARGV[3]))
  return_tokens(KEYS[2], tokens, rate, burst, now)
end
if redis.call('HLEN', q.info) == 0 then redis.call('DEL', q.serving) end
return {present, fmt(tokens)}
