-- uses: marks
-- KEYS: batch hash, done hash, attempts hash. ARGV: job id, ttl, its input line ("" for none).
-- A delivery starts: {1 if the job has a result already (its count goes: it left with that
-- result), deliveries started so far, why the batch was withdrawn or ""}.
local done
if ARGV[3] ~= '' then
  done = line_done(ARGV[3])
else
  done = redis.call('HGET', mark(ARGV[1]), ARGV[1])
  done = done and done ~= ''
end
local withdrawn = redis.call('HGET', KEYS[1], 'withdrawn') or ''
if done then
  redis.call('HDEL', KEYS[3], ARGV[1])
  return {1, 0, withdrawn}
end
local n = redis.call('HINCRBY', KEYS[3], ARGV[1], 1)
redis.call('EXPIRE', KEYS[3], ARGV[2])
return {0, n, withdrawn}
