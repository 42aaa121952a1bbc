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
local estimate = estimate_wait_ms(KEYS[1], q, level, key, weight, position, cost, default_rate,
                                  shares)
return {'queued', position, estimate, waiting + 1, level}
