-- tick.lua: one replica's turn at serving the fair queue (SPEC Q1, Q2). Refills
-- the cluster bucket, sweeps expired waiters (a granted one's tokens go back),
-- then hands tokens to the heads of the queue in virtual-finish order (a level,
-- then a key of it: _queue.lua) while the bucket has them: each grant is a few
-- O(log n) commands, whoever's replica owns the waiter. Returns the waiters of this replica granted since its last tick (by
-- any replica's tick), so the replica wakes them; they claim with claim.lua.
--
-- KEYS: 1 limits hash, 2 cluster bucket, 3 q:granted:<owner>, then (clock).
-- ARGV: owner, cluster rate default, cluster burst default, cost, max_grants,
--       owner_ttl_ms, claim_ttl_ms, serving_ttl_ms, sweep_limit,
--       level shares (JSON object level -> share).
-- Returns: {{granted waiter ids of this owner}, waiters left, grants made,
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
  returned = returned + drop_waiter(base, q, wid)
  swept = swept + 1
end

local level = bucket_level(KEYS[2], rate, burst, now)
local start_level = level
level = level + returned
if level > burst then level = burst end
local grants = 0
local weights = {}
while grants < max_grants and level >= cost do
  local top_level = redis.call('ZRANGE', q.levels, 0, 0, 'WITHSCORES')
  if not top_level[1] then break end
  local lvl, ltag = top_level[1], tonumber(top_level[2])
  local active = active_of(base, lvl)
  local top = redis.call('ZRANGE', active, 0, 0, 'WITHSCORES')
  if not top[1] then
    redis.call('ZREM', q.levels, lvl)
  else
    local key, tag = top[1], tonumber(top[2])
    local qk = queue_of(base, lvl, key)
    local head = redis.call('ZRANGE', qk, 0, 0)
    local alive = false
    if not head[1] then
      redis.call('ZREM', active, key)
    else
      local wid = head[1]
      redis.call('ZREM', qk, wid)
      redis.call('HINCRBY', q.meta, 'n:' .. lvl, -1)
      local info = decode(redis.call('HGET', q.info, wid))
      alive = info ~= nil and info.s == 'w'
        and (tonumber(redis.call('ZSCORE', q.exp, wid)) or 0) > now
        and (tonumber(redis.call('ZSCORE', q.owners, info.o)) or 0) > now
      if not alive then
        -- Its replica is gone, or its budget ended before a sweep reached it: it
        -- holds nothing; drop it without serving the key.
        redis.call('HDEL', q.info, wid)
        redis.call('ZREM', q.exp, wid)
        swept = swept + 1
      else
        level = level - cost
        grants = grants + 1
        count_fairness(base, now, 'g', lvl, key)
        info.s, info.g = 'g', cost
        redis.call('HSET', q.info, wid, cjson.encode(info))
        redis.call('ZADD', q.exp, now + claim_ttl, wid)
        redis.call('ZADD', granted_of(base, info.o), now, wid)
        redis.call('PEXPIRE', granted_of(base, info.o), claim_ttl + owner_ttl)
        redis.call('HSET', q.meta, 'V:' .. lvl, tag, 'LV', ltag)
        redis.call('HSET', q.vf, lvl .. ':' .. key, tag, 'level:' .. lvl, ltag)
      end
      if redis.call('EXISTS', qk) == 0 then
        redis.call('ZREM', active, key)
      elseif alive then
        if not weights[key] then weights[key] = key_queueing(KEYS[1], key, shares, '') end
        redis.call('ZADD', active, tag + cost / weights[key], key)
      end
    end
    if redis.call('EXISTS', active) == 0 then
      redis.call('ZREM', q.levels, lvl)
    elseif alive then
      redis.call('ZADD', q.levels, ltag + cost / (tonumber(shares[lvl]) or 1), lvl)
    end
  end
end
if level ~= start_level then bucket_store(KEYS[2], level, rate, burst, now) end

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
