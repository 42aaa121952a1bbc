-- List present workers, least loaded first (ListWorkers).
--
-- KEYS: 5 the load index to list: load:all, load:tier:<tier> for one tier, or
-- load:own:<tier or *>:<client> for one client's sandboxes (SPEC O2).
-- Returns a flat list of {sandbox, tier, capacity, leases, labels_json, client} groups
-- (client: the sandbox's attested owner, "" for none).
local now = now_ms()
prune(now)
local index = KEYS[5]
local out = {}
for _, sb in ipairs(redis.call("ZRANGE", index, 0, -1)) do
  local p = redis.call("HMGET", k_presence(sb), "tier", "capacity", "labels", "expires", "client")
  if p[4] and tonumber(p[4]) > now then
    for _, v in ipairs({sb, p[1], p[2], redis.call("ZCARD", k_leases(sb)), p[3], p[5] or ""}) do
      out[#out + 1] = v
    end
  end
end
return out
