-- tick.lua: one replica's turn at serving the fair queue (SPEC Q1, Q2). Refills
-- the cluster bucket, sweeps expired waiters (a granted one's tokens go back),
-- then hands tokens to the heads of the queue in virtual-finish order (a level,
-- then a key of it: _queue.lua) while the bucket has them: each grant is a few
-- O(log n) commands, whoever's replica owns the waiter. Then, on each node with
-- slot waiters, frees the slots whose hold or claim expired and grants them (the
-- scripts that free a slot grant it themselves; expiry frees without a script),
-- and tries each key's own queue (per-client limits).
-- Returns the waiters of this replica granted since its last tick (by any
-- replica's tick or any script that freed a slot), so the replica wakes them;
-- they claim with claim.lua.
--
-- KEYS: 1 limits hash, 2 cluster bucket, 3 q:granted:<owner>, then (clock).
-- ARGV: owner, cluster rate default, cluster burst default, cost, max_grants,
--       owner_ttl_ms, claim_ttl_ms, serving_ttl_ms, sweep_limit,
--       level shares (JSON object level -> share).
-- Returns: {{granted waiter ids of this owner}, waiters left, grants made (tokens
--           and slots),
--           waiters swept, tokens returned, {level, waiters not yet granted, ...}}.
local owner = ARGV[1]
local cost, max_grants = tonumber(ARGV[4]), tonumber(ARGV[5])
local owner_ttl, claim_ttl = tonumber(ARGV[6]), tonumber(ARGV[7])
local serving_ttl, sweep_limit = tonumber(ARGV[8]), tonumber(ARGV[9])
local shares = cjson.decode(ARGV[10])
local base = base_of(KEYS[1])
local q = queue_keys(base)
local now = now_ms()
local rate, burst = cluster_limits(KEYS[1], tonumber(ARGV[2]), tonumber(ARGV[3]))
redis.call('ZADD', q.owners, now + owner_ttl, owner)
redis.call('ZREMRANGEBYSCORE', q.owners, '-inf', now)

-- Sweep: waiters past their budget, granted ones nobody claimed.
local returned, swept = 0, 0
local expired = redis.call('ZRANGE', q.exp, '-inf', now, 'BYSCORE', 'LIMIT', 0, sweep_limit)
for _, wid in ipairs(expired) do
  returned = returned + drop_waiter(base, q, wid, now)
  swept = swept + 1
end

local level = bucket_level(KEYS[2], rate, burst, now)
local start_level = level
level = level + returned
if level > burst then level = burst end
local grants = 0
local weights = {}
while grants < max_grants and level >= cost do
  local wid, info, dropped = pop_next(base, q, q, now, KEYS[1], shares, cost, weights)
  swept = swept + dropped
  if not wid then break end
  level = level - cost
  grants = grants + 1
  info.s, info.g = 'g', cost
  count_fairness(base, now, 'g', info.l, info.k)
  mark_granted(base, q, wid, info, now, claim_ttl, owner_ttl)
end
if level ~= start_level then bucket_store(KEYS[2], level, rate, burst, now) end

-- Node slots (SPEC Q1): on each node with waiters, slots whose hold or claim
-- expired are free; hand them to the node's waiters. Its serving mark is
-- renewed while it has waiters, so calls from outside wait their turn.
for _, node in ipairs(redis.call('SMEMBERS', q.wnodes)) do
  redis.call('ZREMRANGEBYSCORE', slots_of(base, node), '-inf', now)
  grants = grants + grant_slots(base, q, node, now)
  local sc = node_scope(base, node)
  if redis.call('EXISTS', sc.levels) == 1 then
    redis.call('SET', sc.serving, owner, 'PX', serving_ttl)
  else
    redis.call('SREM', q.wnodes, node)
  end
end

-- Per-client queues (_own_queue.lua): each key with waiters gets its head
-- granted if its limits have room again (its bucket refilled, a lease expired,
-- the live count dropped). Bounded by the keys (SPEC C3).
for _, key in ipairs(redis.call('SMEMBERS', q.ownkeys)) do
  grants = grants + grant_own(base, q, key, now)
end

local mine = redis.call('ZRANGE', KEYS[3], 0, -1)
if mine[1] then redis.call('DEL', KEYS[3]) end
local left = redis.call('HLEN', q.info)
local lengths, ungranted = {}, 0
for name in pairs(shares) do
  local n = tonumber(redis.call('HGET', q.meta, 'n:' .. name)) or 0
  lengths[#lengths + 1] = name
  lengths[#lengths + 1] = n
  ungranted = ungranted + n
end
-- The bucket is the waiters' only while some wait ungranted: a granted one's
-- tokens are already its own, so outsiders may take what refills meanwhile.
if ungranted > 0 then
  redis.call('SET', q.serving, owner, 'PX', serving_ttl)
else
  redis.call('DEL', q.serving)
end
return {mine, left, grants, swept, fmt(returned), lengths}
