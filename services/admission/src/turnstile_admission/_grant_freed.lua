-- _grant_freed.lua: what the scripts that free a node slot or a key's room
-- (commit_hold, cancel_hold, release_sandbox) call to grant it to the waiters
-- first (SPEC Q1); prepended after queue_helpers, not a script itself.
--
-- queue_helpers() is _queue.lua and _own_queue.lua wrapped as one function (see
-- redis_store.script_text): a script's top level creates a closure for each
-- local function on every run, so these scripts, which run on every
-- activation, create the queue's helpers only when a waiter is there to grant
-- to (measured: ~6 us of Redis CPU per call otherwise). Without waiters, each
-- costs one EXISTS.

-- A slot freed on node: to its first waiter, if any.
local function grant_freed_slot(base, node, now)
  if redis.call('EXISTS', base .. 'qn:' .. node .. ':levels') == 0 then return end
  local h = queue_helpers()
  h.grant_slots(base, h.queue_keys(base), node, now)
end

-- Room freed under a key's limits (a lease, a pending entry, tokens): to its
-- first per-client waiter, if any.
local function grant_freed_room(base, key, now)
  if redis.call('EXISTS', base .. 'q:own:' .. key) == 0 then return end
  local h = queue_helpers()
  h.grant_own(base, h.queue_keys(base), key, now)
end
