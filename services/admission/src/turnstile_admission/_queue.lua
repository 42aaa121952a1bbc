-- _queue.lua: helpers of the fair queue's scripts (enqueue, tick, claim, leave, and
-- the scripts that free node slots), prepended after _common.lua; not a script
-- itself (SPEC Q1, Q2, docs/admission.md).
--
-- The queue's keys, all in admission's slot ('<prefix>{adm}:q:...'):
--   q:levels          zset  priority level -> virtual finish tag of its next grant
--   q:active:<l>      zset  bounded key -> virtual finish tag of its head, in level l
--   q:key:<l>:<key>   zset  waiter id -> arrival number (FIFO within the key)
--   q:info            hash  waiter id -> JSON {s = 'w' waiting | 'g' granted, k = key,
--                           l = level, o = owner replica, g = tokens granted,
--                           n = candidate nodes of a slot waiter, gn = node granted,
--                           t = when it joined (ms), for queue_position.lua}
--   q:exp             zset  waiter id -> expiry (ms): its budget, then its claim's
--   q:meta            hash  LV (levels' virtual time), V:<l> (level l's), seq (arrivals),
--                           n:<l> (level l's waiters not yet granted)
--   q:vf              hash  <l>:<key> and level:<l> -> the last tag it was served at
--   q:owners          zset  replica id -> alive until (ms), refreshed by its ticks
--   q:granted:<o>     zset  waiter id -> grant time: granted, not yet told to replica o
--   q:serving         string, with a short TTL: waiters are being served, so the
--                           cluster bucket is theirs (admit.lua's one queue check)
--   q:pace            hash  n:<node> | o:<key> -> '<last grant ms>:<mean gap ms>': how
--                           fast a queue that frees at no known rate (a node's
--                           slots, a key's own limits) was granted lately
-- A node's slots have a queue of the same shape ('a scope'), for calls that wait
-- for a slot there (a waiter of several candidate nodes waits in each):
--   qn:<node>:levels, :active:<l>, :key:<l>:<key>, :meta, :vf   as above
--   qn:<node>:serving string, short TTL: the node's free slots are its waiters'
--   q:slotq           hash  cap:<node> -> its slots (as its last waiter was told),
--                           and what the scripts that free slots need to grant them:
--                           shares, claim_ttl, owner_ttl (written by enqueue.lua)
--   q:wnodes          set   nodes with slot waiters (tick.lua frees their expired slots)
-- Two levels of weighted fair queuing by self-clocked virtual finish times: first
-- across priority levels (weights: their guaranteed shares, SPEC Q2), then across
-- the level's bounded keys (weights: the keys'). A level or key that joins (it had
-- nothing waiting) starts at max(virtual time, its last tag) + cost / weight, so
-- an idle one banks no credit: its share goes to those waiting (work-conserving,
-- a level's unused share borrowed) and comes back as soon as it waits again.

local function queue_keys(base)
  return {p = base .. 'q:', levels = base .. 'q:levels', info = base .. 'q:info',
          exp = base .. 'q:exp', meta = base .. 'q:meta', vf = base .. 'q:vf',
          owners = base .. 'q:owners', serving = base .. 'q:serving',
          slotq = base .. 'q:slotq', wnodes = base .. 'q:wnodes',
          ownq = base .. 'q:ownq', ownkeys = base .. 'q:ownkeys', pace = base .. 'q:pace'}
end

-- A node's slot queue: the scope of the same fair machinery as the cluster bucket's.
local function node_scope(base, node)
  local p = base .. 'qn:' .. node .. ':'
  return {p = p, node = node, levels = p .. 'levels', meta = p .. 'meta', vf = p .. 'vf',
          serving = p .. 'serving'}
end

local function active_of(sc, level) return sc.p .. 'active:' .. level end
local function queue_of(sc, level, key) return sc.p .. 'key:' .. level .. ':' .. key end
local function granted_of(base, owner) return base .. 'q:granted:' .. owner end
local function slots_of(base, node) return base .. 'slots:' .. node end

-- The scopes a waiting waiter is queued in: its candidate nodes', or the bucket's.
local function scopes_of(base, q, info)
  if type(info.n) ~= 'table' then return {q} end
  local out = {}
  for j, node in ipairs(info.n) do out[j] = node_scope(base, node) end
  return out
end

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
local function join_tag(sc, vkey, last_field, step)
  local v = tonumber(redis.call('HGET', sc.meta, vkey)) or 0
  local last = tonumber(redis.call('HGET', sc.vf, last_field)) or 0
  if last > v then v = last end
  return v + step
end

-- One waiter joins a scope's queue (its key's, in its level), behind every
-- earlier arrival of its key. Returns the keys written.
local function join(sc, wid, key, level, seq, weight, share, cost)
  local qk, active = queue_of(sc, level, key), active_of(sc, level)
  redis.call('HINCRBY', sc.meta, 'n:' .. level, 1)
  redis.call('ZADD', qk, seq, wid)
  if redis.call('ZSCORE', active, key) == false then
    redis.call('ZADD', active, join_tag(sc, 'V:' .. level, level .. ':' .. key, cost / weight), key)
  end
  if redis.call('ZSCORE', sc.levels, level) == false then
    redis.call('ZADD', sc.levels, join_tag(sc, 'LV', 'level:' .. level, cost / share), level)
  end
  return {qk, active, sc.levels, sc.meta, sc.vf}
end

-- One waiter leaves a scope's queue; the scope's key and level go with their last
-- waiter, and a node's serving mark with its queue's last.
local function unqueue(q, sc, wid, level, key)
  local qk = queue_of(sc, level, key)
  if redis.call('ZREM', qk, wid) == 1 then redis.call('HINCRBY', sc.meta, 'n:' .. level, -1) end
  if redis.call('EXISTS', qk) == 0 then
    local active = active_of(sc, level)
    redis.call('ZREM', active, key)
    if redis.call('EXISTS', active) == 0 then redis.call('ZREM', sc.levels, level) end
  end
  if sc.node and redis.call('EXISTS', sc.levels) == 0 then
    redis.call('DEL', sc.serving)
    redis.call('SREM', q.wnodes, sc.node)
  end
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

local drop_waiter
-- A per-client queue's waiter's removal (_own_queue.lua, which assigns it).
local drop_own

-- The next waiter of a scope in fair order (a level, then a key of it, then the
-- key's oldest), taken off the queue with the virtual times moved past it; nil
-- when the scope has none. Waiters found dead on the way (their replica gone, or
-- their budget ended before a sweep reached them) are dropped without serving
-- their key. Returns the waiter id, its record, and how many were dropped.
local function pop_next(base, q, sc, now, limits_key, shares, cost, weights)
  local dropped = 0
  while true do
    local top_level = redis.call('ZRANGE', sc.levels, 0, 0, 'WITHSCORES')
    if not top_level[1] then return nil, nil, dropped end
    local lvl, ltag = top_level[1], tonumber(top_level[2])
    local active = active_of(sc, lvl)
    local top = redis.call('ZRANGE', active, 0, 0, 'WITHSCORES')
    if not top[1] then
      redis.call('ZREM', sc.levels, lvl)
    else
      local key, tag = top[1], tonumber(top[2])
      local qk = queue_of(sc, lvl, key)
      local head = redis.call('ZRANGE', qk, 0, 0)
      local wid, info, alive = head[1], nil, false
      if not wid then
        redis.call('ZREM', active, key)
      else
        redis.call('ZREM', qk, wid)
        redis.call('HINCRBY', sc.meta, 'n:' .. lvl, -1)
        info = decode(redis.call('HGET', q.info, wid))
        alive = info ~= nil and info.s == 'w'
          and (tonumber(redis.call('ZSCORE', q.exp, wid)) or 0) > now
          and (tonumber(redis.call('ZSCORE', q.owners, info.o)) or 0) > now
        if alive then
          redis.call('HSET', sc.meta, 'V:' .. lvl, tag, 'LV', ltag)
          redis.call('HSET', sc.vf, lvl .. ':' .. key, tag, 'level:' .. lvl, ltag)
        else
          -- It holds nothing (never granted): out of every queue it is in.
          if info == nil or info.s == 'w' then drop_waiter(base, q, wid, now) end
          dropped = dropped + 1
        end
        if redis.call('EXISTS', qk) == 0 then
          redis.call('ZREM', active, key)
        elseif alive then
          if not weights[key] then weights[key] = key_queueing(limits_key, key, shares, '') end
          redis.call('ZADD', active, tag + cost / weights[key], key)
        end
      end
      if redis.call('EXISTS', active) == 0 then
        redis.call('ZREM', sc.levels, lvl)
      elseif alive then
        redis.call('ZADD', sc.levels, ltag + cost / (tonumber(shares[lvl]) or 1), lvl)
      end
      if alive then return wid, info, dropped end
    end
  end
end

-- The pace of a queue whose room frees at no known rate: a node's slots free when
-- sandboxes stop, a key's cap when its sandboxes go. Its estimates come from how
-- fast it was granted lately: a moving mean of the gap between grants, each gap
-- counted from the later of the previous grant and the granted waiter's arrival
-- (a queue that sat empty does not count its idle time). One HGET and one HSET a
-- grant; bounded by nodes and keys; a pace older than PACE_STALE_MS says nothing.
local PACE_WEIGHT, PACE_STALE_MS, PACE_TTL_MS = 0.3, 600000, 3600000

local function read_pace(q, field)
  local raw = redis.call('HGET', q.pace, field)
  if not raw then return nil, nil end
  local last, mean = string.match(raw, '^([^:]*):(.*)$')
  return tonumber(last), tonumber(mean)
end

local function note_pace(q, field, now, joined)
  local last, mean = read_pace(q, field)
  local gap = nil
  if last then gap = now - last end
  joined = tonumber(joined)
  if joined and (gap == nil or now - joined < gap) then gap = now - joined end
  if gap then
    if gap < 0 then gap = 0 end
    if mean then mean = mean + PACE_WEIGHT * (gap - mean) else mean = gap end
  end
  redis.call('HSET', q.pace, field, now .. ':' .. (mean and fmt(mean) or ''))
  redis.call('PEXPIRE', q.pace, PACE_TTL_MS)
end

-- A queue's mean gap between grants lately (ms, at least 1), or nil: none known.
local function pace_gap_ms(q, field, now)
  local last, mean = read_pace(q, field)
  if not last or not mean or now - last > PACE_STALE_MS then return nil end
  if mean < 1 then return 1 end
  return mean
end

-- Mark a waiter granted and tell its replica (its next tick wakes it).
local function mark_granted(base, q, wid, info, now, claim_ttl, owner_ttl)
  redis.call('HSET', q.info, wid, cjson.encode(info))
  redis.call('ZADD', q.exp, now + claim_ttl, wid)
  local granted = granted_of(base, info.o)
  redis.call('ZADD', granted, now, wid)
  redis.call('PEXPIRE', granted, claim_ttl + owner_ttl)
end

-- Hand a node's free slots to its waiters, in fair order (SPEC Q1). Called by
-- every script that frees a slot there (cancel_hold, release_sandbox, commit_hold
-- moving a sandbox, a grant given back or not used) and by tick.lua's sweep of
-- the node's expired slots: a waiter costs a few commands per grant, never a
-- poll. Each grant reserves its slot ('g:<waiter>' in slots:<node>, expiring with
-- the claim), so the slots held never pass the node's capacity. One EXISTS when
-- the node has no waiters. Returns the grants made.
local function grant_slots(base, q, node, now)
  local sc = node_scope(base, node)
  if redis.call('EXISTS', sc.levels) == 0 then return 0 end
  local conf = redis.call('HMGET', q.slotq, 'cap:' .. node, 'shares', 'claim_ttl', 'owner_ttl')
  local capacity, shares = tonumber(conf[1]), decode(conf[2])
  local claim_ttl, owner_ttl = tonumber(conf[3]), tonumber(conf[4])
  if not capacity or not shares or not claim_ttl or not owner_ttl then return 0 end
  local slots = slots_of(base, node)
  local held = redis.call('ZCOUNT', slots, '(' .. now, '+inf')
  local grants, weights = 0, {}
  while held < capacity do
    local wid, info = pop_next(base, q, sc, now, base .. 'limits', shares, 1, weights)
    if not wid then break end
    -- Out of its other candidates' queues: it waits for one slot, not for each.
    for _, other in ipairs(info.n) do
      if other ~= node then unqueue(q, node_scope(base, other), wid, info.l, info.k) end
    end
    info.s, info.g, info.gn = 'g', 0, node
    mark_granted(base, q, wid, info, now, claim_ttl, owner_ttl)
    note_pace(q, 'n:' .. node, now, info.t)
    redis.call('ZADD', slots, now + claim_ttl, 'g:' .. wid)
    extend(slots, claim_ttl)
    held, grants = held + 1, grants + 1
  end
  if redis.call('EXISTS', sc.levels) == 0 then
    redis.call('DEL', sc.serving)
    redis.call('SREM', q.wnodes, node)
  end
  return grants
end

-- Remove one waiter whatever its state; the tokens it held (granted, unclaimed).
-- A slot it was granted and never used goes to the node's next waiter.
drop_waiter = function(base, q, wid, now)
  local info = decode(redis.call('HGET', q.info, wid))
  redis.call('HDEL', q.info, wid)
  redis.call('ZREM', q.exp, wid)
  if not info then return 0 end
  if info.own then return drop_own(base, q, wid, info, now) end
  if info.s == 'g' then
    redis.call('ZREM', granted_of(base, info.o), wid)
    if info.gn then
      redis.call('ZREM', slots_of(base, info.gn), 'g:' .. wid)
      grant_slots(base, q, info.gn, now)
    end
    return tonumber(info.g) or 0
  end
  for _, sc in ipairs(scopes_of(base, q, info)) do unqueue(q, sc, wid, info.l or '', info.k) end
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

-- The wait estimated for the position-th waiter of key (weight) in level of a
-- scope granting per_s a second, the key and its level counted as waiting
-- (enqueue.lua's join, peek.lua's would-be join). The key is served at its
-- weight's part of its level's waiting keys' weights, the level at its share of
-- the levels waiting. The weights are summed over at most ESTIMATE_KEYS waiting
-- keys (one HMGET), the rest counted at their mean: the same cost however many
-- keys wait.
local ESTIMATE_KEYS = 64

local function fair_wait_ms(limits_key, sc, level, key, weight, position, cost, per_s, shares)
  local share = tonumber(shares[level]) or 1
  local total = 0
  if redis.call('ZSCORE', sc.levels, level) == false then total = share end
  for _, l in ipairs(redis.call('ZRANGE', sc.levels, 0, -1)) do
    total = total + (tonumber(shares[l]) or 1)
  end
  local active = active_of(sc, level)
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
  local key_per_s = per_s * (share / total) * (weight / weights)
  return math.ceil(position * cost / key_per_s * 1000)
end

-- A cluster-bucket waiter's estimate (fair_wait_ms at the bucket's rate); -1 when
-- the bucket has no rate.
local function estimate_wait_ms(limits_key, q, level, key, weight, position, cost, default_rate,
                                shares)
  local rate = cluster_limits(limits_key, default_rate, 0)
  if rate <= 0 then return -1 end
  return fair_wait_ms(limits_key, q, level, key, weight, position, cost, rate, shares)
end

-- A slot waiter's estimate: on each candidate node whose pace is known, its place
-- there at the node's recent grant rate (fair_wait_ms); the soonest, as the first
-- node to free a slot grants it. -1 when no candidate's pace is known.
local function slot_wait_ms(base, q, wid, info, shares, now)
  local best, weight = -1, nil
  for _, node in ipairs(info.n) do
    local gap = pace_gap_ms(q, 'n:' .. node, now)
    local sc = node_scope(base, node)
    local rank = gap and redis.call('ZRANK', queue_of(sc, info.l or '', info.k), wid)
    if rank then
      -- The key's weight is read once, and only when some candidate has a pace.
      weight = weight or key_queueing(base .. 'limits', info.k, shares, info.l or '')
      local ms = fair_wait_ms(base .. 'limits', sc, info.l or '', info.k, weight, rank + 1, 1,
                              1000 / gap, shares)
      if best < 0 or ms < best then best = ms end
    end
  end
  return best
end
