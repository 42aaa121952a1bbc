#!lua
-- _common.lua: helpers prepended to every admission script (not a script itself).
-- The first line makes each a Redis 7 script with flags (none): a cluster node
-- refuses a key of another slot than the first one touched (an old-style script
-- may cross slots that live on one node), and Redis refuses the whole script up
-- front when out of memory rather than failing its writes halfway.
--
-- Time comes from Redis (TIME), so every replica and every script agree on the
-- clock. Tests freeze and advance it with _test_clock.lua, loaded only when the
-- service runs with test_clock: production calls carry no test-only key.
--
-- Keys: every key a script can name before it runs is in KEYS. A few depend on
-- what the script reads (a hold's bounded key and node, a sandbox's node); those
-- are built from base_of(KEYS[1]), never from an argument, so they carry the
-- declared key's hash tag ({adm}) and are in its slot (docs/scaling.md).

-- '<prefix>{adm}:', the part of a declared key every admission key starts with.
local function base_of(key)
  local base = string.match(key, '^(.-{adm}:)')
  if not base then error('not an admission key: ' .. key) end
  return base
end

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- A non-negative number from a limits document, or the fallback.
local function field(doc, name, fallback)
  if type(doc) ~= 'table' then return fallback end
  local v = tonumber(doc[name])
  if v == nil or v < 0 or v ~= v or v == math.huge then return fallback end
  return v
end

local function decode(raw)
  if not raw then return nil end
  local ok, doc = pcall(cjson.decode, raw)
  if ok and type(doc) == 'table' then return doc end
  return nil
end

-- The limits of one bounded key: its own entry over the stored defaults over the
-- settings' defaults (d). One HMGET, so a change applies on the next decision.
local function limits(limits_key, key, d)
  local raw = redis.call('HMGET', limits_key, 'default', 'cluster', 'key:' .. key)
  local default, cluster, own = decode(raw[1]), decode(raw[2]), decode(raw[3])
  local function pick(name, fallback)
    return field(own, name, field(default, name, fallback))
  end
  -- Shadow limits (SPEC Q4): a 'shadow' object in the key's own document, or in
  -- the stored default, beside the enforced limits. Reported, never enforced;
  -- nil where none is set.
  local own_shadow = type(own) == 'table' and own.shadow or nil
  local default_shadow = type(default) == 'table' and default.shadow or nil
  local function shadow(name)
    return field(own_shadow, name, field(default_shadow, name, nil))
  end
  return {
    shadow = {cap = shadow('cap'), rate = shadow('rate'), burst = shadow('burst'),
              concurrency = shadow('concurrency')},
    cap = math.floor(pick('cap', d.cap)),
    rate = pick('rate', d.rate),
    burst = pick('burst', d.burst),
    concurrency = math.floor(pick('concurrency', d.concurrency)),
    cluster_rate = field(cluster, 'rate', d.cluster_rate),
    cluster_burst = field(cluster, 'burst', d.cluster_burst),
  }
end

-- Tokens in a bucket now: refilled lazily from its last write, never above burst.
-- A missing bucket is full (its key expires once it would have refilled).
local function bucket_level(bucket_key, rate, burst, now)
  local v = redis.call('HMGET', bucket_key, 't', 'ts')
  local tokens, ts = tonumber(v[1]), tonumber(v[2])
  if tokens == nil or ts == nil then return burst end
  if now > ts then tokens = tokens + (now - ts) * rate / 1000 end
  if tokens > burst then tokens = burst end
  if tokens < 0 then tokens = 0 end
  return tokens
end

local function bucket_store(bucket_key, tokens, rate, burst, now)
  redis.call('HSET', bucket_key, 't', string.format('%.17g', tokens), 'ts', now)
  local ttl = 86400000
  if rate > 0 then ttl = math.ceil((burst - tokens) / rate * 1000) + 1000 end
  redis.call('PEXPIRE', bucket_key, math.max(ttl, 1000))
end

-- Keep a key at least ttl_ms longer (a zset lives as long as its newest member).
local function extend(key, ttl_ms)
  if redis.call('PTTL', key) < ttl_ms then redis.call('PEXPIRE', key, ttl_ms) end
end

-- extend() in one command, for a key the caller just wrote and knows the past
-- of: one it created (empty before the write) has no expiry yet and takes ttl_ms;
-- one that existed has an expiry, since every script that creates these keys
-- sets one in the same step, and GT only ever lengthens it (PEXPIRE's GT, Redis
-- 7.0: a later expiry than the current one, never a shorter). Saves the PTTL.
local function extend_written(key, ttl_ms, created)
  if created then
    redis.call('PEXPIRE', key, ttl_ms)
  else
    redis.call('PEXPIRE', key, ttl_ms, 'GT')
  end
end

local function fmt(x) return string.format('%.17g', x) end

-- True only inside claim.lua: the decision is a granted waiter's, whose tokens the
-- fair queue handed back to the cluster bucket for it (admit.lua's queue check).
local queue_claim = false

-- Inside claim.lua, for a granted slot waiter: the node whose slot the fair queue
-- reserved for it (SPEC Q1), which its decision may take past the node's queue.
local slot_claim = false

-- Inside claim.lua, for a granted per-client waiter: its key's room was reserved
-- for it and given back for its decision to take, past the key's own queue.
local own_claim = false
