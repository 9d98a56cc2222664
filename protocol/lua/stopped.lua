-- KEYS: batch hash. ARGV: why submission stopped, lines rejected. Seals the batch with that
-- reason. Loaded with Redis 7's `allow-oom` flag where Redis reads flags (protocol.scripts), so
-- it writes when Redis is out of memory, since that is when it is needed (a few bytes); Redis 6
-- reads no flags, and refuses it then.
redis.call('HSET', KEYS[1], 'error', ARGV[1], 'sealed', 1)
if tonumber(ARGV[2]) > 0 then redis.call('HINCRBY', KEYS[1], 'rejected', ARGV[2]) end
return 1
