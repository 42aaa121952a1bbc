-- _test_clock.lua: tests only. Prepended after _common.lua when the service runs
-- with test_clock; the store then appends the test-clock key as the last of every
-- script's KEYS (after the keys a script counts from its arguments, so none of
-- them moves). now_ms is the time stored there, or Redis TIME while none is.

local redis_now_ms = now_ms
local function now_ms()
  local frozen = tonumber(redis.call('GET', KEYS[#KEYS]))
  if frozen then return frozen end
  return redis_now_ms()
end
