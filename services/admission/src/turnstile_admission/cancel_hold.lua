-- cancel_hold.lua: undo a hold whose activation failed or was abandoned.
-- Tokens go back to both buckets without over-crediting (a bucket never exceeds
-- its burst because of a refund); the lease, the pending entry (if it is still
-- this hold's) and the node slot are released (to the node's fair queue first:
-- _grant_freed.lua). The hold record is deleted in the
-- same step, so a second cancel finds nothing and returns nothing.
--
-- Every cancel, of a hold found or not, leaves a tombstone for the hold id
-- (as commit_hold.lua does): admit.lua takes no hold of a tombstoned id. An
-- Admit whose caller gave up (its reply lost, its budget spent) may still reach
-- Redis later — a send retried, a redirection followed — and would otherwise
-- take a hold after its cancel ran as a no-op, left to count against the cap
-- until its TTL. The tombstone lives as long as a hold record would (ARGV[6]).
--
-- KEYS: 1 hold:<id>, 2 limits hash, 3 cluster bucket, 4 settled:<id> (the tombstone)
--       (the hold's bucket:<key>, inflight:<key>, pending:<key> and slots:<node>
--       depend on the hold: built from KEYS[1]'s base, in its slot)
-- ARGV: hold_id, default rate, burst, cluster rate, cluster burst,
--       tombstone_ttl_ms
-- Returns {cancelled (0/1), client tokens returned, cluster tokens returned} (strings).

local base, hold_id = base_of(KEYS[1]), ARGV[1]
local d = {cap = 0, concurrency = 0, rate = tonumber(ARGV[2]), burst = tonumber(ARGV[3]),
           cluster_rate = tonumber(ARGV[4]), cluster_burst = tonumber(ARGV[5])}
local now = now_ms()
redis.call('SET', KEYS[4], '1', 'PX', ARGV[6])
local h = redis.call('HMGET', KEYS[1], 'key', 'sandbox', 'exp', 'lease', 'node', 'pending',
  'client_tokens', 'cluster_tokens')
local key, sandbox, exp = h[1], h[2], tonumber(h[3])
if not key then return {0, '0', '0'} end
redis.call('DEL', KEYS[1])
if exp <= now then return {0, '0', '0'} end

local lim = limits(KEYS[2], key, d)
local function refund(bucket_key, taken, rate, burst)
  if taken <= 0 then return 0 end
  local level = bucket_level(bucket_key, rate, burst, now)
  local back = math.min(taken, math.max(0, burst - level))
  if back > 0 then bucket_store(bucket_key, level + back, rate, burst, now) end
  return back
end
local client_back = refund(base .. 'bucket:' .. key, tonumber(h[7]) or 0, lim.rate, lim.burst)
local cluster_back = refund(KEYS[3], tonumber(h[8]) or 0, lim.cluster_rate, lim.cluster_burst)

if h[4] == '1' then redis.call('ZREM', base .. 'inflight:' .. key, hold_id) end
local node = h[5]
if node and node ~= '' and redis.call('ZREM', base .. 'slots:' .. node, 'h:' .. hold_id) == 1 then
  -- The freed slot goes to the node's first waiter, if any (SPEC Q1).
  grant_freed_slot(base, node, now)
end
local pending_score = tonumber(h[6]) or 0
if pending_score > 0 then
  local pending = base .. 'pending:' .. key
  -- Only this hold's entry: a later hold for the same sandbox re-scored it.
  if tonumber(redis.call('ZSCORE', pending, sandbox)) == pending_score then
    redis.call('ZREM', pending, sandbox)
  end
end
-- What came back (tokens, the lease, the pending entry) goes to the key's first
-- per-client waiter, if any (_grant_freed.lua).
grant_freed_room(base, key, now)
return {1, fmt(client_back), fmt(cluster_back)}
