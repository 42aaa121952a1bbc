-- release_sandbox.lua: a sandbox stopped; free what it still holds: the node slot
-- of its committed hold, and its pending entry (a stopped sandbox is neither live
-- nor pending; without this its entry would count until it expires). The slot
-- goes to the node's fair queue first (_grant_freed.lua).
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
local freed_slot = node and redis.call('ZREM', base .. 'slots:' .. node, 's:' .. sandbox) == 1
local freed_room = key and redis.call('ZREM', base .. 'pending:' .. key, sandbox) == 1
if not freed_slot and not freed_room then return 0 end
-- What it freed goes to the waiters first (SPEC Q1): the slot to its node's
-- first waiter, the room under the key's cap to its first per-client waiter.
local now = now_ms()
if freed_slot then grant_freed_slot(base, node, now) end
if freed_room then grant_freed_room(base, key, now) end
return 1
