-- queue_position.lua: where one waiter stands in the fair queue now (SPEC Q1:
-- "while waiting, the caller can learn its position and an estimated wait").
-- Read-only: a caller polling GetQueuePosition costs one HGET and a few ZSCARD /
-- ZRANK reads, whatever the queue's length (estimate_wait_ms samples at most
-- ESTIMATE_KEYS keys' weights).
--
-- KEYS: 1 limits hash, then (clock). The queue's keys are built from KEYS[1]'s base.
-- ARGV: waiter id, cost, cluster rate default, level shares (JSON object level ->
--       share).
-- Returns: {state ('waiting', 'granted' or 'none'), position in its key's queue
--           (1 = head; 0 unless waiting), its key's waiters, estimated wait ms
--           (-1 none: no cluster rate, or a slot's or its own limits' waiter whose
--           queue has no recent pace),
--           waited ms (since it joined)}.
local wid, cost, default_rate = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local shares = cjson.decode(ARGV[4])
local base = base_of(KEYS[1])
local q = queue_keys(base)
local now = now_ms()
local info = decode(redis.call('HGET', q.info, wid))
if type(info) ~= 'table' or (tonumber(redis.call('ZSCORE', q.exp, wid)) or 0) <= now then
  return {'none', 0, 0, -1, 0}
end
local waited = 0
if tonumber(info.t) then waited = math.max(0, now - tonumber(info.t)) end
if info.s ~= 'w' then return {'granted', 0, 0, -1, waited} end
local qk
if info.own then
  qk = own_queue_of(base, info.k)
elseif type(info.n) == 'table' then
  qk = queue_of(node_scope(base, info.n[1]), info.l or '', info.k)
else
  qk = queue_of(q, info.l or '', info.k)
end
local rank = redis.call('ZRANK', qk, wid)
if rank == false then return {'none', 0, 0, -1, waited} end
local position, waiters = rank + 1, redis.call('ZCARD', qk)
local estimate
if info.own then
  estimate = own_wait_ms(base, q, wid, info, now)
elseif type(info.n) == 'table' then
  estimate = slot_wait_ms(base, q, wid, info, shares, now)
else
  local weight = key_queueing(KEYS[1], info.k, shares, info.l or '')
  estimate = estimate_wait_ms(KEYS[1], q, info.l or '', info.k, weight, position, cost,
                              default_rate, shares)
end
return {'waiting', position, waiters, estimate, waited}
