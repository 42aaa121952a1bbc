-- claim.lua: a granted waiter's decision (SPEC Q1). Appended after admit.lua,
-- wrapped as admit_body (see redis_store.script_text): the grant's tokens go back
-- into the cluster bucket and admit_body decides at once, in the same atomic
-- step, past the queue's check (queue_claim), so the tokens are this waiter's.
-- Refused (a client limit changed meanwhile), they stay in the bucket: nothing
-- is held. A slot waiter's grant is a slot reserved on one node: freed here for
-- its decision to take (past the node's queue: slot_claim); a decision that does
-- not take it (refused, or another candidate chosen) hands it to the node's
-- next waiter. A per-client waiter's grant (_own_queue.lua) is what its key's
-- limits reserved for it, given back here for its decision to take (past the
-- key's own queue: own_claim).
--
-- KEYS and ARGV: admit.lua's, then ARGV's last is the waiter id.
-- Returns: admit.lua's answer, or {'lost'} when the waiter holds no grant (it
-- was swept: its claim came too late, or it was never granted).
local wid = ARGV[#ARGV]
local base = base_of(KEYS[1])
local q = queue_keys(base)
local info = decode(redis.call('HGET', q.info, wid))
if not info or info.s ~= 'g' then return {'lost'} end
redis.call('HDEL', q.info, wid)
redis.call('ZREM', q.exp, wid)
if redis.call('HLEN', q.info) == 0 then redis.call('DEL', q.serving) end
local now = now_ms()
if info.own then
  -- A per-client waiter: what its grant reserved goes back, and its decision
  -- takes it at once; not taken (refused), it goes to the key's next waiter.
  release_own(base, wid, info, now)
  own_claim = true
  local out = admit_body()
  if out[1] ~= 'admit' then grant_own(base, q, info.k, now) end
  return out
end
if info.gn then
  redis.call('ZREM', slots_of(base, info.gn), 'g:' .. wid)
  slot_claim = info.gn
  local out = admit_body()
  if out[1] ~= 'admit' or out[4] ~= info.gn then grant_slots(base, q, info.gn, now) end
  return out
end
-- ARGV[12] and ARGV[13]: the cluster rate and burst defaults (admit.lua's order).
local rate, burst = cluster_limits(KEYS[1], tonumber(ARGV[12]), tonumber(ARGV[13]))
local level = bucket_level(KEYS[4], rate, burst, now) + (tonumber(info.g) or 0)
bucket_store(KEYS[4], level, rate, burst, now)
queue_claim = true
return admit_body()
