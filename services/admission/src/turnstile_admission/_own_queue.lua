-- _own_queue.lua: the per-client queues of the fair queue (SPEC Q1: "per-client
-- limits may queue the same way, FIFO, when the caller asks"), prepended after
-- _queue.lua; not a script itself.
--
-- A call whose wait budget comes with queue_per_client, and that only its own
-- limits refuse (its cap, its concurrency, its key's bucket), waits in its key's
-- own queue: no other key is involved, so the order is FIFO, nothing to weigh.
--   q:own:<key>       zset  waiter id -> arrival number
--   q:ownkeys         set   keys with such waiters (tick.lua tries each)
--   q:ownq            hash  defaults (JSON: the limits' defaults, as admit.lua
--                           takes them), cost, claim_ttl, owner_ttl (enqueue.lua)
-- A waiter's record (q:info) has own = {cap, conc, rate}: the limits its call
-- enforces. Its head is granted when all of those are within again, and the
-- grant reserves what the call needs, so no later waiter of the key takes it:
-- a lease 'g:<waiter>' in inflight:<key>, an entry 'g:<waiter>' in pending:<key>
-- (both expiring with the claim), the cost taken from bucket:<key> (info.gt).
-- Grants are tried by tick.lua for every key with waiters (the key's bucket
-- refills, a lease expires, the substrate's live count drops: SPEC S4), and at
-- once by the scripts that release a lease (commit_hold, cancel_hold), a claim
-- that did not use its grant and a waiter that leaves with one.

local function own_queue_of(base, key) return base .. 'q:own:' .. key end

-- Whether every limit the waiter enforces has room for one more now, and its
-- key's bucket level (to take the cost from).
local function own_room(base, key, own, now, conf)
  local lim = limits(base .. 'limits', key, conf.defaults)
  local unexpired = '(' .. now
  if own.conc and redis.call('ZCOUNT', base .. 'inflight:' .. key, unexpired, '+inf')
      >= lim.concurrency then
    return false
  end
  if own.cap then
    local state = redis.call('GET', base .. 'live-state')
    local live = 0
    if state == 'counted' then live = redis.call('SCARD', base .. 'live:' .. key) end
    -- An unsupported or unavailable count counts 0: pending alone is a lower bound.
    if live + redis.call('ZCOUNT', base .. 'pending:' .. key, unexpired, '+inf') >= lim.cap then
      return false
    end
  end
  local tokens = 0
  if own.rate then
    tokens = bucket_level(base .. 'bucket:' .. key, lim.rate, lim.burst, now)
    if tokens < conf.cost then return false end
  end
  return true, tokens, lim
end

-- Grant the heads of a key's own queue while its limits have room (FIFO: the
-- head first; a head without room stops the key). Waiters found dead at the head
-- are dropped. One EXISTS when the key has no waiters. Returns the grants made.
local function grant_own(base, q, key, now)
  local qk = own_queue_of(base, key)
  if redis.call('EXISTS', qk) == 0 then return 0 end
  local raw = redis.call('HMGET', q.ownq, 'defaults', 'cost', 'claim_ttl', 'owner_ttl')
  local conf = {defaults = decode(raw[1]), cost = tonumber(raw[2])}
  local claim_ttl, owner_ttl = tonumber(raw[3]), tonumber(raw[4])
  if not conf.defaults or not conf.cost or not claim_ttl or not owner_ttl then return 0 end
  local grants = 0
  while true do
    local head = redis.call('ZRANGE', qk, 0, 0)
    local wid = head[1]
    if not wid then break end
    local info = decode(redis.call('HGET', q.info, wid))
    local alive = info ~= nil and info.s == 'w'
      and (tonumber(redis.call('ZSCORE', q.exp, wid)) or 0) > now
      and (tonumber(redis.call('ZSCORE', q.owners, info.o)) or 0) > now
    if not alive then
      redis.call('ZREM', qk, wid)
      if info == nil or info.s == 'w' then
        redis.call('HDEL', q.info, wid)
        redis.call('ZREM', q.exp, wid)
      end
    else
      local room, tokens, lim = own_room(base, key, info.own, now, conf)
      if not room then break end
      redis.call('ZREM', qk, wid)
      local until_ms = now + claim_ttl
      if info.own.conc then
        local inflight = base .. 'inflight:' .. key
        redis.call('ZADD', inflight, until_ms, 'g:' .. wid)
        extend(inflight, claim_ttl)
      end
      if info.own.cap then
        local pending = base .. 'pending:' .. key
        redis.call('ZADD', pending, until_ms, 'g:' .. wid)
        extend(pending, claim_ttl)
      end
      info.gt = 0
      if info.own.rate then
        bucket_store(base .. 'bucket:' .. key, tokens - conf.cost, lim.rate, lim.burst, now)
        info.gt = conf.cost
      end
      info.s = 'g'
      mark_granted(base, q, wid, info, now, claim_ttl, owner_ttl)
      note_pace(q, 'o:' .. key, now, info.t)
      grants = grants + 1
    end
  end
  if redis.call('EXISTS', qk) == 0 then redis.call('SREM', q.ownkeys, key) end
  return grants
end

-- A per-client waiter's estimate: its place at its key's recent grant pace
-- (_queue.lua's note_pace: a cap or a lease frees when a sandbox goes, at no
-- known rate) and, when it enforces its key's bucket, no sooner than the bucket
-- refills the cost of every waiter up to it. -1 when neither is known, or when
-- its cap or concurrency has no room and no pace is known (the bucket alone would
-- say "now" for a wait on a sandbox stopping).
local function own_wait_ms(base, q, wid, info, now)
  local rank = redis.call('ZRANK', own_queue_of(base, info.k), wid)
  if not rank then return -1 end
  local position, best = rank + 1, -1
  local gap = pace_gap_ms(q, 'o:' .. info.k, now)
  if gap then best = math.ceil(position * gap) end
  if info.own.rate then
    local raw = redis.call('HMGET', q.ownq, 'defaults', 'cost')
    local defaults, cost = decode(raw[1]), tonumber(raw[2])
    -- The bucket's refill times the wait only when nothing else holds it: a cap or
    -- a lease without room frees when a sandbox goes, at no known pace.
    if defaults and cost and not gap and (info.own.cap or info.own.conc)
        and not own_room(base, info.k, {cap = info.own.cap, conc = info.own.conc}, now,
                         {defaults = defaults}) then
      return -1
    end
    if defaults and cost then
      local lim = limits(base .. 'limits', info.k, defaults)
      if lim.rate > 0 then
        local need = position * cost - bucket_level(base .. 'bucket:' .. info.k, lim.rate,
                                                    lim.burst, now)
        local ms = 0
        if need > 0 then ms = math.ceil(need / lim.rate * 1000) end
        if ms > best then best = ms end
      end
    end
  end
  return best
end

-- Give back what a grant reserved (the lease, the pending entry, the tokens).
local function release_own(base, wid, info, now)
  local key = info.k
  redis.call('ZREM', base .. 'inflight:' .. key, 'g:' .. wid)
  redis.call('ZREM', base .. 'pending:' .. key, 'g:' .. wid)
  local tokens = tonumber(info.gt) or 0
  local defaults = decode(redis.call('HGET', base .. 'q:ownq', 'defaults'))
  if tokens > 0 and defaults then
    local lim = limits(base .. 'limits', key, defaults)
    return_tokens(base .. 'bucket:' .. key, tokens, lim.rate, lim.burst, now)
  end
end

-- drop_waiter's part for a waiter of its key's own queue (_queue.lua).
drop_own = function(base, q, wid, info, now)
  if info.s == 'g' then
    redis.call('ZREM', granted_of(base, info.o), wid)
    release_own(base, wid, info, now)
  else
    local qk = own_queue_of(base, info.k)
    redis.call('ZREM', qk, wid)
    if redis.call('EXISTS', qk) == 0 then redis.call('SREM', q.ownkeys, info.k) end
  end
  grant_own(base, q, info.k, now)
  return 0
end
