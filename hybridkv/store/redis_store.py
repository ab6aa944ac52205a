"""redis://host:port[/db][?capacity=BYTES][&policy=lru|value][&ttl=SECONDS] and valkey://… — a shared
server; the distributed case.

Several processes and machines share one cache through it. Every call has a socket timeout, so
a slow or dead server costs a bounded wait and surfaces as StoreError, never as a hang.

With a capacity the entries' bytes are kept on the server by the rule of `hybridkv.store.policy`,
the simulator's: `lru` (the default) or `value` (Greedy-Dual-Size-Frequency over compute saved per
byte held). Beside each entry sits its ledger (`hybridkv#m:<key>`: size, kind, compute saved, uses,
its parent and depth, its priority), all entries' priorities in one sorted set (`#order`, ties
taken deepest first), the bytes held (`#used`), LRU's clock (`#clock`), the value rule's aged clock
(`#age`) and the rule itself (`#policy`). A write is admitted, its ancestors raised to its
priority and the lowest entries removed to make room, and a read counted, by one Lua script each,
which the server runs whole or not at all: writers on any number of processes and machines never
count an entry twice or evict on a stale view, and a client that dies mid-write leaves nothing half
done. Every writer of one database must give the same capacity and policy (the first write records
them; a writer that gives others is refused in one line). A `ttl` expires entries no one reads as a
backstop; an entry expired or deleted stays counted (the count errs high: an early eviction, never a
wrong hit) until the rule reaches it.
"""

from __future__ import annotations

from collections import Counter
from urllib.parse import urlparse

import redis
from redis.backoff import NoBackoff
from redis.connection import PythonRespSerializer
from redis.retry import Retry

from hybridkv.errors import HybridKVError, StoreError
from hybridkv.store.base import NO_WORTH, Worth

NAMESPACE = "hybridkv:"
# The capacity's bookkeeping, beside the entries (outside NAMESPACE + "*", which lists entries only)
LEDGER = "hybridkv#"
ORDER, USED, CLOCK, AGE, POLICY = (LEDGER + name for name in ("order", "used", "clock", "age", "policy"))
META = LEDGER + "m:"
DEFAULT_TIMEOUT_S = 1.0

