-- peek.lua: where an Admit would join the fair queue, without joining (SPEC Q1,
-- Q4): what shadow mode and a dry run report of the queue. Read-only.
--
-- KEYS: 1 limits hash, then (clock).
-- ARGV: bounded key, cost, cluster rate default, level shares (JSON object level
--       -> share), default level.
-- Returns: {position it would take in its key's queue (1 = head), estimated wait
--           ms (-1 none), waiters in all, level}.
local key, cost, default_rate = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local shares, default_level = cjson.decode(ARGV[4]), ARGV[5]
local base = base_of(KEYS[1])
local q = queue_keys(base)
local weight, level = key_queueing(KEYS[1], key, shares, default_level)
local position = redis.call('ZCARD', queue_of(q, level, key)) + 1
local estimate = estimate_wait_ms(KEYS[1], q, level, key, weight, position, cost, default_rate,
                                  shares)
return {position, estimate, redis.call('HLEN', q.info), level}
