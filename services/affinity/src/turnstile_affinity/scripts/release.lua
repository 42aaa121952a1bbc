-- Return a lease (ReleaseLease, and every failed or cancelled Place).
--
-- ARGV: 2 lease id, 3 sandbox id ("" when the caller does not know where the
-- lease went), 4 client ("" for whoever it was placed for). Returns 1 when
-- released, 0 when it had already been released, had expired, is held on another
-- sandbox, or was placed for another client (SPEC O2: answered as a missing one,
-- and nothing is written). A lease written before owners was placed for no client,
-- and any caller may release it.
local lease, expected, client = ARGV[2], ARGV[3], ARGV[4] or ""
local value = redis.call("HGET", K_LEASE_SANDBOX, lease)
if not value then return 0 end
local sb, owner = parse_lease(value)
if expected ~= "" and sb ~= expected then return 0 end
if client ~= "" and owner ~= "" and owner ~= client then return 0 end
redis.call("ZREM", k_leases(sb), lease)
redis.call("ZREM", K_LEASE_EXPIRY, lease)
redis.call("HDEL", K_LEASE_SANDBOX, lease)
refresh_load(sb, now_ms())
return 1
