"""The Redis ledger's Lua scripts. Each runs atomically on the server, so a check and the write
it justifies can never be split by another gateway's operation.

Keys of one worker (``P`` the ledger prefix, ``W`` the worker's address):
  ``P:worker:W``  hash  capacity, max_sessions, admitted (bytes counted), shared (of those,
                        the named blocks'), seen (ms)
  ``P:leases:W``  hash  lease id -> bytes it holds alone
  ``P:expiry:W``  zset  lease id scored by its expiry (ms)
  ``P:blocks:W``  hash  shared block key -> leases naming it; key ``|b`` -> its bytes
  ``P:named:W``   hash  lease id -> the shared blocks it names, ``key:bytes,key:bytes``
Every script gets them as ``KEYS`` in this order (``acquire``: five per candidate). ``admitted``
is the leases' own bytes plus, once, the bytes of every block some lease names
(``ledger``'s docstring). Time is the server's (``TIME``), so gateways with skewed clocks agree
on expiry. Every write refreshes the keys' own expiry (``keep_ms``), so the ledger of a worker
no gateway talks to any more disappears by itself.
"""

from __future__ import annotations

_PRELUDE = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- {{key, bytes}, ...} of a ``key:bytes,...`` list
local function parse(spec)
  local out = {}
  for k, n in string.gmatch(spec or '', '([^,:]+):(%d+)') do
    table.insert(out, {k, tonumber(n)})
  end
  return out
end

local function join(blocks, from, to)
  local parts = {}
  for i = from, to do table.insert(parts, blocks[i][1] .. ':' .. blocks[i][2]) end
  return table.concat(parts, ',')
end

-- The bytes of the blocks that no lease names yet.
local function unnamed(b, blocks)
  local n = 0
  for _, kb in ipairs(blocks) do
    if redis.call('HEXISTS', b, kb[1]) == 0 then n = n + kb[2] end
  end
  return n
end

-- A lease names the blocks; returns the bytes of those no lease named before.
local function name(w, b, blocks)
  local added = 0
  for _, kb in ipairs(blocks) do
    if redis.call('HINCRBY', b, kb[1], 1) == 1 then
      redis.call('HSET', b, kb[1] .. '|b', kb[2])
      added = added + kb[2]
    end
  end
  redis.call('HINCRBY', w, 'shared', added)
  return added
end

-- The blocks lose a lease naming them; returns the bytes of those no lease names any more.
local function let_go(w, b, blocks)
  local freed = 0
  for _, kb in ipairs(blocks) do
    if redis.call('HINCRBY', b, kb[1], -1) <= 0 then
      freed = freed + tonumber(redis.call('HGET', b, kb[1] .. '|b') or 0)
      redis.call('HDEL', b, kb[1], kb[1] .. '|b')
    end
  end
  if freed > 0 and redis.call('EXISTS', w) == 1 then redis.call('HINCRBY', w, 'shared', -freed) end
  return freed
end

-- The bytes lease ``id`` frees, its records gone (0 when it is not held).
local function drop(w, l, e, b, s, id)
  local own = redis.call('HGET', l, id)
  if not own then return 0 end
  local freed = tonumber(own) + let_go(w, b, parse(redis.call('HGET', s, id)))
  redis.call('HDEL', l, id)
  redis.call('HDEL', s, id)
  redis.call('ZREM', e, id)
  return freed
end

-- Leases whose expiry has passed give their bytes back.
local function reclaim(w, l, e, b, s, now)
  local expired = redis.call('ZRANGEBYSCORE', e, '-inf', now)
  if #expired == 0 then return end
  local freed = 0
  for _, id in ipairs(expired) do freed = freed + drop(w, l, e, b, s, id) end
  redis.call('HINCRBY', w, 'admitted', -freed)
end

local function keep(w, l, e, b, s, ms)
  for _, k in ipairs({w, l, e, b, s}) do redis.call('PEXPIRE', k, ms) end
end

-- {capacity, max_sessions, admitted, sessions, shared}
local function usage(w, l)
  local v = redis.call('HMGET', w, 'capacity', 'max_sessions', 'admitted', 'shared')
  return {
    tonumber(v[1] or 0), tonumber(v[2] or 0), tonumber(v[3] or 0), redis.call('HLEN', l),
    tonumber(v[4] or 0),
  }
end
"""

# KEYS: w l e b s. ARGV: capacity, max_sessions, keep_ms. Returns usage.
REGISTER = (
    _PRELUDE
    + """
local now = now_ms()
redis.call('HSET', KEYS[1], 'capacity', ARGV[1], 'max_sessions', ARGV[2], 'seen', now)
redis.call('HSETNX', KEYS[1], 'admitted', 0)
reclaim(KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], now)
keep(KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], tonumber(ARGV[3]))
return usage(KEYS[1], KEYS[2])
"""
)

# KEYS: w l e b s per candidate, in preference order. ARGV: lease id, ttl_ms, keep_ms, then the
# bytes each candidate holds alone, then each candidate's group ('' alone), then the shared
# blocks each names (``key:bytes,...``; '' none). Consecutive candidates of one group are one
# choice: the one with room and the least admitted share of its capacity (ties: the first).
# Returns {i, usage...} for the candidate admitted (1-based), or {0}.
ACQUIRE = (
    _PRELUDE
    + """