# Shared by both scripts, after each sets its locals RULE, ORDER and META. A priority is written with 17 digits
# (Lua's own conversion keeps 14), so the server's arithmetic is the simulator's, bit for bit.
_COMMON = """
local function fmt(p) return string.format('%.17g', p) end
local function member(name, depth) return string.format('%06d', 999999 - depth) .. name end
local function own(now, age, uses, saved, size)
  if RULE == 'lru' then return now end
  return age + uses * saved / size
end
-- set the entry `name` to at least priority p, and its ancestors with it
local function raise(name, p)
  while name and name ~= '' do
    local m = redis.call('HMGET', META .. name, 'prio', 'depth', 'parent')
    if not m[1] or tonumber(m[1]) >= p then return end
    redis.call('HSET', META .. name, 'prio', fmt(p))
    redis.call('ZADD', ORDER, fmt(p), member(name, tonumber(m[2])))
    name = m[3]
  end
end
"""
# KEYS: the entry, ORDER, USED, CLOCK, AGE, POLICY. ARGV: the bytes, the capacity, the entry's name,
# NAMESPACE, the rule, its kind, compute saved, parent ('' for none), ttl seconds (0: none), META.
# Returns {admitted (1/0), then for each entry evicted its kind}.
_PUT = (
    """
local data, capacity, name, ns = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4]
local RULE, ORDER, META = ARGV[5], KEYS[2], ARGV[10]
local kind, saved, parent, ttl = ARGV[6], tonumber(ARGV[7]), ARGV[8], tonumber(ARGV[9])
"""
    + _COMMON
    + """
local policy = RULE .. ' capacity=' .. ARGV[2]
local recorded = redis.call('GET', KEYS[6])
if recorded and recorded ~= policy then
  return redis.error_reply('HYBRIDKV another writer keeps this database as ' .. recorded .. ', not ' .. policy)
end
redis.call('SET', KEYS[6], policy)
local function write()
  if ttl > 0 then redis.call('SET', KEYS[1], data, 'EX', ttl) else redis.call('SET', KEYS[1], data) end
end
local size = string.len(data)
local now = 0
if RULE == 'lru' then now = redis.call('INCR', KEYS[4]) end
local age = tonumber(redis.call('GET', KEYS[5]) or '0')
local used = tonumber(redis.call('GET', KEYS[3]) or '0')
local held = redis.call('HMGET', META .. name, 'size', 'saved', 'uses', 'depth')
if held[1] and tonumber(held[1]) == size then  -- written again (keys name their content): used once more
  local uses = tonumber(held[3]) + 1
  redis.call('HSET', META .. name, 'uses', uses)
  raise(name, own(now, age, uses, tonumber(held[2]), size))
  write()
  return {1}
elseif held[1] then  -- replaced by other bytes: a new entry
  redis.call('DEL', META .. name)
  redis.call('ZREM', ORDER, member(name, tonumber(held[4])))
  used = used - tonumber(held[1])
end
local depth = 0
if parent ~= '' then
  local up = redis.call('HGET', META .. parent, 'depth')
  if not up then return {0} end  -- its parent is not held: no lookup can reach it
  depth = tonumber(up) + 1
end
local p = own(now, age, 1, saved, size)
raise(parent, p)  -- the path it extends is worth at least as much
local victims, freed, from = {}, 0, 0
while used - freed + size > capacity do
  local batch = redis.call('ZRANGE', ORDER, from, from + 63, 'WITHSCORES')
  if #batch == 0 then break end
  for i = 1, #batch, 2 do
    if tonumber(batch[i + 1]) >= p or used - freed + size <= capacity then break end
    local victim = string.sub(batch[i], 7)
    victims[#victims + 1] = {victim, batch[i], tonumber(batch[i + 1])}
    freed = freed + tonumber(redis.call('HGET', META .. victim, 'size'))
  end
  if #batch < 128 or tonumber(batch[#batch]) >= p then break end
  from = from + 64
end
if used - freed + size > capacity then return {0} end  -- refused: nothing was evicted
local result = {1}
for _, victim in ipairs(victims) do
  result[#result + 1] = redis.call('HGET', META .. victim[1], 'kind')
  redis.call('DEL', ns .. victim[1], META .. victim[1])
  redis.call('ZREM', ORDER, victim[2])
end
if RULE == 'value' and #victims > 0 then
  redis.call('SET', KEYS[5], fmt(math.max(age, victims[#victims][3])))
end
write()
redis.call('HSET', META .. name, 'size', size, 'kind', kind, 'saved', fmt(saved), 'uses', 1, 'depth', depth,
  'parent', parent, 'prio', fmt(p))
redis.call('ZADD', ORDER, fmt(p), member(name, depth))
redis.call('SET', KEYS[3], used - freed + size)
return result
"""
)
# KEYS: the entries, then ORDER, CLOCK, AGE. ARGV: their names, then the rule and META. The entries,
# each one found counted as used (once per read, in order, as the simulator's `use_all`).
_GET = (
    """
local n = #KEYS - 3
local RULE, ORDER, META = ARGV[n + 1], KEYS[n + 1], ARGV[n + 2]
"""
    + _COMMON
    + """
local values = redis.call('MGET', unpack(KEYS, 1, n))
local now = 0
if RULE == 'lru' then now = redis.call('INCR', KEYS[n + 2]) end
local age = tonumber(redis.call('GET', KEYS[n + 3]) or '0')
for i = 1, n do
  if values[i] then
    local m = redis.call('HMGET', META .. ARGV[i], 'uses', 'saved', 'size')
    if m[1] then
      local uses = tonumber(m[1]) + 1
      redis.call('HSET', META .. ARGV[i], 'uses', uses)
      raise(ARGV[i], own(now, age, uses, tonumber(m[2]), tonumber(m[3])))
    end
  end
end
return values
"""
)


def _encode(value) -> bytes | memoryview:
    """What the packer sends for one argument: our keys are str, values bytes, counts int."""
    if isinstance(value, bytes | memoryview):
        return value
    return (value if isinstance(value, str) else repr(value)).encode()


# hiredis parses replies (4x faster GETs of MB-sized entries), but its command packer copies
# every value into one buffer (3x slower SETs); redis-py's own packer sends values over 6,000
# bytes as separate buffers. Take the best of both through the connection's `command_packer`.
_PACKER = PythonRespSerializer(6000, _encode)


