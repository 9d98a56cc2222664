-- KEYS: batch hash. ARGV: parts of its done map. Only a new batch is split: an existing one
-- keeps where its marks already are.
if redis.call('EXISTS', KEYS[1]) == 0 then redis.call('HSET', KEYS[1], 'shards', ARGV[1]) end
return 1
