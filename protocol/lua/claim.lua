-- uses: marks, claim_one
-- KEYS: batch hash, done hash. ARGV: ttl, then per job its id and its input line ("" for none).
-- One flag per job (claim_one.lua).
local flags, new, touched = {}, 0, {}
for i = 2, #ARGV, 2 do
  local flag, key = claim(ARGV[i], ARGV[i + 1])
  touched[key] = true
  if flag == 1 then new = new + 1 end
  flags[#flags + 1] = flag
end
if new > 0 then redis.call('HINCRBY', KEYS[1], 'total', new) end
for key in pairs(touched) do redis.call('EXPIRE', key, ARGV[1]) end
return flags
