-- uses: marks
-- KEYS: batch hash, done hash, results stream, attempts hash. ARGV: job id, result json, status
-- field, ttl, now, prompt tokens, prompt tokens served from the prefix cache, completion tokens,
-- the model that answered ("" for none), the job's input line ("" for none). A recorded job's
-- delivery count goes (the result carries it): the done mark (or its line's bit) alone stops a
-- redelivery, so a finished job leaves only that behind. pcall: a counter that cannot go (a key
-- of the wrong type) must not fail the record after its writes.
local marks
if ARGV[10] ~= '' then
  if line_done(ARGV[10]) then return 0 end
  redis.call('XADD', KEYS[3], '*', 'id', ARGV[1], 'result', ARGV[2])
  redis.call('SETBIT', lines, ARGV[10], 1)
  redis.call('HDEL', open, ARGV[1])
  marks = lines
else
  marks = mark(ARGV[1])
  local done = redis.call('HGET', marks, ARGV[1])
  if done and done ~= '' then return 0 end
  local entry = redis.call('XADD', KEYS[3], '*', 'id', ARGV[1], 'result', ARGV[2])
  redis.call('HSET', marks, ARGV[1], entry)
end
redis.call('HINCRBY', KEYS[1], ARGV[3], 1)
redis.call('HINCRBY', KEYS[1], 'prompt_tokens', ARGV[6])
redis.call('HINCRBY', KEYS[1], 'cached_tokens', ARGV[7])
redis.call('HINCRBY', KEYS[1], 'completion_tokens', ARGV[8])
if ARGV[9] ~= '' then redis.call('HSET', KEYS[1], 'model', ARGV[9]) end
redis.call('HSET', KEYS[1], 'updated_at', ARGV[5])
redis.pcall('HDEL', KEYS[4], ARGV[1])
for _, key in ipairs({KEYS[1], marks, KEYS[3]}) do redis.call('EXPIRE', key, ARGV[4]) end
return 1
