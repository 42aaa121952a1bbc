-- reserve_warm.lua: what one warm-pool pod's creation needs, a cluster-bucket
-- token and a node slot, taken as a hold owned by the pod (SPEC W3), or nothing.
-- Real activations go first: the refill takes a token only while no one waits in
-- the fair queue (q:serving, tick.lua) and the bucket keeps `reserve` tokens
-- after it, and a slot only on a node without slot waiters (qn:<node>:serving)
-- that keeps `spare` slots free after it.
-- The hold has the fields admit.lua writes (no key, no lease, no pending entry),
-- so commit_hold.lua, cancel_hold.lua and release_sandbox.lua settle it as they
-- settle an activation's: the pod name stands where a sandbox id would.
--
-- KEYS: 1 limits hash, 2 cluster bucket, 3 hold:<id>, 4 settled:<id> (tombstone),
--       5 node registry, 6.. slots:<node>, one per candidate node, in ARGV's order.
-- ARGV: hold_id, pod name, cluster rate, cluster burst, cost, hold_ttl_ms,
--       reserve (the share of the bucket's burst it keeps), spare (slots a node keeps),
--       n, then n pairs (node name, slot capacity).
-- Returns {outcome ('reserved', 'refused' or 'cancelled'), now_ms, expires_ms,
--          node, refused by ('' | 'queue' | 'cluster bucket' | 'node slots'),
--          retry_ms (-1: none known), cluster tokens (after, or as found)}.

local hold_id, pod = ARGV[1], ARGV[2]
local d = {cap = 0, rate = 0, burst = 0, concurrency = 0,
           cluster_rate = tonumber(ARGV[3]), cluster_burst = tonumber(ARGV[4])}
local cost, hold_ttl = tonumber(ARGV[5]), tonumber(ARGV[6])
local reserve, spare = tonumber(ARGV[7]), tonumber(ARGV[8])
local nodes = {}
for j = 1, tonumber(ARGV[9]) do
  nodes[j] = {name = ARGV[8 + 2 * j], cap = tonumber(ARGV[9 + 2 * j]), key = KEYS[5 + j]}
end

local now = now_ms()
-- A reservation whose caller gave up on it was cancelled: take nothing.
if redis.call('EXISTS', KEYS[4]) == 1 then return {'cancelled', now, 0, '', '', -1, '0'} end

local lim = limits(KEYS[1], '', d)
local level = bucket_level(KEYS[2], lim.cluster_rate, lim.cluster_burst, now)
local function refuse(why, retry)
  return {'refused', now, 0, '', why, retry, fmt(level)}
end
-- Waiters in the fair queue are real activations the bucket already could not serve.
if redis.call('EXISTS', base_of(KEYS[1]) .. 'q:serving') == 1 then
  return refuse('queue', -1)
end
-- The burst is the bucket's own (a stored 'cluster' limit overrides the setting).
local floor = cost + math.min(reserve * lim.cluster_burst, lim.cluster_burst - cost)
if level < floor then
  local retry = -1
  if lim.cluster_rate > 0 then retry = math.ceil((floor - level) / lim.cluster_rate * 1000) end
  return refuse('cluster bucket', retry)
end

local unexpired = '(' .. now
local chosen = nil
-- A node whose slots have waiters (qn:<node>:serving) keeps what frees there for
-- them, as the bucket does: the refill never takes a slot an activation waits for.
for _, n in ipairs(nodes) do
  n.held = redis.call('ZCOUNT', n.key, unexpired, '+inf')
  if chosen == nil and n.held + spare < n.cap
      and redis.call('EXISTS', base_of(KEYS[1]) .. 'qn:' .. n.name .. ':serving') == 0 then
    chosen = n
  end
end
if #nodes > 0 and chosen == nil then
  local earliest = nil
  for _, n in ipairs(nodes) do
    local first = redis.call('ZRANGE', n.key, unexpired, '+inf', 'BYSCORE', 'LIMIT', 0, 1,
                             'WITHSCORES')
    if first[2] and (earliest == nil or tonumber(first[2]) < earliest) then
      earliest = tonumber(first[2])
    end
  end
  return refuse('node slots', earliest and earliest - now or -1)
end

local expires = now + hold_ttl
level = level - cost
bucket_store(KEYS[2], level, lim.cluster_rate, lim.cluster_burst, now)
local node = ''
if chosen ~= nil then
  redis.call('ZREMRANGEBYSCORE', chosen.key, '-inf', now)
  redis.call('ZADD', chosen.key, expires, 'h:' .. hold_id)
  extend(chosen.key, hold_ttl)
  redis.call('SADD', KEYS[5], chosen.name)
  extend(KEYS[5], hold_ttl)
  node = chosen.name
end
redis.call('HSET', KEYS[3], 'key', '', 'sandbox', pod, 'exp', expires,
  'client_tokens', '0', 'cluster_tokens', fmt(cost), 'lease', 0, 'pending', 0, 'node', node)
redis.call('PEXPIRE', KEYS[3], hold_ttl + 60000)
return {'reserved', now, expires, node, '', -1, fmt(level)}
