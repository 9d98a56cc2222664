-- uses: marks, claim_one
-- KEYS: batch hash, done hash, then the queue lists. ARGV: ttl, the feed's position after this
-- chunk ("" for none), the time, "1" to push again ids claimed before and not done ("" not to),
-- then per message: the index in KEYS of its list, its job count n, the message's JSON before
-- its envelopes and after them, then per job its id, its input line ("" for none) and its
-- envelope's piece (protocol.wire.frames). Claims each job as claim.lua does and pushes one
-- message of the new ones' pieces, in one step. An id claimed before and not done had its
-- envelope pushed by the script that claimed it, so it is in a queue or with a worker already:
-- pushing it again would only run it twice at once. It goes again when the caller knows that
-- message is gone (a forced re-run withdrew its result; a lost job is resent). Redis (6 and 7
-- alike) refuses a script's write for memory only until its first write has run, and only reads
-- come before the first claim: out of memory, the chunk is refused before anything is written,
-- else it runs whole. So a chunk is never counted without its messages in the queue, nor its
-- position moved.
local flags, new, touched = {}, 0, {}
local again = ARGV[4] ~= ''
local i = 5
while i <= #ARGV do
  local list, n = KEYS[tonumber(ARGV[i])], tonumber(ARGV[i + 1])
  local pieces = {}
  for j = i + 4, i + 1 + 3 * n, 3 do
    local flag, key = claim(ARGV[j], ARGV[j + 1])
    touched[key] = true
    if flag == 1 then new = new + 1 end
    if flag == 1 or (flag == 0 and again) then pieces[#pieces + 1] = ARGV[j + 2] end
    flags[#flags + 1] = flag
  end
  if #pieces > 0 then
    redis.call('LPUSH', list, ARGV[i + 2] .. table.concat(pieces, ',') .. ARGV[i + 3])
  end
  i = i + 4 + 3 * n
end
if new > 0 then redis.call('HINCRBY', KEYS[1], 'total', new) end
if ARGV[2] ~= '' then redis.call('HSET', KEYS[1], 'fed', ARGV[2], 'fed_at', ARGV[3]) end
for key in pairs(touched) do redis.call('EXPIRE', key, ARGV[1]) end
return flags
