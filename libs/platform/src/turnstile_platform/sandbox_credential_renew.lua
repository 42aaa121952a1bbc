#!lua
-- Extend a sandbox's credential record for a renewed credential of the same
-- runtime (sandbox_credentials.CredentialIssuer.renew).
--
-- KEYS[1]: the record. ARGV[1]: the generation being renewed; ARGV[2]: ttl ms.
--
-- Returns 1 when the record now names the generation for another ttl, also when
-- it was missing (Redis lost its data: the substrate, which knows the runtime
-- runs, puts it back). Returns 0, changing nothing, when the record names
-- another generation or "revoked" (a newer runtime, or the runtime ended): a
-- renewal racing a Deactivate never brings a revoked credential back.
local current = redis.call("GET", KEYS[1])
if current and current ~= ARGV[1] then return 0 end
redis.call("SET", KEYS[1], ARGV[1], "PX", tonumber(ARGV[2]))
return 1
