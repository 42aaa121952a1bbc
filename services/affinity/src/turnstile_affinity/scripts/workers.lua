-- List present workers, least loaded first (ListWorkers).
--
-- KEYS: 5 load:all. ARGV: 2 a tier ("" for every tier), 3 a client ("\0" for every
-- owner; else only the sandboxes it owns, SPEC O2). A listing reads every present
-- sandbox's presence, so filtering here costs nothing more.
-- Returns a flat list of {sandbox, tier, capacity, leases, labels_json, client} groups
-- (client: the sandbox's attested owner, "" for none).
local tier, client = ARGV[2], ARGV[3]
local now = now_ms()
prune(now)
local out = {}
for _, sb in ipairs(redis.call("ZRANGE", KEYS[5], 0, -1)) do
  local p = redis.call("HMGET", k_presence(sb), "tier", "capacity", "labels", "expires", "client")
  local owner = p[5] or ""
  if p[4] and tonumber(p[4]) > now and (tier == "" or p[1] == tier)
    and (client == "\0" or owner == client) then
    for _, v in ipairs({sb, p[1], p[2], redis.call("ZCARD", k_leases(sb)), p[3], owner}) do
      out[#out + 1] = v
    end
  end
end
return out
