-- enqueue.lua: one Admit joins the fair queue (SPEC Q1, Q2), in its key's level:
-- the cluster bucket's, or, for a call that waits for a node slot, the queue of
-- each of its candidate nodes (the first of them to free a slot grants it), or,
-- for a call that waits for its own limits, its key's own queue (_own_queue.lua).
-- The waiter gets an owner (this replica) and an expiry (its budget): whatever
-- happens to the replica, tick.lua sweeps it once expired.
--
-- KEYS: 1 limits hash, then (clock). The queue's keys are built from KEYS[1]'s
-- base (the key's level is read here, from its limits document).
-- ARGV: waiter id, bounded key, owner, budget_ms, max_waiters, owner_ttl_ms,
--       serving_ttl_ms, cost, cluster rate default, structure ttl_ms,
--       level shares (JSON object level -> share), default level,
--       claim_ttl_ms, own limits (JSON {cap, conc, rate}: the limits the call
--       enforces; empty: not a per-client waiter), the limits' defaults (JSON,
--       as admit.lua takes them), max waiters of one key in one queue,
--       n, then n pairs (candidate node, its slots):
--       n > 0 waits for a slot on one of those nodes, n = 0 and no own limits
--       for the cluster bucket.
-- Returns: {'queued', position in the key's queue (1 = head), estimated wait ms
--           (-1 none: no cluster rate, or a slot's or own limits' queue with no
--           recent pace), waiters in all, level}, or {'full' | 'taken', 0, 0, waiters,
--           level} ('taken': the waiter id is already queued, nothing done), or
--           {'key_full', 0, 0, the key's waiters in that queue, level}.
local wid, key, owner = ARGV[1], ARGV[2], ARGV[3]
local budget, max_waiters = tonumber(ARGV[4]), tonumber(ARGV[5])
local owner_ttl, serving_ttl = tonumber(ARGV[6]), tonumber(ARGV[7])
local cost, default_rate, ttl = tonumber(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[10])
local shares, default_level = cjson.decode(ARGV[11]), ARGV[12]
local claim_ttl = tonumber(ARGV[13])
local own = ARGV[14] ~= '' and cjson.decode(ARGV[14]) or nil
local max_key_waiters = tonumber(ARGV[16])
local nodes, seen = {}, {}
for j = 1, tonumber(ARGV[17]) do
  local name = ARGV[16 + 2 * j]
  if not seen[name] then
    seen[name] = true
    nodes[#nodes + 1] = {name, tonumber(ARGV[17 + 2 * j])}
  end
end
local base = base_of(KEYS[1])
local q = queue_keys(base)
local now = now_ms()
local weight, level = key_queueing(KEYS[1], key, shares, default_level)
local waiting = redis.call('HLEN', q.info)
if waiting >= max_waiters then return {'full', 0, 0, waiting, level} end
-- An id already waiting (a caller's wait_id reused by a call on another replica,
-- fair_queue.waiter_of): this call must not share that entry or its grant.
if redis.call('HEXISTS', q.info, wid) == 1 then return {'taken', 0, 0, waiting, level} end
-- One key's share of the room: at most max_key_waiters in the queue it would join
-- (for a slot waiter, in its first candidate's), so a flood of one tenant's calls
-- cannot fill max_waiters for everyone else. One ZCARD.
local mine
if own then
  mine = own_queue_of(base, key)
elseif #nodes == 0 then
  mine = queue_of(q, level, key)
else
  mine = queue_of(node_scope(base, nodes[1][1]), level, key)
end
local key_waiting = redis.call('ZCARD', mine)
if key_waiting >= max_key_waiters then return {'key_full', 0, 0, key_waiting, level} end
local seq = redis.call('HINCRBY', q.meta, 'seq', 1)
local share = tonumber(shares[level]) or 1
local info = {s = 'w', k = key, l = level, o = owner, t = now}
redis.call('ZADD', q.exp, now + budget, wid)
redis.call('ZADD', q.owners, now + owner_ttl, owner)
-- Every structure outlives its newest entry, and no longer: an abandoned queue
-- (every replica gone) leaves nothing behind.
local written = {q.levels, q.exp, q.info, q.meta, q.vf, q.owners}
local position = 0

if own then
  info.own = own
  redis.call('HSET', q.ownq, 'defaults', ARGV[15], 'cost', cost, 'claim_ttl', claim_ttl,
             'owner_ttl', owner_ttl)
  local qk = own_queue_of(base, key)
  redis.call('ZADD', qk, seq, wid)
  redis.call('SADD', q.ownkeys, key)
  redis.call('HSET', q.info, wid, cjson.encode(info))
  written[#written + 1], written[#written + 2], written[#written + 3] = qk, q.ownq, q.ownkeys
  position = redis.call('ZCARD', qk)
elseif #nodes == 0 then
  for _, name in ipairs(join(q, wid, key, level, seq, weight, share, cost)) do
    written[#written + 1] = name
  end
  redis.call('HSET', q.info, wid, cjson.encode(info))
  redis.call('SET', q.serving, owner, 'PX', serving_ttl)
  count_fairness(base, now, 'd', level, key, fmt(weight))
  position = redis.call('ZCARD', queue_of(q, level, key))
else
  -- A slot costs 1, whatever the bucket's cost; the scripts that free slots read
  -- what they need to grant them from q:slotq.
  info.n = {}
  redis.call('HSET', q.slotq, 'shares', ARGV[11], 'claim_ttl', claim_ttl, 'owner_ttl', owner_ttl)
  written[#written + 1], written[#written + 2] = q.slotq, q.wnodes
  for j, n in ipairs(nodes) do
    info.n[j] = n[1]
    local sc = node_scope(base, n[1])
    redis.call('HSET', q.slotq, 'cap:' .. n[1], n[2])
    for _, name in ipairs(join(sc, wid, key, level, seq, weight, share, 1)) do
      written[#written + 1] = name
    end
    redis.call('SET', sc.serving, owner, 'PX', serving_ttl)
    redis.call('SADD', q.wnodes, n[1])
  end
  redis.call('HSET', q.info, wid, cjson.encode(info))
  position = redis.call('ZCARD', queue_of(node_scope(base, nodes[1][1]), level, key))
end
for _, name in ipairs(written) do redis.call('PEXPIRE', name, ttl) end
if own then
  -- Room made since the call was refused is granted now (reported by a tick).
  grant_own(base, q, key, now)
  return {'queued', position, own_wait_ms(base, q, wid, info, now), waiting + 1, level}
end
if #nodes > 0 then
  -- A slot freed by expiry since the call was refused is granted now, not at the
  -- next tick (the grant is reported by this replica's next tick all the same).
  for _, n in ipairs(nodes) do grant_slots(base, q, n[1], now) end
  return {'queued', position, slot_wait_ms(base, q, wid, info, shares, now), waiting + 1, level}
end
local estimate = estimate_wait_ms(KEYS[1], q, level, key, weight, position, cost, default_rate,
                                  shares)
return {'queued', position, estimate, waiting + 1, level}