local now = now_ms()
local id, ttl, keep_ms = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local n = #KEYS / 5
local function group(i) return ARGV[3 + n + i] end
local function key(i, j) return KEYS[5 * i - 5 + j] end
local i = 1
while i <= n do
  local j = i
  if group(i) ~= '' then
    while j < n and group(j + 1) == group(i) do j = j + 1 end
  end
  local pick, pick_share, pick_u, pick_need = nil, nil, nil, nil
  for k = i, j do
    local w, l = key(k, 1), key(k, 2)
    if redis.call('HEXISTS', w, 'capacity') == 1 then
      reclaim(w, l, key(k, 3), key(k, 4), key(k, 5), now)
      local u = usage(w, l)
      local need = tonumber(ARGV[3 + k]) + unnamed(key(k, 4), parse(ARGV[3 + 2 * n + k]))
      if u[3] + need <= u[1] and (u[2] <= 0 or u[4] < u[2]) then
        local share = 0
        if u[1] > 0 then share = u[3] / u[1] end
        if pick == nil or share < pick_share then
          pick, pick_share, pick_u, pick_need = k, share, u, need
        end
      end
    end
  end
  if pick ~= nil then
    local w, l, e, b, s = key(pick, 1), key(pick, 2), key(pick, 3), key(pick, 4), key(pick, 5)
    local spec = ARGV[3 + 2 * n + pick]
    redis.call('HSET', l, id, ARGV[3 + pick])
    local added = 0
    if spec ~= '' then
      added = name(w, b, parse(spec))
      redis.call('HSET', s, id, spec)
    end
    redis.call('ZADD', e, now + ttl, id)
    redis.call('HINCRBY', w, 'admitted', pick_need)
    keep(w, l, e, b, s, keep_ms)
    local u = pick_u
    return {pick, u[1], u[2], u[3] + pick_need, u[4] + 1, u[5] + added}
  end
  i = j + 1
end
return {0}
"""
)

# KEYS: w l e b s. ARGV: ttl_ms, keep_ms, lease ids. Returns the ids no longer held.
RENEW = (
    _PRELUDE
    + """
local now = now_ms()
local lost = {}
for i = 3, #ARGV do
  if redis.call('HEXISTS', KEYS[2], ARGV[i]) == 1 then
    redis.call('ZADD', KEYS[3], now + tonumber(ARGV[1]), ARGV[i])
  else
    table.insert(lost, ARGV[i])
  end
end
keep(KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], tonumber(ARGV[2]))
return lost
"""
)

# KEYS: w l e b s. ARGV: lease id. Returns 1 if it was held, else 0.
RELEASE = (
    _PRELUDE
    + """
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 0 then return 0 end
local freed = drop(KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], ARGV[1])
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('HINCRBY', KEYS[1], 'admitted', -freed)
end
return 1
"""
)

# KEYS: w l e b s. ARGV: lease id, blocks kept. The lease's blocks past the first ``kept`` are
# its own bytes from now on. Returns 1 if it was held, else 0.
SETTLE = (
    _PRELUDE
    + """
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 0 then return 0 end
local blocks = parse(redis.call('HGET', KEYS[5], ARGV[1]))
local kept = math.max(0, tonumber(ARGV[2]))
if kept >= #blocks then return 1 end
local moved, own = {}, 0
for i = kept + 1, #blocks do
  table.insert(moved, blocks[i])
  own = own + blocks[i][2]
end
redis.call('HINCRBY', KEYS[2], ARGV[1], own)
local freed = let_go(KEYS[1], KEYS[4], moved)
if kept > 0 then
  redis.call('HSET', KEYS[5], ARGV[1], join(blocks, 1, kept))
else
  redis.call('HDEL', KEYS[5], ARGV[1])
end
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('HINCRBY', KEYS[1], 'admitted', own - freed)
end
return 1
"""
)

# KEYS: w l e b s. ARGV: dead_after_ms. Returns the leases released, or -1 when some gateway
# saw the worker healthy within dead_after_ms.
RELEASE_DEAD = (
    _PRELUDE
    + """
local seen = redis.call('HGET', KEYS[1], 'seen')
if not seen then return 0 end
if now_ms() - tonumber(seen) <= tonumber(ARGV[1]) then return -1 end
local n = redis.call('HLEN', KEYS[2])
redis.call('DEL', KEYS[2], KEYS[3], KEYS[4], KEYS[5])
redis.call('HSET', KEYS[1], 'admitted', 0, 'shared', 0)
return n
"""
)

# KEYS: w l per worker. Returns, per worker, {registered (0/1), usage...}.
USAGE = (
    _PRELUDE
    + """
local out = {}
for i = 1, #KEYS / 2 do
  local w, l = KEYS[2 * i - 1], KEYS[2 * i]
  local u = usage(w, l)
  table.insert(out, {redis.call('HEXISTS', w, 'capacity'), u[1], u[2], u[3], u[4], u[5]})
end
return out
"""
)
