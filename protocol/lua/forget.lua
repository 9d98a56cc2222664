-- uses: marks
-- KEYS: batch hash, done hash, results stream, attempts hash. ARGV: job id, its input line (""
-- for none), and for a job known by its line, its result's stream entry ("" when that has left
-- the stream). Undo a job's result so it can run again (dead-letter requeue, a forced re-run):
-- 1 if there was one.
local entry
redis.call('HDEL', KEYS[4], ARGV[1])
if ARGV[2] ~= '' then
  local was = line_done(ARGV[2])
  redis.call('SETBIT', lines, ARGV[2], 0)
  redis.call('HSET', open, ARGV[1], ARGV[2])
  if not was then return 0 end
  if ARGV[3] == '' then return 1 end
  entry = ARGV[3]
else
  local marks = mark(ARGV[1])
  entry = redis.call('HGET', marks, ARGV[1])
  if not entry or entry == '' then
    redis.call('HSET', marks, ARGV[1], '')
    return 0
  end
  redis.call('HSET', marks, ARGV[1], '')
end
local got = redis.call('XRANGE', KEYS[3], entry, entry)
if #got > 0 then
  local fields = got[1][2]
  for i = 1, #fields, 2 do
    if fields[i] == 'result' then
      redis.call('HINCRBY', KEYS[1], cjson.decode(fields[i + 1])['status'], -1)
    end
  end
end
redis.call('XDEL', KEYS[3], entry)
return 1
