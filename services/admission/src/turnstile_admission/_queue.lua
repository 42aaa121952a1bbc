-- _queue.lua: helpers of the fair queue's scripts (enqueue, tick, claim, leave),
-- prepended after _common.lua; not a script itself (SPEC Q1, Q2, docs/admission.md).
--
-- The queue's keys, all in admission's slot ('<prefix>{adm}:q:...'):
--   q:levels          zset  priority level -> virtual finish tag of its next grant
--   q:active:<l>      zset  bounded key -> virtual finish tag of its head, in level l
--   q:key:<l>:<key>   zset  waiter id -> arrival number (FIFO within the key)
--   q:info            hash  waiter id -> JSON {s = 'w' waiting | 'g' granted, k = key,
--                           l = level, o = owner replica, g = tokens granted}
--   q:exp             zset  waiter id -> expiry (ms): its budget, then its claim's
--   q:meta            hash  LV (levels' virtual time), V:<l> (level l's), seq (arrivals),
--                           n:<l> (level l's waiters not yet granted)
--   q:vf              hash  <l>:<key> and level:<l> -> the last tag it was served at
--   q:owners          zset  replica id -> alive until (ms), refreshed by its ticks
--   q:granted:<o>     zset  waiter id -> grant time: granted, not yet told to replica o
--   q:serving         string, with a short TTL: waiters are being served, so the
--                           cluster bucket is theirs (admit.lua's one queue check)
-- Two levels of weighted fair queuing by self-clocked virtual finish times: first
-- across priority levels (weights: their guaranteed shares, SPEC Q2), then across
-- the level's bounded keys (weights: the keys'). A level or key that joins (it had
-- nothing waiting) starts at max(virtual time, its last tag) + cost / weight, so
-- an idle one banks no credit: its share goes to those waiting (work-conserving,
-- a level's unused share borrowed) and comes back as soon as it waits again.

local function queue_keys(base)
  return {levels = base .. 'q:levels', info = base .. 'q:info', exp = base .. 'q:exp',
          meta = base .. 'q:meta', vf = base .. 'q:vf', owners = base .. 'q:owners',
          serving = base .. 'q:serving'}
end

local function active_of(base, level) return base .. 'q:active:' .. level end
local function queue_of(base, level, key) return base .. 'q:key:' .. level .. ':' .. key end
local function granted_of(base, owner) return base .. 'q:granted:' .. owner end

-- A key's weight and level: its limits document's 'weight' and 'level', else the
-- stored default's, else 1 and the default level. A level not in shares is ignored.
local function key_queueing(limits_key, key, shares, default_level)
  local raw = redis.call('HMGET', limits_key, 'default', 'key:' .. key)
  local default, own = decode(raw[1]), decode(raw[2])
  local w = field(own, 'weight', field(default, 'weight', 1))
  if w <= 0 then w = 1 end
  local function named(doc)
    if type(doc) == 'table' and type(doc.level) == 'string' and shares[doc.level] then
      return doc.level
    end
    return nil
  end
  return w, named(own) or named(default) or default_level
end

-- The tag a level or key starts at when it joins: max(virtual time, its last) + step.
local function join_tag(q, vkey, last_field, step)
  local v = tonumber(redis.call('HGET', q.meta, vkey)) or 0
  local last = tonumber(redis.call('HGET', q.vf, last_field)) or 0
  if last > v then v = last end
  return v + step
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
  local level = info.l or ''
  local qk = queue_of(base, level, info.k)
  if redis.call('ZREM', qk, wid) == 1 then redis.call('HINCRBY', q.meta, 'n:' .. level, -1) end
  if redis.call('EXISTS', qk) == 0 then
    local active = active_of(base, level)
    redis.call('ZREM', active, info.k)
    if redis.call('EXISTS', active) == 0 then redis.call('ZREM', q.levels, level) end
  end
  return 0
end

-- The fairness index's counts (fairness.py, fairness.lua): per window of
-- FAIRNESS_WINDOW_MS, each level and key's joins ('d:<l>:<key>'), grants
-- ('g:<l>:<key>') and weight ('w:<l>:<key>'), in '<base>fairness:<window>', kept a
-- little longer than the minute the index covers. Bounded: levels × bounded keys.
local FAIRNESS_WINDOW_MS, FAIRNESS_TTL_MS = 10000, 70000

local function fairness_key(base, now)
  return base .. 'fairness:' .. math.floor(now / FAIRNESS_WINDOW_MS)
end

local function count_fairness(base, now, kind, level, key, weight)
  local name = fairness_key(base, now)
  redis.call('HINCRBY', name, kind .. ':' .. level .. ':' .. key, 1)
  if weight then redis.call('HSET', name, 'w:' .. level .. ':' .. key, weight) end
  redis.call('PEXPIRE', name, FAIRNESS_TTL_MS)
end

-- The wait estimated for the position-th waiter of key (weight) in level, the key
-- and its level counted as waiting (enqueue.lua's join, peek.lua's would-be join);
-- -1 when the cluster bucket has no rate. The key is served at its weight's part
-- of its level's waiting keys' weights, the level at its share of the levels
-- waiting. The weights are summed over at most ESTIMATE_KEYS waiting keys (one
-- HMGET), the rest counted at their mean: the same cost however many keys wait.
local ESTIMATE_KEYS = 64

local function estimate_wait_ms(limits_key, q, level, key, weight, position, cost, default_rate,
                                shares)
  local rate = cluster_limits(limits_key, default_rate, 0)
  if rate <= 0 then return -1 end
  local share = tonumber(shares[level]) or 1
  local total = 0
  if redis.call('ZSCORE', q.levels, level) == false then total = share end
  for _, l in ipairs(redis.call('ZRANGE', q.levels, 0, -1)) do
    total = total + (tonumber(shares[l]) or 1)
  end
  local active = active_of(base_of(limits_key), level)
  local keys = redis.call('ZCARD', active)
  local weights = 0
  if keys > 0 then
    local sample = redis.call('ZRANGE', active, 0, ESTIMATE_KEYS - 1)
    local fields = {'default'}
    for i, k in ipairs(sample) do fields[i + 1] = 'key:' .. k end
    local docs = redis.call('HMGET', limits_key, unpack(fields))
    local default_weight = field(decode(docs[1]), 'weight', 1)
    for i = 2, #docs do
      local w = field(decode(docs[i]), 'weight', default_weight)
      if w <= 0 then w = 1 end
      weights = weights + w
    end
    weights = weights * keys / #sample
  end
  if redis.call('ZSCORE', active, key) == false then weights = weights + weight end
  local per_s = rate * (share / total) * (weight / weights)
  return math.ceil(position * cost / per_s * 1000)
end
