#!lua
-- Shared by every affinity script: prepended to each at load time (store.py),
-- so key names, time and the load index are written once. The first line makes
-- each a Redis 7 script with flags (none): a cluster node refuses a key of another
-- slot than the first one touched, and Redis refuses the whole script up front
-- when out of memory rather than failing its writes halfway.
--
-- Every script takes ARGV[1] = clock offset in ms (0 in production; tests move
-- time forward without sleeping). Time is Redis TIME, never a replica's clock:
-- replicas' clocks differ.
--
-- Keys: KEYS 1-4 are the shared indexes below; each script declares after them
-- every key it can name before it runs (the session's record, the worker's
-- presence, the tier's index). All keys share one hash tag, {affinity}, so each
-- script touches one slot. Keys that depend on what a script reads (the sandbox a
-- session's record names, the least-loaded sandbox it picks, the entries a prune
-- expires) are built here from the base of KEYS[1], never from an argument: they
-- carry KEYS[1]'s hash tag and are in its slot (docs/scaling.md says why this is
-- one tag, not one per tier).
local B = string.match(KEYS[1], "^(.-{affinity}:)load:all$")
if not B then error("KEYS[1] must be <prefix>{affinity}:load:all, got " .. KEYS[1]) end
local OFFSET = tonumber(ARGV[1])
local PRUNE_BATCH = 64

local K_LOAD_ALL = KEYS[1]
local K_PRESENCE_EXPIRY = KEYS[2]
local K_LEASE_EXPIRY = KEYS[3]
local K_LEASE_SANDBOX = KEYS[4]

local function k_presence(sb) return B .. "presence:" .. sb end
local function k_leases(sb) return B .. "leases:" .. sb end
local function k_detached(sb) return B .. "detached:" .. sb end
local function k_wake(sb) return B .. "wake:" .. sb end
-- Written before owners (one per tier); now only emptied, as presences attach again.
local function k_load_tier(tier) return B .. "load:tier:" .. tier end
-- One client's present sandboxes by load (SPEC O2), per scope: a tier when tiers
-- filter, "*" (all its sandboxes) when they do not. A tier is a label value (no
-- ":"), so the key names one (scope, client). These are placement's candidates.
local function k_load_own(scope, client) return B .. "load:own:" .. scope .. ":" .. client end

-- The platform's shared pool: sandboxes owned by "native" (SPEC O2).
local NATIVE = "native"

local function now_ms()
  local t = redis.call("TIME")
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + OFFSET
end

-- Presence of a sandbox as {tier, capacity, expires, endpoint, client, scope}, or nil
-- when it has none or it expired (heartbeats stopped). client: the sandbox's attested
-- owner, "" for none (SPEC O3); scope: the owner index it is in (its tier, or "*"
-- when tiers do not filter; the relay says which).
local function presence(sb, now)
  local p = redis.call("HMGET", k_presence(sb), "tier", "capacity", "expires", "endpoint",
    "client", "scope")
  if not p[3] or tonumber(p[3]) <= now then return nil end
  return {tier = p[1], capacity = tonumber(p[2]), expires = tonumber(p[3]), endpoint = p[4] or "",
    client = p[5] or "", scope = p[6] or p[1]}
end

-- A presence-expiry member: "<scope>/<sandbox>/<client>". Scopes and sandbox ids are
-- label values or "*" (no "/"); a client id may hold "/", so it is last. A member
-- written before owners is "<tier>/<sandbox>": it parses with client nil.
local function expiry_member(scope, sb, client) return scope .. "/" .. sb .. "/" .. client end
local function parse_member(member)
  local first = string.find(member, "/", 1, true)
  local scope, rest = string.sub(member, 1, first - 1), string.sub(member, first + 1)
  local second = string.find(rest, "/", 1, true)
  if not second then return scope, rest, nil end
  return scope, string.sub(rest, 1, second - 1), string.sub(rest, second + 1)
end

-- Put a present sandbox's load (leases / capacity) into its indexes: all sandboxes
-- (ListWorkers), and, when it has an owner, its owner's in its scope (placement).
-- Ties order by sandbox id (sorted-set order).
local function set_load(sb, p)
  local load = redis.call("ZCARD", k_leases(sb)) / p.capacity
  redis.call("ZADD", K_LOAD_ALL, load, sb)
  if p.client ~= "" then redis.call("ZADD", k_load_own(p.scope, p.client), load, sb) end
end

local function refresh_load(sb, now)
  local p = presence(sb, now)
  if p then set_load(sb, p) end
end

local function unindex(sb, scope, client)
  redis.call("ZREM", K_LOAD_ALL, sb)
  if client ~= "" then redis.call("ZREM", k_load_own(scope, client), sb) end
end

