-- release_sandbox.lua: a sandbox stopped; free what it still holds: the node slot
-- of its committed hold, and its pending entry (a stopped sandbox is neither live
-- nor pending; without this its entry would count until it expires). The slot
-- goes to the node's fair queue first (_queue.lua's grant_slots).
--
-- KEYS: 1 sandbox:<id>, then (clock)
--       (its slots:<node> and pending:<key> are read from it: built from
--       KEYS[1]'s base, in its slot)
-- ARGV: sandbox_id
-- Returns 1 when anything was released, 0 when the sandbox held nothing.

local base, sandbox = base_of(KEYS[1]), ARGV[1]
local h = redis.call('HMGET', KEYS[1], 'node', 'key')
local node, key = h[1], h[2]
if not node and not key then return 0 end
redis.call('DEL', KEYS[1])
local released = 0
if node and redis.call('ZREM', base .. 'slots:' .. node, 's:' .. sandbox) == 1 then
  released = 1
  -- The freed slot goes to the node's first waiter, if any (SPEC Q1).
  grant_slots(base, queue_keys(base), node, now_ms())
end
if key and redis.call('ZREM', base .. 'pending:' .. key, sandbox) == 1 then
  released = 1
  -- Room under the key's cap: to its first per-client waiter, if any.
  grant_own(base, queue_keys(base), key, now_ms())
end
return released
