-- usage.lua: a bounded key's usage for operators and the CLI (GetUsage).
-- Expired entries are dropped first, so what is shown is what Admit would see.
--
-- KEYS: 1 limits hash, 2 pending:<key>, 3 bucket:<key>, 4 cluster bucket,
--       5 inflight:<key>, 6 node registry, 7 live:<key>, 8 live-state,
--       9.. slots:<node> of the registry's nodes as the caller read them just before
-- ARGV: key, default cap, rate, burst, concurrency, cluster rate, cluster burst,
--       then the nodes of KEYS 9.. in order
-- Returns {pending ids, client tokens, burst, cluster tokens, cluster burst,
--          in flight, concurrency limit, cap, {node, held, node, held, ...},
--          live (-1 unsupported, -2 unavailable: as admit.lua reads it),
--          the pending entries dropped here as expired (as admit.lua reports them)}

local key = ARGV[1]
local d = {cap = tonumber(ARGV[2]), rate = tonumber(ARGV[3]), burst = tonumber(ARGV[4]),
           concurrency = tonumber(ARGV[5]), cluster_rate = tonumber(ARGV[6]),
           cluster_burst = tonumber(ARGV[7])}
local now = now_ms()
local lim = limits(KEYS[1], key, d)
local expired = redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', now)
-- The nodes the caller read from the registry: a node registered since shows on
-- the next call.
local nodes = {}
for j = 8, #ARGV do
  local node, slots = ARGV[j], KEYS[j + 1]
  redis.call('ZREMRANGEBYSCORE', slots, '-inf', now)
  local held = redis.call('ZCARD', slots)
  if held == 0 then
    redis.call('SREM', KEYS[6], node)
  else
    nodes[#nodes + 1] = node
    nodes[#nodes + 1] = held
  end
end
local live = -2
local state = redis.call('GET', KEYS[8])
if state == 'counted' then live = redis.call('SCARD', KEYS[7])
elseif state == 'unsupported' then live = -1 end
return {
  redis.call('ZRANGE', KEYS[2], 0, -1),
  fmt(bucket_level(KEYS[3], lim.rate, lim.burst, now)), fmt(lim.burst),
  fmt(bucket_level(KEYS[4], lim.cluster_rate, lim.cluster_burst, now)), fmt(lim.cluster_burst),
  redis.call('ZCARD', KEYS[5]), lim.concurrency, lim.cap, nodes, live, expired,
}
