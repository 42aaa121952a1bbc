-- Read a session's affinity record (GetSession).
--
-- KEYS: 5 session:<id>. Returns {} when there is none, else
-- {now_ms, pttl_ms, field1, value1, ...}.
local key = KEYS[5]
local fields = redis.call("HGETALL", key)
if #fields == 0 then return {} end
local out = {now_ms(), redis.call("PTTL", key)}
for _, v in ipairs(fields) do out[#out + 1] = v end
return out