-- A lease's record in lease-sandbox: "<sandbox>/<client it was placed for>". One
-- written before owners is "<sandbox>" and parses with client "" (SPEC O2).
local function parse_lease(value)
  local slash = string.find(value, "/", 1, true)
  if not slash then return value, "" end
  return string.sub(value, 1, slash - 1), string.sub(value, slash + 1)
end

-- Drop expired leases and expired presence, a bounded batch per call, so the
-- load index stays exact without a sweeper. Amortised O(log n) per entry.
local function prune(now)
  local touched = {}
  local leases = redis.call("ZRANGEBYSCORE", K_LEASE_EXPIRY, "-inf", now, "LIMIT", 0, PRUNE_BATCH)
  for _, lease in ipairs(leases) do
    local value = redis.call("HGET", K_LEASE_SANDBOX, lease)
    redis.call("ZREM", K_LEASE_EXPIRY, lease)
    redis.call("HDEL", K_LEASE_SANDBOX, lease)
    if value then
      local sb = parse_lease(value)
      redis.call("ZREM", k_leases(sb), lease)
      touched[#touched + 1] = sb
    end
  end
  local gone = redis.call("ZRANGEBYSCORE", K_PRESENCE_EXPIRY, "-inf", now, "LIMIT", 0, PRUNE_BATCH)
  for _, member in ipairs(gone) do
    redis.call("ZREM", K_PRESENCE_EXPIRY, member)
    local scope, sb, client = parse_member(member)
    if not client then
      -- Written before owners: its tier's old index is emptied, its owner unknown.
      redis.call("ZREM", k_load_tier(scope), sb)
      client = ""
    end
    local p = presence(sb, now)
    if not p then
      redis.call("DEL", k_presence(sb))
      unindex(sb, scope, client)
    elseif client ~= "" and (p.scope ~= scope or p.client ~= client) then
      redis.call("ZREM", k_load_own(scope, client), sb)
    end
  end
  for _, sb in ipairs(touched) do refresh_load(sb, now) end
end

-- The least-loaded present sandbox with a free slot in a load index, with its
-- presence and load; nil when none. O(log n): the index is a sorted set by load.
-- Stale entries met on the way (gone, re-tiered, or of another owner than
-- ``client`` when one is given) are repaired, a few at most.
local function least_loaded(load_key, tier, client, now)
  for _ = 1, 8 do
    local found = redis.call("ZRANGEBYSCORE", load_key, "-inf", "(1", "WITHSCORES", "LIMIT", 0, 1)
    local sb = found[1]
    if not sb then return nil end
    local p = presence(sb, now)
    if not p then
      redis.call("ZREM", load_key, sb)
    elseif (tier and p.tier ~= tier) or (client and p.client ~= client) then
      redis.call("ZREM", load_key, sb)
    elseif redis.call("ZCARD", k_leases(sb)) < p.capacity then
      return sb, p, tonumber(found[2])
    else
      set_load(sb, p)
    end
  end
  return nil
end

-- Take a lease on a present sandbox (p: its presence) for ``client``; returns the
-- lease's expiry (ms). The lease is in the sandbox's lease set and in the global
-- expiry index, and it knows its sandbox and its client.
local function take_lease(sb, p, lease, ttl_ms, now, client)
  local expires = now + ttl_ms
  redis.call("ZADD", k_leases(sb), expires, lease)
  redis.call("PEXPIRE", k_leases(sb), ttl_ms)
  redis.call("ZADD", K_LEASE_EXPIRY, expires, lease)
  redis.call("HSET", K_LEASE_SANDBOX, lease, sb .. "/" .. client)
  set_load(sb, p)
  return expires
end

-- Whether a session of ``client`` may be placed on a sandbox present as ``p``
-- (SPEC O2): its owner's, or the native pool's when the tier shares it ("1");
-- never an ownerless sandbox, and nothing for a session of no client.
local function usable(p, client, shared)
  if client == "" or p.client == "" then return false end
  return p.client == client or (shared == "1" and p.client == NATIVE)
end

-- Choose where a session of ``client`` without a usable sandbox goes (SPEC O2, T7):
-- the least-loaded of the client's own sandboxes in the session's tier (scope "*":
-- all its sandboxes, when tiers do not filter), or of the native shared pool's when
-- the tier's settings share it (shared "1") and it is less loaded; ties go to the
-- client's own. Never another client's sandbox, and never an ownerless one.
local function pick(session_tier, filtered, client, shared, now)
  if client == "" then return nil end
  local scope, tier = "*", nil
  if filtered == "1" then scope, tier = session_tier, session_tier end
  local sb, p, load = least_loaded(k_load_own(scope, client), tier, client, now)
  if shared == "1" and client ~= NATIVE then
    local nsb, np, nload = least_loaded(k_load_own(scope, NATIVE), tier, NATIVE, now)
    if nsb and (not sb or nload < load) then return nsb, np end
  end
  return sb, p
end
