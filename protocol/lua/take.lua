-- KEYS: the tenant's bucket. ARGV: rate (tokens/s), burst, n, and the time (seconds; "" for
-- Redis's own clock, which every producer shares). Takes n tokens if there are n, and returns
-- 0; else takes nothing and returns the milliseconds until there will be.
local rate, burst, n = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local now = tonumber(ARGV[4])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1e6
end
local b = redis.call('HMGET', KEYS[1], 'tokens', 'at')
local tokens = tonumber(b[1]) or burst
local at = tonumber(b[2]) or now
tokens = math.min(burst, tokens + (now - at) * rate)
local wait = 0
if tokens >= n then tokens = tokens - n else wait = math.ceil((n - tokens) / rate * 1000) end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'at', tostring(now))
redis.call('PEXPIRE', KEYS[1], math.ceil(burst / rate * 1000) + 60000)
return wait
