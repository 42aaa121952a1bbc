-- Return a lease (ReleaseLease, and every failed or cancelled Place).
--
-- ARGV: 2 lease id, 3 sandbox id ("" when the caller does not know where the
-- lease went). Returns 1 when released, 0 when it had already been released,
-- had expired, or is held on another sandbox.
local lease, expected = ARGV[2], ARGV[3]
local sb = redis.call("HGET", K_LEASE_SANDBOX, lease)
if not sb or (expected ~= "" and sb ~= expected) then return 0 end
redis.call("ZREM", k_leases(sb), lease)
redis.call("ZREM", K_LEASE_EXPIRY, lease)
redis.call("HDEL", K_LEASE_SANDBOX, lease)
refresh_load(sb, now_ms())
return 1
