-- _queue.lua: helpers of the fair queue's scripts (enqueue, tick, claim, leave),
-- prepended after _common.lua; not a script itself (SPEC Q1, docs/admission.md).
--
-- The queue's keys, all in admission's slot ('<prefix>{adm}:q:...'):
--   q:active      zset  bounded key -> virtual finish tag of its head waiter
--   q:key:<key>   zset  waiter id -> arrival number (FIFO within the key)
--   q:info        hash  waiter id -> JSON {s = 'w' waiting | 'g' granted, k = key,
--                       o = owner replica, g = tokens granted}
--   q:exp         zset  waiter id -> expiry (ms): its budget, then its claim's
--   q:meta        hash  V (virtual time: the last tag served), seq (arrivals)
--   q:vf          hash  bounded key -> the last finish tag it was served at
--   q:owners      zset  replica id -> alive until (ms), refreshed by its ticks
--   q:granted:<o> zset  waiter id -> arrival: granted, not yet told to replica o
--   q:serving     string, with a short TTL: waiters are being served, so the
--                       cluster bucket is theirs (admit.lua's one queue check)
-- Weighted fair queuing by self-clocked virtual finish times: a key that joins
-- (its queue was empty) starts at max(V, its last tag) + cost / weight, so an
-- idle key banks no credit and its share goes to the keys waiting (work-conserving).

local function queue_keys(base)
  return {active = base .. 'q:active', info = base .. 'q:info', exp = base .. 'q:exp',
          meta = base .. 'q:meta', vf = base .. 'q:vf', owners = base .. 'q:owners',
          serving = base .. 'q:serving'}
end

local function queue_of(base, key) return base .. 'q:key:' .. key end
local function granted_of(base, owner) return base .. 'q:granted:' .. owner end

-- A key's weight: its limits document's 'weight', else the stored default's, else 1.
local function key_weight(limits_key, key)
  local raw = redis.call('HMGET', limits_key, 'default', 'key:' .. key)
  local w = field(decode(raw[2]), 'weight', field(decode(raw[1]), 'weight', 1))
  if w <= 0 then w = 1 end
  return w
end

-- The cluster bucket's rate and burst: the stored 'cluster' document over the defaults.
local function cluster_limits(limits_key, rate, burst)
  local doc = decode(redis.call('HGET', limits_key, 'cluster'))
  return field(doc, 'rate', rate), field(doc, 'burst', burst)
end

-- Give tokens back to the cluster bucket (a grant nobody claimed).
local function return_tokens(bucket_key, tokens, rate, burst, now)
  if tokens <= 0 then return end
  local level = bucket_level(bucket_key, rate, burst, now) + tokens
  if level > burst then level = burst end
  bucket_store(bucket_key, level, rate, burst, now)
end

-- Remove one waiter whatever its state; the tokens it held (granted, unclaimed).
local function drop_waiter(base, q, wid)
  local info = decode(redis.call('HGET', q.info, wid))
  redis.call('HDEL', q.info, wid)
  redis.call('ZREM', q.exp, wid)
  if not info then return 0 end
  if info.s == 'g' then
    redis.call('ZREM', granted_of(base, info.o), wid)
    return tonumber(info.g) or 0
  end
  local qk = queue_of(base, info.k)
  redis.call('ZREM', qk, wid)
  if redis.call('EXISTS', qk) == 0 then redis.call('ZREM', q.active, info.k) end
  return 0
end
