"""The Lua scripts that make enqueueing, taking, handing back and acknowledging messages atomic in Redis.

A script runs alone on the server, so a message is always in exactly one place: its queue, or the unacked
hash with a lease. No lock is taken, so a worker killed at any moment leaves nothing held. Messages are
never parsed on the fetch path; only a handed-back message is read, for its task id (a rare path).
"""

from __future__ import annotations

# KEYS: the job's record hash, the pending-jobs index, the queue. ARGV: the record's lifetime (seconds), now
# (Unix seconds), the job id, the message, then the record's field/value pairs. ``infer.delay``'s one write:
# the job's record and its message together, as one command with one reply (a MULTI/EXEC of the same four
# writes costs redis-py six replies to pack and parse, most of a call's time; bench/README.md).
RECORD_AND_PUSH = """
redis.call('HSET', KEYS[1], unpack(ARGV, 5))
redis.call('EXPIRE', KEYS[1], ARGV[1])
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[3])
return redis.call('LPUSH', KEYS[3], ARGV[4])
"""

# KEYS: unacked hash, unacked index, lost-counts hash, delivery-tag counter, then the queues, most urgent
# first. ARGV: now (Unix seconds), the most messages to take, then the most to take from each queue.
# Pops up to ARGV[2] messages (filling from the first queue, then the next) and, in the same step, records
# each as held: unacked[tag] = "queue\nmessage", unacked_index[tag] = now. Returns a flat list of
# tag, queue, message, lost count (times a worker holding it vanished) per message taken.
FETCH = """
local limit = tonumber(ARGV[2])
local counting = redis.call('HLEN', KEYS[3]) > 0
local taken = {}
for q = 5, #KEYS do
  if limit <= 0 then break end
  local messages = nil
  local most = math.min(limit, tonumber(ARGV[q - 2]))
  if most > 0 then messages = redis.call('RPOP', KEYS[q], most) end
  if messages then
    local first = redis.call('INCRBY', KEYS[4], #messages) - #messages
    local records, scores = {}, {}
    for i, message in ipairs(messages) do
      local tag = tostring(first + i)
      records[#records + 1] = tag
      records[#records + 1] = KEYS[q] .. '\\n' .. message
      scores[#scores + 1] = ARGV[1]
      scores[#scores + 1] = tag
      local lost = 0
      if counting then
        local ok, decoded = pcall(cjson.decode, message)
        if ok and type(decoded) == 'table' and type(decoded['headers']) == 'table' then
          local id = decoded['headers']['id']
          if type(id) == 'string' then lost = tonumber(redis.call('HGET', KEYS[3], id) or '0') end
        end
      end
      taken[#taken + 1] = tag
      taken[#taken + 1] = KEYS[q]
      taken[#taken + 1] = message
      taken[#taken + 1] = lost
    end
    redis.call('HSET', KEYS[1], unpack(records))
    redis.call('ZADD', KEYS[2], unpack(scores))
    limit = limit - #messages
  end
end
return taken
"""

# Puts one held message back at the head of its queue (it is the oldest there) and forgets its lease; with
# ``lost``, counts that its worker vanished (under its task id, read from the message: the rare path).
_PUT_BACK = """
local function put_back(unacked, index, lost_counts, tag, lost)
  local record = redis.call('HGET', unacked, tag)
  redis.call('HDEL', unacked, tag)
  redis.call('ZREM', index, tag)
  if not record then return 0 end
  local cut = string.find(record, '\\n', 1, true)
  local message = string.sub(record, cut + 1)
  redis.call('RPUSH', string.sub(record, 1, cut - 1), message)
  if lost then
    local ok, decoded = pcall(cjson.decode, message)
    if ok and type(decoded) == 'table' and type(decoded['headers']) == 'table' then
      local id = decoded['headers']['id']
      if type(id) == 'string' then redis.call('HINCRBY', lost_counts, id, 1) end
    end
  end
  return 1
end
"""

# KEYS: unacked hash, unacked index, lost-counts hash. ARGV: the tags a worker hands back because it will not
# run them (at shutdown). Not counted as lost.
RESTORE = (
    _PUT_BACK
    + """
local restored = 0
for i = 1, #ARGV do
  restored = restored + put_back(KEYS[1], KEYS[2], KEYS[3], ARGV[i], false)
end
return restored
"""
)

