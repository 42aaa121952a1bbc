#!lua
-- live_publish.lua: the only write to the live counts admission's cap reads
-- (SPEC S4): add or remove sandbox ids in their bounded key's live set, and set
-- or drop the live-state marker, fenced by the writer's leader epoch.
--
-- A 'set' moves the id from the key's pending set to its live set in this one
-- step, so between the two no sandbox is counted twice or not at all.
-- A writer whose epoch is older than the newest one seen is refused whole: a
-- deposed leader slow to notice cannot touch the sets.
--
-- KEYS: 1 live-epoch, 2 live-sandboxes (hash id -> key), 3 live-state,
--       then per op: 'set' -> live:<key>, pending:<key>; 'del' -> live:<key>.
-- A writer that has written before in its term ('continuing') finds its epoch
-- here; if it does not, Redis lost the live counts (restarted without them, or
-- failed over to a replica that never got them) and the writer's idea of what is
-- published is wrong: nothing is applied, so a renewal cannot mark empty sets
-- current, and the writer resyncs.
--
-- ARGV: epoch, state ('' leave it, '-' drop it, else the value to set),
--       state ttl ms, continuing ('1' or '0'),
--       then per op: kind ('set' or 'del'), sandbox id, key.
-- Returns {1, ids added or removed} when applied, {0, newest epoch} when fenced,
-- {2, 0} when a continuing writer's epoch is gone (nothing applied).

local epoch = tonumber(ARGV[1])
local seen = redis.call('GET', KEYS[1])
if not seen and ARGV[4] == '1' then return {2, 0} end
local newest = tonumber(seen or '0')
if epoch < newest then return {0, newest} end
-- 'not seen': the first leader's epoch is 0 (a Lease's first term has no
-- transitions yet), which must be written too, or its own next write finds none.
if epoch > newest or not seen then redis.call('SET', KEYS[1], epoch) end

local k, changed = 3, 0
for a = 5, #ARGV, 3 do
  local kind, sandbox, key = ARGV[a], ARGV[a + 1], ARGV[a + 2]
  if kind == 'set' then
    changed = changed + redis.call('SADD', KEYS[k + 1], sandbox)
    redis.call('ZREM', KEYS[k + 2], sandbox)
    redis.call('HSET', KEYS[2], sandbox, key)
    k = k + 2
  else
    changed = changed + redis.call('SREM', KEYS[k + 1], sandbox)
    if redis.call('HGET', KEYS[2], sandbox) == key then redis.call('HDEL', KEYS[2], sandbox) end
    k = k + 1
  end
end

local state = ARGV[2]
if state == '-' then
  redis.call('DEL', KEYS[3])
elseif state ~= '' then
  redis.call('SET', KEYS[3], state, 'PX', tonumber(ARGV[3]))
end
return {1, changed}
