-- admit.lua: one Admit decision, all checks and all consumption in one atomic step
-- (SPEC P1–P4). Either everything is taken (pending entry, concurrency lease,
-- tokens from both buckets, node slot) and recorded in a hold, or nothing is.
-- The cap's live count is read here too, from the live set the substrate's leader
-- keeps (SPEC S4): the decision is this one script, no other network call.
--
-- KEYS: 1 limits hash, 2 pending:<key>, 3 bucket:<key>, 4 cluster bucket,
--       5 inflight:<key>, 6 hold:<id>, 7 node registry,
--       8 live:<key>, 9 live-state marker, 10 settled:<id> (the hold's tombstone),
--       11 the key's decision-log stream (_decision_log.lua),
--       12 shadow-bucket:<key> (the key's shadow rate limit's bucket, SPEC Q4),
--       13.. slots:<node>, one per candidate node, in ARGV's order.
-- ARGV: hold_id, key, sandbox_id,
--       modes of cap, rate, concurrency, slots (0 not evaluated, 1 shadow, 2 enforce),
--       default cap, rate, burst, concurrency, cluster rate, cluster burst,
--       cost, hold_ttl_ms, pending_ttl_ms,
--       the log's max entries (0: off), max age in ms, entries per sandbox
--       stream (0: none) and sandboxes kept per key (_decision_stream.lua),
--       dry_run (1: decide and take nothing, log nothing: SPEC Q4),
--       for the log: trace id, sampled (1/0), caller identity, client, bounded
--       key's kind, key-set version, activation kind, the wait in the fair
--       queue so far in ms (empty: the call did not wait),
--       defer (1: the call may wait in the fair queue, SPEC Q1: a refusal only
--       the cluster bucket, or only node slots, made is not logged; the wait's
--       final decision is; 2: as 1, and a refusal only the key's own limits
--       made too: the call waits in its key's own queue),
--       n, then n pairs (node name, slot capacity).
-- Returns: {outcome, now_ms, hold_expires_ms, node,
--           then per policy in order slots, concurrency, cap, rate:
--             code (0 not evaluated, 1 within, 2 over, 3 unknown), limit, current,
--             retry_ms (-1 none), detail,
--           the number of the key's pending entries,
--           the live count used (-1 unsupported, -2 unavailable, -3 not read),
--           the pending entries this call dropped as expired (never seen live:
--           live_publish.lua removes those it sees, so an expired one is drift),
--           then per shadow limit in order concurrency, cap, rate: code (0 none
--           set, 1 within, 2 over), limit, current}
-- A dry run reads what a decision reads without writing: expired entries are
-- counted past (ZCOUNT) rather than removed, and nothing is taken or logged.
-- outcome is 'admit', 'refuse' or 'cancelled': the hold was settled (cancelled or
-- committed) before this script reached Redis — its caller gave up on it, or this
-- is a second delivery — and the settling left a tombstone, so nothing is
-- evaluated or taken.

local i = 0
local function str() i = i + 1; return ARGV[i] end
local function num() return tonumber(str()) end

local hold_id, key, sandbox = str(), str(), str()
local cap_mode, rate_mode, conc_mode, slot_mode = num(), num(), num(), num()
local d = {cap = num(), rate = num(), burst = num(), concurrency = num(),
           cluster_rate = num(), cluster_burst = num()}
local cost, hold_ttl, pending_ttl = num(), num(), num()
local log_bounds = {num(), num(), num(), num()}
local dry = num() == 1
local trace_id, sampled, identity, client = str(), str(), str(), str()
local key_kind, key_version, activation, waited = str(), str(), str(), str()
local defer = num()
local nodes = {}
for j = 1, num() do nodes[j] = {name = str(), cap = num(), key = KEYS[12 + j], held = 0} end

local now = now_ms()
-- A script can reach Redis after its caller gave up on it (a reply lost, a send
-- retried, a redirection followed after a timeout) and after the hold it would
-- take was settled: then it must take nothing, or the hold would stay until its
-- TTL with no one left to settle it.
if redis.call('EXISTS', KEYS[10]) == 1 then
  local out = {'cancelled', now, 0, ''}
  for _ = 1, 4 do
    for _, v in ipairs({0, 0, 0, -1, ''}) do out[#out + 1] = v end
  end
  out[#out + 1] = 0   -- pending entries: not read
  out[#out + 1] = -3  -- live count: not read
  out[#out + 1] = 0   -- expired pending entries: none dropped
  for _ = 1, 9 do out[#out + 1] = 0 end  -- shadow limits: not evaluated
  return out
end
-- Room under the key's own limits that freed by itself since the last grant (its
-- bucket refilled, a lease or a pending entry expired) goes to the key's own
-- queue first (_own_queue.lua; SPEC Q1, FIFO within a key): granted here, before
-- this call is judged, so a call from outside the queue (without a wait budget,
-- or one that will join behind) never takes what a waiter is owed. Not when this
-- is a per-client waiter's own claim (claim.lua: own_claim), whose grant was
-- given back for it to take; not in a dry run, which writes nothing. One EXISTS
-- when the key has no such waiters.
if not dry and not own_claim and (cap_mode > 0 or conc_mode > 0 or rate_mode > 0) then
  grant_freed_room(base_of(KEYS[1]), key, now)
end
local lim = limits(KEYS[1], key, d)
local refused = false
local function judge(mode, over)
  if over and mode == 2 then refused = true end
  if over then return 2 end
  return 1
end

-- Node slots: the first candidate with a free slot, in the caller's order.
-- A candidate's slots held are its unexpired entries, counted (ZCOUNT) rather
-- than its expired ones removed first: only the node a hold is taken on has
-- them removed, when it is written (below), so a decision reads each other
-- candidate with one command.
-- A node whose slots have waiters (its qn:<node>:serving mark, _queue.lua) keeps
-- a slot that frees for them: a call from outside the queue does not jump it.
local slots = {0, 0, 0, -1, ''}
local chosen = nil
local unexpired = '(' .. now
if slot_mode > 0 then
  local held, total, queued = 0, 0, false
  for _, n in ipairs(nodes) do
    n.held = redis.call('ZCOUNT', n.key, unexpired, '+inf')
    held, total = held + n.held, total + n.cap
    if chosen == nil and n.held < n.cap then
      if slot_claim == n.name
          or redis.call('EXISTS', base_of(KEYS[1]) .. 'qn:' .. n.name .. ':serving') == 0 then
        chosen = n
      else
        queued = true
      end
    end
  end
  local over = chosen == nil
  local retry = -1
  if over then
    -- Every candidate is full: the retry hint is the earliest slot to expire.
    -- Read only then (a first member per node), not on every decision.
    local earliest = nil
    for _, n in ipairs(nodes) do
      local first = redis.call('ZRANGE', n.key, unexpired, '+inf', 'BYSCORE', 'LIMIT', 0, 1,
                               'WITHSCORES')
      if first[2] then
        local e = tonumber(first[2])
        if earliest == nil or e < earliest then earliest = e end
      end
    end
    if earliest then retry = earliest - now end
  end
  slots = {judge(slot_mode, over), total, held, retry, over and queued and 'waiters first' or ''}
end

-- Concurrency: unexpired leases in flight.
local conc = {0, 0, 0, -1, ''}
local leases = 0
if conc_mode > 0 then
  local c
  if dry then
    c = redis.call('ZCOUNT', KEYS[5], unexpired, '+inf')
  else
    redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', now)
    c = redis.call('ZCARD', KEYS[5])
  end
  leases = c
  local over = c >= lim.concurrency
  local retry = -1
  if over then
    local first = redis.call('ZRANGE', KEYS[5], unexpired, '+inf', 'BYSCORE', 'LIMIT', 0, 1,
                             'WITHSCORES')
    if first[2] then retry = tonumber(first[2]) - now end
  end
  conc = {judge(conc_mode, over), lim.concurrency, c, retry, ''}
end

-- Cap: live (the leader's live set) plus pending entries not seen live yet.
local cap = {0, 0, 0, -1, ''}
local live = -3
local own_live = false
local expired = 0
-- The key's pending entries after the expired ones went (the answer reports
-- them, counted from here rather than read again), and whether this sandbox's
-- is among them.
local pending_count, own_pending = 0, false
if cap_mode > 0 then
  if dry then
    pending_count = redis.call('ZCOUNT', KEYS[2], unexpired, '+inf')
    local score = pending_count > 0 and redis.call('ZSCORE', KEYS[2], sandbox)
    own_pending = score and tonumber(score) > now or false
  else
    expired = redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
    pending_count = redis.call('ZCARD', KEYS[2])
    own_pending = pending_count > 0 and redis.call('ZSCORE', KEYS[2], sandbox) ~= false
  end
  local pending = pending_count
  if own_pending then pending = pending - 1 end
  local state = redis.call('GET', KEYS[9])
  if state == 'counted' then
    live = redis.call('SCARD', KEYS[8])
    own_live = live > 0 and redis.call('SISMEMBER', KEYS[8], sandbox) == 1
    if own_live then live = live - 1 end
  elseif state == 'unsupported' then
    live = -1
  else
    live = -2
  end
  if live == -1 and pending >= lim.cap then
    -- Unsupported (SPEC S4), but pending alone is a lower bound that reaches the cap.
    cap = {judge(cap_mode, true), lim.cap, pending, -1,
           'live count unsupported: pending alone reaches the cap'}
  elseif live == -1 then
    -- Unsupported (SPEC S4): this substrate cannot count; the cap cannot decide.
    cap = {3, lim.cap, pending, -1, 'live count unsupported'}
  elseif live == -2 then
    -- Unavailable (no leader, or a leader behind): a count that is not current is
    -- a lower bound of zero, never a licence. Pending alone refuses at the cap.
    local over = pending >= lim.cap
    cap = {judge(cap_mode, over), lim.cap, pending, -1,
           over and 'live count unavailable: pending alone reaches the cap' or ''}
  else
    local current = live + pending
    cap = {judge(cap_mode, current >= lim.cap), lim.cap, current, -1, ''}
  end
end

-- Shadow limits (SPEC Q4): each compared with what its enforced policy counted,
-- never refusing. {code (0 none set, 1 within, 2 over), limit, current}.
local sh = lim.shadow
local shadow = {concurrency = {0, 0, 0}, cap = {0, 0, 0}, rate = {0, 0, 0}}
if conc_mode > 0 and sh.concurrency then
  local limit = math.floor(sh.concurrency)
  shadow.concurrency = {leases >= limit and 2 or 1, limit, leases}
end
if cap_mode > 0 and sh.cap and cap[1] ~= 3 then
  local limit = math.floor(sh.cap)
  shadow.cap = {cap[3] >= limit and 2 or 1, limit, cap[3]}
end

-- Rate: the key's bucket and the cluster bucket, both or neither.
local rate = {0, 0, 0, -1, ''}
local client_tokens, cluster_tokens, rate_over = 0, 0, false
if rate_mode > 0 then
  client_tokens = bucket_level(KEYS[3], lim.rate, lim.burst, now)
  cluster_tokens = bucket_level(KEYS[4], lim.cluster_rate, lim.cluster_burst, now)
  -- While the fair queue has waiters (q:serving, tick.lua), the cluster bucket's
  -- tokens are theirs: a call from outside the queue does not jump it.
  if cluster_tokens >= cost and not queue_claim
      and redis.call('EXISTS', base_of(KEYS[1]) .. 'q:serving') == 1 then
    cluster_tokens = 0
  end
  if client_tokens < cost then
    rate_over = true
    local retry = -1
    if lim.rate > 0 then retry = math.ceil((cost - client_tokens) / lim.rate * 1000) end
    rate = {judge(rate_mode, true), lim.burst, math.floor(client_tokens), retry, 'client bucket'}
  elseif cluster_tokens < cost then
    rate_over = true
    local retry = -1
    if lim.cluster_rate > 0 then
      retry = math.ceil((cost - cluster_tokens) / lim.cluster_rate * 1000)
    end
    rate = {judge(rate_mode, true), lim.cluster_burst, math.floor(cluster_tokens), retry,
            'cluster bucket'}
  else
    rate = {judge(rate_mode, false), lim.burst, math.floor(client_tokens), -1, ''}
  end
end
-- A shadow rate limit has its own bucket (KEYS[12]), taken from when the decision
-- admits and it holds a token: the bucket the lower limit would have had.
local shadow_rate, shadow_burst, shadow_tokens = nil, nil, 0
if rate_mode > 0 and (sh.rate or sh.burst) then
  shadow_rate, shadow_burst = sh.rate or lim.rate, sh.burst or lim.burst
  shadow_tokens = bucket_level(KEYS[12], shadow_rate, shadow_burst, now)
  shadow.rate = {shadow_tokens < cost and 2 or 1, math.floor(shadow_burst),
                 math.floor(shadow_tokens)}
end

local function answer(outcome, expires, node)
  local out = {outcome, now, expires, node}
  for _, r in ipairs({slots, conc, cap, rate}) do
    for _, v in ipairs(r) do out[#out + 1] = v end
  end
  out[#out + 1] = pending_count
  out[#out + 1] = live
  out[#out + 1] = expired
  for _, s in ipairs({shadow.concurrency, shadow.cap, shadow.rate}) do
    for _, v in ipairs(s) do out[#out + 1] = v end
  end
  return out
end

local function logged(outcome, expires, node)
  local modes = {slot_mode, conc_mode, cap_mode, rate_mode}
  local results = {slots, conc, cap, rate}
  local hold = ''
  if outcome == 'admit' then hold = hold_id end
  local fields = {
    'at', now, 'kind', decision_kind(outcome, results, modes, shadow),
    'trace', trace_id, 'sampled', sampled, 'identity', identity,
    'client', client, 'sandbox', sandbox, 'key', key, 'key_kind', key_kind,
    'key_set', key_version, 'activation', activation,
    'verdicts', verdicts_json(results, modes, shadow),
    'hold', hold, 'hold_exp', expires, 'node', node}
  if waited ~= '' then
    fields[#fields + 1] = 'wait'
    fields[#fields + 1] = waited
  end
  log_decision(KEYS[11], log_bounds, sandbox, fields)
  return answer(outcome, expires, node)
end

if dry then
  local outcome = 'admit'
  if refused then outcome = 'refuse' end
  local node = ''
  if chosen ~= nil then node = chosen.name end
  return answer(outcome, 0, node)
end
if refused then
  local function over(mode, r) return mode == 2 and r[1] == 2 end
  -- Deferred when one shared resource alone refuses: the cluster bucket, or
  -- node slots; with defer 2, also when the key's own limits alone refuse
  -- (SPEC Q1).
  local by_rate, by_slots = over(rate_mode, rate), over(slot_mode, slots)
  local shared = by_rate ~= by_slots and (by_slots or rate[5] == 'cluster bucket')
    and not over(conc_mode, conc) and not over(cap_mode, cap)
  local own = defer == 2 and not by_slots and (not by_rate or rate[5] == 'client bucket')
  if defer > 0 and (shared or own) then
    return answer('refuse', 0, '')
  end
  return logged('refuse', 0, '')
end

-- Admitted: take everything. A shadow policy keeps its accounting true to what
-- happens (the lease, the pending entry) but takes what is not there.
local expires = now + hold_ttl
local taken_client, taken_cluster, lease, pending_score, node = 0, 0, 0, 0, ''
if rate_mode > 0 and not rate_over then
  bucket_store(KEYS[3], client_tokens - cost, lim.rate, lim.burst, now)
  bucket_store(KEYS[4], cluster_tokens - cost, lim.cluster_rate, lim.cluster_burst, now)
  taken_client, taken_cluster = cost, cost
end
if shadow_rate and shadow.rate[1] == 1 then
  bucket_store(KEYS[12], shadow_tokens - cost, shadow_rate, shadow_burst, now)
end
if conc_mode > 0 then
  redis.call('ZADD', KEYS[5], expires, hold_id)
  extend_written(KEYS[5], hold_ttl, leases == 0)
  lease = 1
end
if cap_mode > 0 and not own_live then
  -- A sandbox the live set already has is counted there; a pending entry too
  -- would count it twice until it expired.
  pending_score = now + pending_ttl
  redis.call('ZADD', KEYS[2], pending_score, sandbox)
  extend_written(KEYS[2], pending_ttl, pending_count == 0)
  if not own_pending then pending_count = pending_count + 1 end
end
if slot_mode > 0 and chosen ~= nil then
  redis.call('ZREMRANGEBYSCORE', chosen.key, '-inf', now)
  redis.call('ZADD', chosen.key, expires, 'h:' .. hold_id)
  extend_written(chosen.key, hold_ttl, chosen.held == 0)
  -- A node already registered means the registry exists, so it has an expiry.
  local registered = redis.call('SADD', KEYS[7], chosen.name) == 0
  if registered then extend_written(KEYS[7], hold_ttl, false) else extend(KEYS[7], hold_ttl) end
  node = chosen.name
end
redis.call('HSET', KEYS[6], 'key', key, 'sandbox', sandbox, 'exp', expires,
  'client_tokens', fmt(taken_client), 'cluster_tokens', fmt(taken_cluster),
  'lease', lease, 'pending', pending_score, 'node', node)
-- The record outlives its expiry a little so a late commit or cancel can tell
-- "expired" apart from "never existed"; the scripts check 'exp' themselves.
redis.call('PEXPIRE', KEYS[6], hold_ttl + 60000)
return logged('admit', expires, node)