# KEYS: unacked hash, unacked index, lost-counts hash. ARGV: the lease horizon (Unix seconds), the most
# messages to restore. Hands back every message whose lease was last renewed before the horizon (its worker is
# gone), counting it as lost; finding and restoring are one step, so a lease renewed meanwhile is never lost.
RESTORE_EXPIRED = (
    _PUT_BACK
    + """
local tags = redis.call('ZRANGE', KEYS[2], '-inf', ARGV[1], 'BYSCORE', 'LIMIT', 0, ARGV[2])
for _, tag in ipairs(tags) do
  put_back(KEYS[1], KEYS[2], KEYS[3], tag, true)
end
return #tags
"""
)

# The census of messages (worker/broker/census.py): which wanted jobs have no message left anywhere in Redis.
# KEYS: unacked hash, lost-suspects hash, pending-jobs sorted set, then the queues (named prefix.priority).
# ARGV: grace (s), the most pending jobs to look at, the key prefix with its dot, then the id and priority of
# each unfinished job recorded in SQL. Wanted: those jobs and the pending (Redis-only) jobs recorded over
# ``grace`` ago whose record still exists. It reads the held messages, then each queue from its oldest end, a
# chunk at a time, and leaves a queue as soon as every wanted job of that priority has been seen; of a
# message, the tail is read (its headers and properties: the job id in kwargsrepr, else the task id), the
# whole only when the tail names no job (not batchwork's producer). A wanted job seen nowhere becomes a
# suspect (stamped with Redis' clock); one still unseen ``grace`` after its stamp is returned as lost:
# {sql ids, pending ids}.
CENSUS = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
local grace = tonumber(ARGV[1])
local prefix = ARGV[3]
local queue_of, left = {}, {}
for q = 4, #KEYS do queue_of[KEYS[q]] = q; left[q] = 0 end
left[0] = 0  -- wanted jobs of no known queue: every queue is read for them
local wanted, remaining = {}, 0
local function want(id, where, priority)
  if wanted[id] then return end
  local q = queue_of[prefix .. (priority or '')] or 0
  wanted[id] = {where, q}
  left[q] = left[q] + 1
  remaining = remaining + 1
end
for i = 4, #ARGV - 1, 2 do want(ARGV[i], 'sql', ARGV[i + 1]) end
local pending = redis.call('ZRANGE', KEYS[3], '-inf', now - grace, 'BYSCORE', 'LIMIT', 0, ARGV[2])
for _, id in ipairs(pending) do
  local priority = redis.call('HGET', prefix .. 'job:' .. id, 'priority')
  if priority then want(id, 'pending', priority) else redis.call('ZREM', KEYS[3], id) end
end
local function job_of(message)
  local from = math.max(1, #message - 2048)
  local at = string.find(message, "'job_id': '", from, true)
  if not at and from > 1 then at = string.find(message, "'job_id': '", 1, true) end
  if at then
    local stop = string.find(message, "'", at + 11, true)
    if stop then return string.sub(message, at + 11, stop - 1) end
  end
  at = string.find(message, '"correlation_id":', from, true)
  if at then return string.match(message, '^ ?"([^"]+)"', at + 17) end
  return nil
end
local seen = {}
local function note(message)
  local id = job_of(message)
  if id and wanted[id] and not seen[id] then
    seen[id] = true
    local q = wanted[id][2]
    left[q] = left[q] - 1
    remaining = remaining - 1
  end
end
local cursor = '0'
repeat
  if remaining <= 0 then break end
  local page = redis.call('HSCAN', KEYS[1], cursor, 'COUNT', 1000)
  cursor = page[1]
  for i = 2, #page[2], 2 do note(page[2][i]) end
until cursor == '0'
for q = 4, #KEYS do
  local from = 0
  while left[q] > 0 or left[0] > 0 do
    local chunk = redis.call('LRANGE', KEYS[q], -(from + 1000), -(from + 1))
    for i = #chunk, 1, -1 do note(chunk[i]) end
    if #chunk < 1000 then break end
    from = from + 1000
  end
end
local lost_sql, lost_pending = {}, {}
for id, job in pairs(wanted) do
  if seen[id] then
    redis.call('HDEL', KEYS[2], id)
  else
    local since = redis.call('HGET', KEYS[2], id)
    if not since then
      redis.call('HSET', KEYS[2], id, tostring(now))
    elseif now - tonumber(since) >= grace then
      if job[1] == 'sql' then lost_sql[#lost_sql + 1] = id else lost_pending[#lost_pending + 1] = id end
    end
  end
end
for _, id in ipairs(redis.call('HKEYS', KEYS[2])) do
  if not wanted[id] then redis.call('HDEL', KEYS[2], id) end
end
return {lost_sql, lost_pending}
"""
