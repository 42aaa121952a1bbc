#!lua
-- Revoke one runtime's credential only if it is still the sandbox's current one
-- (sandbox_credentials.CredentialIssuer.revoke_generation).
--
-- KEYS[1]: the record. ARGV[1]: the generation of the runtime that ended;
-- ARGV[2]: ttl ms.
--
-- Returns 1 when the record named the generation and now says "revoked" for a
-- ttl. Returns 0, changing nothing, when it names another generation (a newer
-- runtime of the sandbox: revoking would cut it off), is already "revoked", or
-- is missing (nothing to revoke that a newer runtime did not already replace;
-- the credential's signed expiry still bounds it).
local current = redis.call("GET", KEYS[1])
if current ~= ARGV[1] then return 0 end
redis.call("SET", KEYS[1], "revoked", "PX", tonumber(ARGV[2]))
return 1
