-- commit_hold.lua: the hold's activation is done (the runtime exists).
-- Tokens stay spent, the concurrency lease is released, the pending entry stays
-- until the substrate sees the runtime live, the sandbox stops (ReleaseSandbox) or
-- it expires, and the node slot becomes the sandbox's (until ReleaseSandbox, or the
-- committed-slot backstop TTL). sandbox:<id> remembers both for ReleaseSandbox.
-- Every commit, of a hold found or not, leaves the hold id's tombstone, as
-- cancel_hold.lua does: an admit.lua of that id arriving later takes nothing.
-- With `prepaid` the runtime is a warm pod whose creation reserve_warm.lua paid:
-- the hold's cluster-bucket tokens go back, without over-crediting (SPEC W3).
--
-- KEYS: 1 hold:<id>, 2 node registry, 3 settled:<id> (the tombstone),
--       4 limits hash, 5 cluster bucket
--       (the hold's inflight:<key>, sandbox:<id> and slots:<node> depend on the
--       hold: built from KEYS[1]'s base, in its slot)
-- ARGV: hold_id, committed slot ttl ms, pending ttl ms, tombstone ttl ms,
--       prepaid (1/0), cluster rate, cluster burst
-- Returns {committed (1, or 0 when the hold was committed, cancelled or expired),
--          cluster tokens returned (a string)}.

local base = base_of(KEYS[1])
local hold_id, slot_ttl, pending_ttl = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local now = now_ms()
redis.call('SET', KEYS[3], '1', 'PX', ARGV[4])
local h = redis.call('HMGET', KEYS[1], 'key', 'sandbox', 'exp', 'lease', 'node', 'pending',
  'cluster_tokens')
local key, sandbox, exp, lease, node = h[1], h[2], tonumber(h[3]), h[4], h[5]
local pending = tonumber(h[6]) or 0
if not key then return {0, '0'} end
redis.call('DEL', KEYS[1])
if exp <= now then return {0, '0'} end
local returned = 0
local taken = tonumber(h[7]) or 0
if ARGV[5] == '1' and taken > 0 and key ~= '' then
  local d = {cap = 0, rate = 0, burst = 0, concurrency = 0,
             cluster_rate = tonumber(ARGV[6]), cluster_burst = tonumber(ARGV[7])}
  local lim = limits(KEYS[4], key, d)
  local level = bucket_level(KEYS[5], lim.cluster_rate, lim.cluster_burst, now)
  returned = math.min(taken, math.max(0, lim.cluster_burst - level))
  if returned > 0 then
    bucket_store(KEYS[5], level + returned, lim.cluster_rate, lim.cluster_burst, now)
  end
end
if lease == '1' and redis.call('ZREM', base .. 'inflight:' .. key, hold_id) == 1 then
  -- The released lease goes to the key's first per-client waiter, if any.
  grant_freed_room(base, key, now)
end
local sandbox_key = base .. 'sandbox:' .. sandbox
if pending > 0 then
  -- Which pending set holds this sandbox, so that stopping it removes the entry
  -- (else a sandbox stopped before the reflector saw it stays "pending" until
  -- its entry expires, and its room cannot be reused meanwhile).
  redis.call('HSET', sandbox_key, 'key', key)
  if redis.call('PTTL', sandbox_key) < pending_ttl then
    redis.call('PEXPIRE', sandbox_key, pending_ttl)
  end
end
if node and node ~= '' then
  local previous = redis.call('HGET', sandbox_key, 'node')
  if previous and previous ~= node
      and redis.call('ZREM', base .. 'slots:' .. previous, 's:' .. sandbox) == 1 then
    -- The sandbox moved: its old node's slot goes to that node's first waiter.
    grant_freed_slot(base, previous, now)
  end
  local slots = base .. 'slots:' .. node
  redis.call('ZREM', slots, 'h:' .. hold_id)
  redis.call('ZADD', slots, now + slot_ttl, 's:' .. sandbox)
  extend(slots, slot_ttl)
  redis.call('SADD', KEYS[2], node)
  extend(KEYS[2], slot_ttl)
  redis.call('HSET', sandbox_key, 'node', node)
  if redis.call('PTTL', sandbox_key) < slot_ttl then
    redis.call('PEXPIRE', sandbox_key, slot_ttl)
  end
end
return {1, fmt(returned)}
