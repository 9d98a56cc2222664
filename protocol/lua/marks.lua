-- The prelude of every script that reads or writes a job's done mark: KEYS[1] is the batch
-- hash, KEYS[2] the done map's name, and mark(id) the key holding the id's mark. A map of
-- `shards` parts is keys the script derives, not keys it is given: vqueue runs on a single
-- Redis (kombu's transport does too), where a script may touch them.
local shards = tonumber(redis.call('HGET', KEYS[1], 'shards') or '1') or 1
local function mark(id)
  if shards <= 1 then return KEYS[2] end
  return KEYS[2] .. ':' .. (tonumber(string.sub(redis.sha1hex(id), 1, 8), 16) % shards)
end
local lines, open = KEYS[2] .. ':lines', KEYS[2] .. ':open'
local function line_done(line) return redis.call('GETBIT', lines, line) == 1 end
