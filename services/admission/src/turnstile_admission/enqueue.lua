-- enqueue.lua: one Admit joins the fair queue (SPEC Q1). The waiter gets an
-- owner (this replica) and an expiry (its budget): whatever happens to the
-- replica, tick.lua sweeps it once expired.
--
-- KEYS: 1 limits hash, 2 q:key:<key>, then (clock).
-- ARGV: waiter id, bounded key, owner, budget_ms, max_waiters, owner_ttl_ms,
--       serving_ttl_ms, cost, cluster rate default, structure ttl_ms.
-- Returns: {'queued', position in the key's queue (1 = head), estimated wait ms,
--           waiters in all}, or {'full', 0, 0, waiters}.
local wid, key, owner = ARGV[1], ARGV[2], ARGV[3]
local budget, max_waiters = tonumber(ARGV[4]), tonumber(ARGV[5])
local owner_ttl, serving_ttl = tonumber(ARGV[6]), tonumber(ARGV[7])
local cost, default_rate, ttl = tonumber(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[10])
local base = base_of(KEYS[1])
local q = queue_keys(base)
local now = now_ms()
local waiting = redis.call('HLEN', q.info)
if waiting >= max_waiters then return {'full', 0, 0, waiting} end
local seq = redis.call('HINCRBY', q.meta, 'seq', 1)
redis.call('ZADD', KEYS[2], seq, wid)
redis.call('ZADD', q.exp, now + budget, wid)
redis.call('HSET', q.info, wid, cjson.encode({s = 'w', k = key, o = owner}))
redis.call('ZADD', q.owners, now + owner_ttl, owner)
if redis.call('ZSCORE', q.active, key) == false then
  local v = tonumber(redis.call('HGET', q.meta, 'V')) or 0
  local last = tonumber(redis.call('HGET', q.vf, key)) or 0
  if last > v then v = last end
  redis.call('ZADD', q.active, v + cost / key_weight(KEYS[1], key), key)
end
redis.call('SET', q.serving, owner, 'PX', serving_ttl)
-- Every structure outlives its newest entry, and no longer: an abandoned queue
-- (every replica gone) leaves nothing behind.
for _, name in ipairs({KEYS[2], q.exp, q.info, q.meta, q.vf, q.owners, q.active}) do
  redis.call('PEXPIRE', name, ttl)
end
local position = redis.call('ZCARD', KEYS[2])
-- The estimate assumes equal weights: one grant per waiting key per round.
local rate = cluster_limits(KEYS[1], default_rate, 0)
local estimate = -1
if rate > 0 then
  local keys = redis.call('ZCARD', q.active)
  estimate = math.ceil(position * keys * cost / rate * 1000)
end
return {'queued', position, estimate, waiting + 1}
