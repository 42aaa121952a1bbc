-- _decision_stream.lua: one entry appended to one of the decision log's streams,
-- with that stream's bounds (SPEC Q3, N3). Prepended to admission's decision
-- scripts (after _decision_log.lua's helpers) and to decision_append.lua; not a
-- script itself.
--
-- The log is one stream per bounded key (<base>decisions:k:<key>) beside the
-- platform's (<base>decisions:platform), all in admission's slot {adm}. Each
-- stream has its own bounds, so one key's flood trims only its own history:
-- by length on every append (XADD MAXLEN ~ max_entries) and by age (XTRIM MINID
-- ~ now - max_age) once per trim period (a second, or a tenth of max_age when
-- shorter), found by the stream's TTL: the expiry is set one period past
-- max_age, so it drops below max_age once a period has passed since the last
-- trim (or was never set). One PTTL per append instead of TIME, XTRIM, PEXPIRE.
--
-- With a sandbox, the entry is also written to the key's sandbox stream
-- (<stream>:sb:<sandbox>, under the same id when the stream allows it), so a
-- read of one sandbox is an XREVRANGE of its entries alone. Bounded per key:
-- sb_max entries per sandbox (MAXLEN ~), sb_keep sandboxes (a sorted set
-- <stream>:sbs by last entry; past sb_keep the least recent sandbox's stream is
-- deleted), and the same age as the key's stream (its score: id ms * 1000 + seq). sb_max 0: no sandbox streams.
--
-- In each trim period the stream is also recorded in the log's index (a sorted
-- set <base>decisions:streams, stream name -> last trim ms), which lists the
-- streams for an operator's read of everything and for the export's consumer
-- groups; a stream not recorded for longer than it can live leaves it.
-- Entry ids are Redis TIME (XADD '*'), so age is measured on Redis TIME too.
-- max_entries 0 turns the log off: nothing is written.

-- The age trim's period in ms (the head comment): at most a second.
local LOG_TRIM_MS = 1000

-- Append one entry (fields: a flat list of name, value) to stream and keep its
-- bounds; index is the log's index. Returns the entry's id (nil when off).
local function log_append(stream, index, sandbox, bounds, fields)
  local max_entries, max_age = bounds[1], bounds[2]
  if max_entries <= 0 then return nil end
  local id = redis.call('XADD', stream, 'MAXLEN', '~', max_entries, '*', unpack(fields))
  local period = math.min(LOG_TRIM_MS, math.floor(max_age / 10))
  local sb_max, sb_keep = bounds[3], bounds[4]
  local sandboxes = stream .. ':sbs'
  if sb_max > 0 and sandbox ~= '' then
    local sb = stream .. ':sb:' .. sandbox
    -- The key's id, unless this sandbox's stream already has a later one (a
    -- clock that went back across a failover): then its own next id.
    local same = redis.pcall('XADD', sb, 'MAXLEN', '~', sb_max, id, unpack(fields))
    if type(same) == 'table' and same.err then
      redis.call('XADD', sb, 'MAXLEN', '~', sb_max, '*', unpack(fields))
    end
    redis.call('PEXPIRE', sb, max_age + period)
    -- Ordered by the entry's id (ms, then up to 999 entries within one ms).
    local ms, seq = string.match(id, '^(%d+)-(%d+)$')
    local order = tonumber(ms) * 1000 + math.min(tonumber(seq), 999)
    if redis.call('ZADD', sandboxes, order, sandbox) == 1
        and redis.call('ZCARD', sandboxes) > sb_keep then
      local oldest = redis.call('ZPOPMIN', sandboxes)
      redis.call('DEL', stream .. ':sb:' .. oldest[1])
    end
  end
  if redis.call('PTTL', stream) < max_age then
    local t = redis.call('TIME')
    local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
    local ttl = max_age + period
    redis.call('XTRIM', stream, 'MINID', '~', math.max(0, now - max_age))
    redis.call('PEXPIRE', stream, ttl)
    if sb_max > 0 then
      redis.call('ZREMRANGEBYSCORE', sandboxes, '-inf', (now - ttl) * 1000)
      redis.call('PEXPIRE', sandboxes, ttl)
    end
    redis.call('ZADD', index, now, stream)
    redis.call('ZREMRANGEBYSCORE', index, '-inf', now - ttl - period)
    redis.call('PEXPIRE', index, ttl + period)
  end
  return id
end
