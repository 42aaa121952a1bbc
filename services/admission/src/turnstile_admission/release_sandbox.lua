-- release_sandbox.lua: a sandbox stopped; free the node slot it still holds.
--
-- KEYS: 1 sandbox:<id>
-- ARGV: key base, sandbox_id
-- Returns 1 when a slot was released, 0 when the sandbox held nothing.

local base, sandbox = ARGV[1], ARGV[2]
local node = redis.call('HGET', KEYS[1], 'node')
if not node then return 0 end
redis.call('DEL', KEYS[1])
return redis.call('ZREM', base .. 'slots:' .. node, 's:' .. sandbox)