class RedisStore:
    def __init__(
        self, url: str, timeout_s: float = DEFAULT_TIMEOUT_S, capacity_bytes: int | None = None, rule: str = "lru",
        ttl_s: int = 0,
    ) -> None:  # fmt: skip
        parsed = urlparse(url)
        self.url = url
        self.capacity_bytes = capacity_bytes
        self.rule = rule
        self.ttl_s = ttl_s
        try:
            db, port = int(parsed.path.strip("/") or 0), parsed.port or 6379
        except ValueError as err:
            raise HybridKVError(f"store {url!r}: expected {parsed.scheme}://HOST:PORT[/DB] ({err})") from None
        pool = redis.ConnectionPool(
            command_packer=_PACKER,
            host=parsed.hostname or "127.0.0.1",
            port=port,
            db=db,
            password=parsed.password,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            # redis-py retries ~10 times with backoff by default; one bounded attempt is the contract.
            retry=Retry(NoBackoff(), 0),
        )
        self._client = redis.Redis(connection_pool=pool)
        self._put_script = self._client.register_script(_PUT)
        self._get_script = self._client.register_script(_GET)
        self.evicted: Counter[str] = Counter()  # entries this client's writes removed to make room, by kind

    def _call(self, operation, *args):
        try:
            return operation(*args)
        except redis.RedisError as err:
            if "HYBRIDKV " in str(err):  # refused by the script: one line, the reason
                raise StoreError(f"{self.url}: {str(err).partition('HYBRIDKV ')[2]}", unavailable=False) from err
            unavailable = isinstance(err, redis.ConnectionError | redis.TimeoutError)
            raise StoreError(f"{self.url}: {type(err).__name__}: {err}", unavailable) from err

    @property
    def evictions(self) -> int:
        return sum(self.evicted.values())

    def get(self, key: str) -> bytes | None:
        return self.get_many([key])[0]

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        if not keys:
            return []
        names = [NAMESPACE + key for key in keys]
        if self.capacity_bytes is None:
            return self._call(self._client.mget, names)
        return self._call(lambda: self._get_script([*names, ORDER, CLOCK, AGE], [*keys, self.rule, META]))

    def put(self, key: str, data: bytes, worth: Worth = NO_WORTH) -> bool:
        if self.capacity_bytes is None:
            self._call(self._client.set, NAMESPACE + key, data, self.ttl_s or None)
            return True
        if len(data) > self.capacity_bytes:
            raise StoreError(
                f"entry of {len(data)} bytes exceeds the store's capacity ({self.capacity_bytes})", unavailable=False
            )
        keys = [NAMESPACE + key, ORDER, USED, CLOCK, AGE, POLICY]
        args = [data, self.capacity_bytes, key, NAMESPACE, self.rule, worth.kind, repr(float(worth.saved)),
                worth.parent or "", self.ttl_s, META]  # fmt: skip
        admitted, *evicted = self._call(lambda: self._put_script(keys, args))
        self.evicted.update(kind.decode() for kind in evicted)
        return bool(admitted)

    def contains(self, key: str) -> bool:
        return bool(self._call(self._client.exists, NAMESPACE + key))

    def delete(self, key: str) -> None:
        # Under a capacity the ledger keeps counting it until the rule reaches it: the count errs
        # high (an early eviction), never low.
        self._call(self._client.delete, NAMESPACE + key)

    def _keys(self, match: str = NAMESPACE + "*") -> list[bytes]:
        return self._call(lambda: list(self._client.scan_iter(match=match, count=1000)))

    def stats(self) -> dict:
        keys = self._keys()
        sizes = [self._call(self._client.strlen, key) for key in keys]
        memory = self._call(self._client.info, "memory")
        stats = {"entries": len(keys), "bytes": sum(sizes), "server_used_memory": memory.get("used_memory")}
        if self.capacity_bytes is not None:
            used = self._call(self._client.get, USED)
            stats |= {
                "capacity_bytes": self.capacity_bytes,
                "policy": self.rule,
                "counted_bytes": int(used or 0),
                "evictions": self.evictions,
                "evicted": dict(self.evicted),
            }
        return stats

    def held_bytes(self) -> int | None:
        """The bytes the capacity counts as held (None: no capacity), in one read."""
        if self.capacity_bytes is None:
            return None
        return int(self._call(self._client.get, USED) or 0)

    def clear(self) -> int:
        keys = self._keys()
        for start in range(0, len(keys), 1000):
            self._call(self._client.delete, *keys[start : start + 1000])
        ledger = self._keys(LEDGER + "*")
        for start in range(0, len(ledger), 1000):
            self._call(self._client.delete, *ledger[start : start + 1000])
        return len(keys)

    def close(self) -> None:
        self._client.close()
