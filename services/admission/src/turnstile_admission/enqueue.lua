-- enqueue.lua: one Admit joins the fair queue (SPEC Q1, Q2), in its key's level.
-- The waiter gets an owner (this replica) and an expiry (its budget): whatever
-- happens to the replica, tick.lua sweeps it once expired.
--
-- KEYS: 1 limits hash, then (clock). The queue's keys are built from KEYS[1]'s
-- base (the key's level is read here, from its limits document).
-- ARGV: waiter id, bounded key, owner, budget_ms, max_waiters, owner_ttl_ms,
--       serving_ttl_ms, cost, cluster rate default, structure ttl_ms,
--       level shares (JSON object level -> share), default level.
-- Returns: {'queued', position in the key's queue (1 = head), estimated wait ms
--           (-1 none), waiters in all, level}, or {'full', 0, 0, waiters, level}.
local wid, key, owner = ARGV[1], ARGV[2], ARGV[3]
local budget, max_waiters = tonumber(ARGV[4]), tonumber(ARGV[5])
local owner_ttl, serving_ttl = tonumber(ARGV[6]), tonumber(ARGV[7])
local cost, default_rate, ttl = tonumber(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[10])
local shares, default_level = cjson.decode(ARGV[11]), ARGV[12]
local base = base_of(KEYS[1])
local q = queue_keys(base)
local now = now_ms()
local weight, level = key_queueing(KEYS[1], key, shares, default_level)
local waiting = redis.call('HLEN', q.info)
if waiting >= max_waiters then return {'full', 0, 0, waiting, level} end
local qk, active = queue_of(base, level, key), active_of(base, level)
local seq = redis.call('HINCRBY', q.meta, 'seq', 1)
redis.call('HINCRBY', q.meta, 'n:' .. level, 1)
redis.call('ZADD', qk, seq, wid)
redis.call('ZADD', q.exp, now + budget, wid)
redis.call('HSET', q.info, wid, cjson.encode({s = 'w', k = key, l = level, o = owner}))
redis.call('ZADD', q.owners, now + owner_ttl, owner)
if redis.call('ZSCORE', active, key) == false then
  redis.call('ZADD', active, join_tag(q, 'V:' .. level, level .. ':' .. key, cost / weight), key)
end
local share = tonumber(shares[level]) or 1
if redis.call('ZSCORE', q.levels, level) == false then
  redis.call('ZADD', q.levels, join_tag(q, 'LV', 'level:' .. level, cost / share), level)
end
redis.call('SET', q.serving, owner, 'PX', serving_ttl)
count_fairness(base, now, 'd', level, key, fmt(weight))
-- Every structure outlives its newest entry, and no longer: an abandoned queue
-- (every replica gone) leaves nothing behind.
for _, name in ipairs({qk, active, q.levels, q.exp, q.info, q.meta, q.vf, q.owners}) do
  redis.call('PEXPIRE', name, ttl)
end
local position = redis.call('ZCARD', qk)
-- The estimate: the key is served at its weight's part of its level's waiting
-- keys' weights, the level at its share of the levels waiting. The weights are
-- summed over at most ESTIMATE_KEYS waiting keys (one HMGET), the rest counted
-- at their mean, so one join costs the same however many keys wait.
local ESTIMATE_KEYS = 64
local rate = cluster_limits(KEYS[1], default_rate, 0)
local estimate = -1
if rate > 0 then
  local total = 0
  for _, l in ipairs(redis.call('ZRANGE', q.levels, 0, -1)) do
    total = total + (tonumber(shares[l]) or 1)
  end
  local keys = redis.call('ZCARD', active)
  local sample = redis.call('ZRANGE', active, 0, ESTIMATE_KEYS - 1)
  local fields = {'default'}
  for i, k in ipairs(sample) do fields[i + 1] = 'key:' .. k end
  local docs = redis.call('HMGET', KEYS[1], unpack(fields))
  local default_weight = field(decode(docs[1]), 'weight', 1)
  local weights = 0
  for i = 2, #docs do
    local w = field(decode(docs[i]), 'weight', default_weight)
    if w <= 0 then w = 1 end
    weights = weights + w
  end
  weights = weights * keys / #sample
  local per_s = rate * (share / total) * (weight / weights)
  estimate = math.ceil(position * cost / per_s * 1000)
end
return {'queued', position, estimate, waiting + 1, level}
