-- KEYS: entry, index (zset: entry -> expiry), sizes (hash: entry -> bytes), total bytes.
-- ARGV: value, ttl_s, max_bytes, now. Purges up to 200 expired entries, then stores the new
-- one unless it is already there or would pass the bound. Returns 1 if stored.
local gone = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', ARGV[4], 'LIMIT', 0, 200)
local freed = 0
for _, k in ipairs(gone) do
  freed = freed + tonumber(redis.call('HGET', KEYS[3], k) or '0')
  redis.call('HDEL', KEYS[3], k)
  redis.call('ZREM', KEYS[2], k)
end
local total = redis.call('DECRBY', KEYS[4], freed)
if total < 0 then redis.call('SET', KEYS[4], 0); total = 0 end
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local size = string.len(ARGV[1]) + string.len(KEYS[1])
if total + size > tonumber(ARGV[3]) then return -1 end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
redis.call('ZADD', KEYS[2], tonumber(ARGV[4]) + tonumber(ARGV[2]), KEYS[1])
redis.call('HSET', KEYS[3], KEYS[1], size)
redis.call('INCRBY', KEYS[4], size)
return 1
