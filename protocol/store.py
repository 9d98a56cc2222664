"""Where batches and results live in Redis, written by workers and read by producers.

Per batch ``b`` (keys under the settings' ``key_prefix``):

- ``{p}:batch:{b}``          hash: total, completed, failed, rejected, sealed, created_at, ...
                             (canary: its report; paused, feed_options: a failed canary's)
- ``{p}:batch:{b}:done``     hash: job id -> "" once enqueued, its stream entry id once done;
                             a batch whose size was known when it was made (``shards``) splits it
                             into ``{p}:batch:{b}:done:{k}``, ``k`` from the id's hash
                             (``mark_shard``), each small enough for Redis's compact encoding
- ``{p}:batch:{b}:done:lines`` bitmap: bit n set once the job of the input's line n is done;
                             a job that carries its line (``Envelope.line``: a batch fed from a
                             file) is known by that place instead of by a mark under its id
- ``{p}:batch:{b}:done:open`` hash: job id -> line, for such jobs enqueued and not done yet
- ``{p}:batch:{b}:results``  stream: one entry per finished job, ``result`` = JobResult JSON
- ``{p}:batch:{b}:attempts`` hash: job id -> deliveries started, until its result is recorded
                             (a poison job is dead-lettered)
- ``{p}:dlq:entry:{task}``   string: one dead letter (task id ``batch:job``), envelope included;
                             expires with the results (``result_ttl_s``)
- ``{p}:dlq:index``          sorted set: task ids by the time they died (pruned as they expire)
- ``{p}:workers``            sorted set: worker name -> when its heartbeat expires (the registry)
- ``{p}:workers:queue``      hash: worker name -> the queue it consumes (to rescue a dead one's)
- ``{p}:worker:{name}``      string: the worker's last heartbeat (JSON), with a TTL

A stream lets any number of readers follow a batch as it completes, resume after a disconnect
from the last entry id they saw, and read the whole batch again later, without polling.
The job id is the idempotency key: claiming at submit (``claim``) counts an id once however often
it is submitted, and recording (``record``) writes a result once however often it is delivered.
Both are Lua scripts, so no interleaving of producers and workers can count twice. A job fed
from a file is known by its line instead: its line's bit, one bit a job, is all a finished job
leaves in Redis once its result is taken, so a fed batch's marks grow by an eighth of a byte a
line, not by its ids (tens of bytes each).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import redis

from schemas import BatchStatus, CanaryReport, JobError, JobResult, Settings, Timings
from schemas.jobs import BATCH_PATTERN
from schemas.templates import Template

from .wire import Frame

# Every script that reads or writes a job's done mark starts with this: KEYS[1] is the batch
# hash, KEYS[2] the done map's name, and ``mark(id)`` the key holding the id's mark. A map of
# ``shards`` parts is keys the script derives, not keys it is given: vqueue runs on a single
# Redis (kombu's transport does too), where a script may touch them.
_MARKS = """
local shards = tonumber(redis.call('HGET', KEYS[1], 'shards') or '1') or 1
local function mark(id)
  if shards <= 1 then return KEYS[2] end
  return KEYS[2] .. ':' .. (tonumber(string.sub(redis.sha1hex(id), 1, 8), 16) % shards)
end
local lines, open = KEYS[2] .. ':lines', KEYS[2] .. ':open'
local function line_done(line) return redis.call('GETBIT', lines, line) == 1 end
"""

# KEYS: batch hash. ARGV: parts of its done map. Only a new batch is split: an existing one
# keeps where its marks already are.
_SPLIT = """
if redis.call('EXISTS', KEYS[1]) == 0 then redis.call('HSET', KEYS[1], 'shards', ARGV[1]) end
return 1
"""

# KEYS: batch hash, done hash, results stream, attempts hash. ARGV: job id, result json, status
# field, ttl, now, prompt tokens, prompt tokens served from the prefix cache, completion tokens, the
# model that answered ("" for none), the job's input line ("" for none). A recorded job's delivery
# count goes (the result carries it): the done mark (or its line's bit) alone stops a redelivery, so
# a finished job leaves only that behind. pcall: a counter that cannot go (a key of the wrong type)
# must not fail the record after its writes.
_RECORD = (
    _MARKS
    + """
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
"""
)

# KEYS: batch hash, done hash, attempts hash. ARGV: job id, ttl, its input line ("" for none). A
# delivery starts: {1 if the job has a result already (its count goes: it left with that result),
# deliveries started so far, why the batch was withdrawn or ""}.
_START = (
    _MARKS
    + """
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
"""
)


# Claiming a job, by its id or its line (after _MARKS): its flag, 1 new (counted in total), 0
# enqueued before but not done (send again: the earlier send may be lost), -1 done (skip); the
# key it touched, whose expiry the script renews.
_CLAIM_ONE = """
local function claim(id, line)
  if line ~= '' then
    if line_done(line) then return -1, lines end
    if redis.call('HSETNX', open, id, line) == 1 then return 1, open end
    return 0, open
  end
  local marks = mark(id)
  if redis.call('HSETNX', marks, id, '') == 1 then return 1, marks end
  if redis.call('HGET', marks, id) == '' then return 0, marks end
  return -1, marks
end
"""

# KEYS: batch hash, done hash. ARGV: ttl, then per job its id and its input line ("" for none).
# One flag per job (_CLAIM_ONE).
_CLAIM = (
    _MARKS
    + _CLAIM_ONE
    + """
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
"""
)

# KEYS: batch hash, done hash, then the queue lists. ARGV: ttl, the feed's position after this chunk
# ("" for none), the time, "1" to push again ids claimed before and not done ("" not to), then per
# message: the index in KEYS of its list, its job count n, the message's JSON before its envelopes
# and after them, then per job its id, its input line ("" for none) and its envelope's piece
# (``protocol.wire.frames``). Claims each job as _CLAIM does and pushes one message of the new ones'
# pieces, in one step. An id claimed before and not done had its envelope pushed by the script that
# claimed it, so it is in a queue or with a worker already: pushing it again would only run it twice
# at once. It goes again when the caller knows that message is gone (a forced re-run withdrew its
# result; a lost job is resent). Redis (6 and 7 alike) refuses a script's write for memory only
# until its first write has run, and only reads come before the first claim: out of memory, the
# chunk is refused before anything is written, else it runs whole. So a chunk is never counted
# without its messages in the queue, nor its position moved.
_CLAIM_SEND = (
    _MARKS
    + _CLAIM_ONE
    + """
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
"""
)

# KEYS: batch hash. ARGV: why submission stopped, lines rejected. Seals the batch with that
# reason. On Redis 7 and later the ``allow-oom`` flag lets it write when Redis is out of memory,
# since that is when it is needed (a few bytes); Redis 6 reads no flags, and refuses it then.
_STOPPED_BODY = """
redis.call('HSET', KEYS[1], 'error', ARGV[1], 'sealed', 1)
if tonumber(ARGV[2]) > 0 then redis.call('HINCRBY', KEYS[1], 'rejected', ARGV[2]) end
return 1
"""
_STOPPED = "#!lua flags=allow-oom" + _STOPPED_BODY

# KEYS: batch hash, done hash, results stream, attempts hash. ARGV: job id, its input line ("" for
# none), and for a job known by its line, its result's stream entry ("" when that has left the
# stream). Undo a job's result so it can run again (dead-letter requeue, a forced re-run): 1 if
# there was one.
_FORGET = (
    _MARKS
    + """
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
"""
)


# KEYS: the tenant's bucket. ARGV: rate (tokens/s), burst, n, and the time (seconds; "" for
# Redis's own clock, which every producer shares). Takes n tokens if there are n, and returns
# 0; else takes nothing and returns the milliseconds until there will be.
_TAKE = """
local rate, burst, n = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local now = tonumber(ARGV[4])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1e6
end
local b = redis.call('HMGET', KEYS[1], 'tokens', 'at')
local tokens = tonumber(b[1]) or burst
local at = tonumber(b[2]) or now
tokens = math.min(burst, tokens + (now - at) * rate)
local wait = 0
if tokens >= n then tokens = tokens - n else wait = math.ceil((n - tokens) / rate * 1000) end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'at', tostring(now))
redis.call('PEXPIRE', KEYS[1], math.ceil(burst / rate * 1000) + 60000)
return wait
"""


# what a job withdrawn before it started is told, by the reason its batch was withdrawn
WITHDRAWN = {
    "cancelled": "not run: its batch was cancelled before the job started",
    "expired": "not run: its batch's completion window ended before the job started",
}


def refused_for_memory(exc: BaseException) -> bool:
    """Whether Redis refused a write for ``maxmemory``: ``OutOfMemoryError`` for a command, and
    for a script on Redis 7; Redis 6 reports a script's refusal as a ``ResponseError`` that
    quotes the ``OOM`` error inside it."""
    if isinstance(exc, redis.exceptions.OutOfMemoryError):
        return True
    return isinstance(exc, redis.exceptions.ResponseError) and "-OOM command not allowed" in str(
        exc
    )


POOL_CONNECTIONS = 64  # per process; threads beyond it queue for a connection
# Jobs per part of a batch's done map, on average: Redis keeps a hash of up to 128 entries
# (``hash-max-listpack-entries``) as one compact listpack, about a quarter of the memory a
# hash table takes per entry. At 64 on average, the fullest of thousands of parts stays
# under 128.
MARKS_PER_SHARD = 64


def _place(line: int | None) -> str | int:
    """A job's input line as the scripts take it: "" for a job known by its id alone."""
    return "" if line is None else line


def mark_shard(job_id: str, shards: int) -> int:
    """The part of a done map of ``shards`` parts holding ``job_id``'s mark; ``_MARKS``
    computes the same in Redis."""
    return int(hashlib.sha1(job_id.encode()).hexdigest()[:8], 16) % shards


TEMPLATE_CHECK_S = 5.0  # for a template's examples against its schema, at registration
_STORED = {"stored": True}  # validation context: checked when it was added
_CHECK_EXAMPLES = """
import json, resource, sys
limit = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
from schemas.templates import Template, examples_problem
print(json.dumps(examples_problem(Template.model_validate_json(sys.stdin.read(),
                                                               context={"stored": True}))))
"""


def _examples_problem_bounded(template: Template, timeout_s: float) -> str | None:
    from schemas import get_settings

    memory = get_settings().schema_check_memory_mb << 20
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _CHECK_EXAMPLES, str(memory)],
            input=template.model_dump_json(),
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        return (
            f"checking the examples against json_schema took over {timeout_s:g}s (a pattern "
            "that backtracks, like ^(a+)+$?); simplify the schema's patterns"
        )
    if proc.returncode != 0:
        if "MemoryError" in proc.stderr:
            return f"checking the examples against json_schema needed more than {memory >> 20} MiB"
        raise RuntimeError(f"the template check failed: {proc.stderr.strip()[-500:]}")
    problem: str | None = json.loads(proc.stdout)
    return problem


def _retrying_client(url: str, retry_s: float) -> redis.Redis:
    """A client that rides out a Redis restart (AOF reload included) for about ``retry_s``."""
    from redis.backoff import ExponentialBackoff
    from redis.exceptions import BusyLoadingError, ConnectionError, TimeoutError
    from redis.retry import Retry

    cap = 2.0
    retries = max(1, int(retry_s / cap) + 4)
    # A blocking pool: when every connection is busy a thread waits for one. redis-py 8 caps a
    # plain pool at 100 connections and raises past it, which failed results in a worker
    # running 512 jobs at once.
    pool = redis.BlockingConnectionPool.from_url(
        url,
        max_connections=POOL_CONNECTIONS,
        timeout=max(retry_s, 5.0),
        decode_responses=True,
        health_check_interval=30,
        socket_keepalive=True,
        retry=Retry(ExponentialBackoff(cap=cap, base=0.05), retries),
        retry_on_error=[BusyLoadingError, ConnectionError, TimeoutError],
    )
    return redis.Redis(connection_pool=pool)


class BatchStore:
    """Typed access to batch counters and results; one instance per process is plenty."""

    def __init__(self, client: redis.Redis, prefix: str = "vqueue", ttl_s: int = 7 * 24 * 3600):
        self.r = client
        self.prefix = prefix
        self.ttl_s = ttl_s
        self._record = client.register_script(_RECORD)
        self._claim = client.register_script(_CLAIM)
        self._claim_send = client.register_script(_CLAIM_SEND)
        self._stopped = client.register_script(_STOPPED)
        self._stopped_unflagged = client.register_script(_STOPPED_BODY)
        self._flags: bool | None = None  # whether this Redis reads script flags (7 and later)
        self._forget = client.register_script(_FORGET)
        self._start = client.register_script(_START)
        self._split = client.register_script(_SPLIT)
        self._take = client.register_script(_TAKE)

    @classmethod
    def from_url(
        cls, url: str, prefix: str = "vqueue", ttl_s: int = 7 * 24 * 3600, retry_s: float = 120
    ) -> BatchStore:
        return cls(_retrying_client(url, retry_s), prefix, ttl_s)

    @classmethod
    def from_settings(cls, s: Settings) -> BatchStore:
        return cls.from_url(s.backend_url(), s.key_prefix, s.result_ttl_s, s.redis_retry_s)

    # -- extraction templates users register (schemas/templates.py has the built-in ones). A
    # template belongs to one tenant (its examples may be that tenant's data), or, registered
    # as shared (``tenant=None``), to every tenant; a tenant's own name hides a shared one.
    def templates_key(self, tenant: str | None) -> str:
        return f"{self.prefix}:" + (f"tenant:{tenant}:templates" if tenant else "templates")

    def add_template(
        self, template: Template, tenant: str | None, check_s: float = TEMPLATE_CHECK_S
    ) -> None:
        """Register ``template`` for ``tenant``'s jobs (every tenant's: None). Its worked
        examples are checked against its schema here, once, in a child process given
        ``check_s`` seconds (a ``pattern`` can keep Python's regex engine busy for minutes);
        workers read it back without checking again. Raises ``ValueError`` when the examples do
        not fit, or the check runs out of time."""
        problem = _examples_problem_bounded(template, check_s)
        if problem:
            raise ValueError(problem)
        self.r.hset(self.templates_key(tenant), template.name, template.model_dump_json())

    def template(self, name: str, tenant: str | None) -> Template | None:
        """The template ``tenant``'s jobs get by ``name``: its own, else a shared one; as it
        was checked when added (``pydantic.ValidationError`` if it no longer reads as one)."""
        for key in dict.fromkeys([self.templates_key(tenant), self.templates_key(None)]):
            raw = self.r.hget(key, name)
            if raw:
                return Template.model_validate_json(raw, context=_STORED)
        return None

    def templates(self, tenant: str | None) -> list[tuple[Template, str]]:
        """The templates ``tenant`` can name, with where each is from (``shared`` or
        ``tenant``), every one that still reads as one."""
        found: dict[str, tuple[str, str]] = {}
        for key, origin in (
            (self.templates_key(None), "shared"),
            (self.templates_key(tenant), "tenant"),
        ):
            if origin == "tenant" and not tenant:
                continue
            for name, raw in self.r.hgetall(key).items():
                found[name] = (raw, origin)
        out = []
        for _, (raw, origin) in sorted(found.items()):
            try:
                out.append((Template.model_validate_json(raw, context=_STORED), origin))
            except ValueError:  # pydantic's ValidationError: `vqueue templates add` replaces it
                continue
        return out

    def remove_template(self, name: str, tenant: str | None) -> bool:
        return bool(self.r.hdel(self.templates_key(tenant), name))

    def key(self, batch: str, part: str = "") -> str:
        return f"{self.prefix}:batch:{batch}" + (f":{part}" if part else "")

    # -- producer side
    def create(
        self,
        batch: str,
        fmt: str,
        source: str | None = None,
        queue: str = "",
        expected: int | None = None,
    ) -> bool:
        """Open a batch; an existing one keeps its counters (more jobs may be added to it).
        ``queue``: where its jobs go, so a reader can tell whether any worker consumes it.
        ``expected``: about how many jobs it will hold, when known; its done map is then split
        into parts of ``MARKS_PER_SHARD`` marks, which Redis stores compactly (a batch keeps the
        split it was made with)."""
        check_batch_id(batch)
        now = time.time()
        fields: dict[str, Any] = {"total": 0, "completed": 0, "failed": 0, "rejected": 0}
        fields.update(sealed=0, created_at=now, format=fmt, source=source or "", queue=queue)
        key = self.key(batch)
        pipe = self.r.pipeline()  # one transaction: no claim sees the batch before its split
        shards = max(1, math.ceil((expected or 0) / MARKS_PER_SHARD))
        self._split(keys=[key], args=[shards], client=pipe)
        for name, value in fields.items():
            pipe.hsetnx(key, name, value)
        pipe.hset(key, "sealed", 0)
        pipe.hdel(key, "error")  # submitted again: whatever stopped it before is past
        pipe.expire(key, self.ttl_s)
        return bool(pipe.execute()[1])

    def claim(self, batch: str, jobs: list[tuple[str, int | None]]) -> list[int]:
        """Count ``jobs`` (id, input line or None) into the batch's total, each id (or line)
        once ever; one flag per job: 1 new, 0 enqueued before and not done yet (send again),
        -1 already done (skip)."""
        keys = [self.key(batch), self.key(batch, "done")]
        args: list[Any] = [self.ttl_s]
        for ident, line in jobs:
            args += [ident, _place(line)]
        return [int(f) for f in self._claim(keys=keys, args=args)]

    def claim_send(
        self,
        batch: str,
        messages: list[Frame],
        fed: int | None = None,
        again: bool = False,
    ) -> list[int]:
        """``claim`` and push in one step, where the queues live in this Redis: each of
        ``messages`` is (queue list, head, tail, [(job id, input line, piece)])
        (``protocol.wire.frames``); a job goes in its message if it is new (flag 1), or
        claimed before and not done (flag 0) and ``again`` says that earlier message is gone.
        One flag per job, in order.
        ``fed``: how many of the input's jobs are sent once this chunk is, recorded with it
        (``fed_position``). All or nothing: a refusal for memory (``refused_for_memory``)
        means none was claimed or sent, and the position did not move."""
        lists = list(dict.fromkeys(key for key, _, _, _ in messages))
        at = {key: i + 3 for i, key in enumerate(lists)}  # Lua counts KEYS from 1
        position = "" if fed is None else fed
        args: list[Any] = [self.ttl_s, position, time.time(), "1" if again else ""]
        for key, head, tail, pieces in messages:
            args += [at[key], len(pieces), head, tail]
            for ident, line, piece in pieces:
                args += [ident, _place(line), piece]
        keys = [self.key(batch), self.key(batch, "done"), *lists]
        return [int(f) for f in self._claim_send(keys=keys, args=args)]

    def fed_position(self, batch: str) -> int:
        """How many of the batch's input jobs a feed sent (``claim_send``'s ``fed``): a feed
        that resumes after its process died starts there, so no job is sent twice."""
        return int(self.r.hget(self.key(batch), "fed") or 0)

    def feed_state(self, batch: str) -> tuple[int | None, float | None, str, str]:
        """(jobs sent, when the feed last showed it was alive, the input it reads, the process
        feeding it as host:pid) of a feed that has not finished; (None, None, source, by)
        when none is unfinished."""
        fed, at, source, by = self.r.hmget(self.key(batch), "fed", "fed_at", "source", "fed_by")
        return (
            None if fed is None else int(fed),
            None if at is None else float(at),
            source or "",
            by or "",
        )

    def feed_start(self, batch: str, by: str) -> None:
        """A feed of the batch's input starts in process ``by`` (host:pid)."""
        self.r.hset(self.key(batch), mapping={"fed_by": by, "fed_at": time.time()})

    def feed_alive(self, batch: str) -> None:
        """A feed waiting on its window says it is alive (``fed_at``), as each chunk does."""
        self.r.hset(self.key(batch), "fed_at", time.time())

    def unfinished(self, batch: str) -> int:
        """The batch's jobs enqueued and not finished: queued, reserved or running, which is
        what of it Redis holds as messages, the quantity a feed's window bounds."""
        total, completed, failed = self.r.hmget(self.key(batch), "total", "completed", "failed")
        return int(total or 0) - int(completed or 0) - int(failed or 0)

    def stop_submission(self, batch: str, reason: str, rejected: int = 0) -> None:
        """Seal a batch whose submission stopped early, saying why (``BatchStatus.error``):
        what was enqueued still runs and the batch ends when it has. Works when Redis 7 or
        later is out of memory, the usual reason; Redis 6 refuses it then
        (``refused_for_memory``)."""
        if self._flags is None:
            version = str(self.r.info("server").get("redis_version", "7"))
            self._flags = int(version.split(".")[0]) >= 7
        script = self._stopped if self._flags else self._stopped_unflagged
        script(keys=[self.key(batch)], args=[reason[:2000], rejected])

    def canary_ended(
        self, batch: str, report: CanaryReport, feed: dict[str, Any] | None = None
    ) -> None:
        """Keep the canary's report; one that failed pauses the batch, keeping how its feed
        was made (``feed``: the submit options a resume sends the rest of the input with)."""
        mapping: dict[str, Any] = {"canary": report.model_dump_json()}
        if not report.passed:
            mapping.update(paused=1, feed_options=json.dumps(feed or {}))
        self.r.hset(self.key(batch), mapping=mapping)

    def canary_judged(self, batch: str) -> bool:
        return bool(self.r.hexists(self.key(batch), "canary"))

    def is_paused(self, batch: str) -> bool:
        return self.r.hget(self.key(batch), "paused") == "1"

    def unpause(self, batch: str) -> dict[str, Any] | None:
        """End the batch's pause; the submit options its feed was made with, or None when it
        was not paused."""
        pipe = self.r.pipeline()
        pipe.hget(self.key(batch), "paused")
        pipe.hget(self.key(batch), "feed_options")
        pipe.hdel(self.key(batch), "paused", "feed_options")
        paused, options, _ = pipe.execute()
        return json.loads(options or "{}") if paused == "1" else None

    def shards(self, batch: str) -> int:
        """How many parts the batch's done map has (1: the one hash ``{b}:done``)."""
        return int(self.r.hget(self.key(batch), "shards") or 1)

    def mark_keys(self, batch: str, shards: int | None = None) -> list[str]:
        """The keys of the batch's done map, in part order."""
        n = self.shards(batch) if shards is None else shards
        base = self.key(batch, "done")
        return [base] if n <= 1 else [f"{base}:{k}" for k in range(n)]

    def mark_key(self, batch: str, job_id: str, shards: int | None = None) -> str:
        """The key holding ``job_id``'s done mark."""
        n = self.shards(batch) if shards is None else shards
        base = self.key(batch, "done")
        return base if n <= 1 else f"{base}:{mark_shard(job_id, n)}"

    def marks(self, batch: str, jobs: list[tuple[str, int | None]]) -> list[str | None]:
        """Each job's (id, input line or None) done mark: None never sent, "" sent and not
        done, else its result's stream entry (a job known by its line: "done"); one round trip
        after the batch's split is read."""
        n = self.shards(batch)
        pipe = self.r.pipeline(transaction=False)
        for ident, line in jobs:
            if line is None:
                pipe.hget(self.mark_key(batch, ident, n), ident)
            else:
                pipe.getbit(self.key(batch, "done:lines"), line)
                pipe.hexists(self.key(batch, "done:open"), ident)
        answers = iter(pipe.execute())
        out: list[str | None] = []
        for _, line in jobs:
            if line is None:
                out.append(next(answers))
            else:
                done, sent = next(answers), next(answers)
                out.append("done" if done else "" if sent else None)
        return out

    def delete(self, batch: str) -> None:
        keys = [self.key(batch, p) for p in ("results", "attempts", "done:lines", "done:open")]
        keys += self.mark_keys(batch)
        keys.append(self.key(batch))  # last: the split is read from it
        for i in range(0, len(keys), 1000):
            self.r.delete(*keys[i : i + 1000])

    def seal(self, batch: str, rejected: int = 0, fed_all: bool = False) -> None:
        """Mark submission finished: from now on ``total`` is final, and waiting can end.
        ``rejected`` counts the input lines refused at submit. ``fed_all``: the whole input
        was sent, so no feed is left to resume (a feed interrupted keeps its position: the
        same input submitted again with the batch id goes on from there)."""
        pipe = self.r.pipeline()
        if rejected:
            pipe.hincrby(self.key(batch), "rejected", rejected)
        pipe.hset(self.key(batch), "sealed", 1)
        if fed_all:
            pipe.hdel(self.key(batch), "fed", "fed_at", "fed_by")
        pipe.execute()

    def take_tokens(
        self, tenant: str, n: int, rate: float, burst: int, now: float | None = None
    ) -> float:
        """Take ``n`` submissions from ``tenant``'s token bucket (shared by all its producers):
        0 if taken, else the seconds to wait before asking again. ``now``: a clock of the
        caller's (tests); by default Redis's own, the same for every producer."""
        key = f"{self.prefix}:tenant:{tenant}:bucket"
        args = [rate, burst, n, "" if now is None else repr(now)]
        return int(self._take(keys=[key], args=args)) / 1000

    # -- worker side
    def record(self, result: JobResult, pipe: Any = None) -> bool:
        """Store one result; False if this job already had one (duplicate delivery). Given a
        pipeline, the call joins it and its answer comes with the pipeline's."""
        keys, args = self._record_call(result)
        return bool(self._record(keys=keys, args=args, client=pipe or self.r))

    def _record_call(self, result: JobResult) -> tuple[list[str], list[Any]]:
        keys = [
            self.key(result.batch),
            self.key(result.batch, "done"),
            self.key(result.batch, "results"),
            self.key(result.batch, "attempts"),
        ]
        field = "completed" if result.status == "completed" else "failed"
        args = [result.id, result.model_dump_json(), field, self.ttl_s, time.time()]
        args += [result.usage.prompt_tokens, result.usage.cached_tokens]
        args += [result.usage.completion_tokens, result.model or "", _place(result.line)]
        return keys, args

    def record_many(self, results: list[JobResult]) -> list[bool | redis.RedisError]:
        """``record`` for several results (a pack's) in one round trip, an answer each in
        order. A result Redis refused has the error in its place, the others stand, so a
        retry sends only the refused ones."""
        answers = self._scripts([(self._record, *self._record_call(r)) for r in results])
        return [a if isinstance(a, redis.RedisError) else bool(a) for a in answers]

    def _scripts(self, calls: list[tuple[Any, list[str], list[Any]]]) -> list[Any]:
        """Each (script, keys, args) in one round trip, its answer or its error in order.
        By ``EVALSHA`` alone: a redis-py pipeline that holds scripts first asks Redis whether
        it has them (``SCRIPT EXISTS``), a second round trip every time. A script Redis does
        not have (it restarted) answers NOSCRIPT and ran nothing, so those calls alone go
        again once it is loaded."""
        answers: list[Any] = [None] * len(calls)
        todo = list(range(len(calls)))
        for _ in range(2):
            pipe = self.r.pipeline(transaction=False)
            for i in todo:
                script, keys, args = calls[i]
                pipe.evalsha(script.sha, len(keys), *keys, *args)
            for i, answer in zip(todo, pipe.execute(raise_on_error=False), strict=True):
                answers[i] = answer
            todo = [i for i in todo if isinstance(answers[i], redis.exceptions.NoScriptError)]
            if not todo:
                break
            for script in {id(calls[i][0]): calls[i][0] for i in todo}.values():
                self.r.script_load(script.script)
        return answers

    # -- reading
    def status(self, batch: str) -> BatchStatus | None:
        h = self.r.hgetall(self.key(batch))
        if not h:
            return None
        return BatchStatus(
            batch=batch,
            total=int(h.get("total", 0)),
            completed=int(h.get("completed", 0)),
            failed=int(h.get("failed", 0)),
            rejected=int(h.get("rejected", 0)),
            created_at=float(h.get("created_at", 0)),
            updated_at=float(h["updated_at"]) if h.get("updated_at") else None,
            prompt_tokens=int(h.get("prompt_tokens", 0)),
            cached_tokens=int(h.get("cached_tokens", 0)),
            completion_tokens=int(h.get("completion_tokens", 0)),
            model=h.get("model") or None,
            error=h.get("error") or None,
            sealed=h.get("sealed") == "1",
            fed=int(h["fed"]) if h.get("fed") else None,
            fed_at=float(h["fed_at"]) if h.get("fed_at") else None,
            fed_by=h.get("fed_by") or None,
            canary=CanaryReport.model_validate_json(h["canary"]) if h.get("canary") else None,
            paused=h.get("paused") == "1",
        )

    def is_sealed(self, batch: str) -> bool:
        return self.r.hget(self.key(batch), "sealed") == "1"

    def queue_of(self, batch: str) -> str | None:
        """The queue the batch's jobs were sent to (None for batches made before it was kept)."""
        return self.r.hget(self.key(batch), "queue") or None

    def read(
        self, batch: str, after: str = "0-0", block_ms: int | None = None, count: int = 1000
    ) -> list[tuple[str, JobResult]]:
        """Results recorded after stream entry ``after``; waits up to ``block_ms`` for the first."""
        stream = self.key(batch, "results")
        if block_ms is None:
            entries = self.r.xrange(stream, min=f"({after}" if after != "0-0" else "-", count=count)
        else:
            resp = self.r.xread({stream: after}, count=count, block=block_ms)
            entries = resp[0][1] if resp else []
        return [(eid, JobResult.model_validate_json(f["result"])) for eid, f in entries]

    def take(self, batch: str, upto: str, written: dict[str, Any] | None = None) -> int:
        """The results up to stream entry ``upto`` leave Redis: their reader has them safe
        (``vqueue results --take``, the HTTP API's output files). The batch's counts and each
        job's done mark stay, so no job runs again; how many entries went. ``written``: where
        the reader put them and how far its files reach (``taken``), recorded in the same
        transaction, so a reader started again knows what of its files to keep."""
        ms, seq = upto.split("-")
        pipe = self.r.pipeline()
        if written:
            pipe.hset(self.key(batch), "taken", json.dumps(written))
        pipe.xtrim(self.key(batch, "results"), minid=f"{ms}-{int(seq) + 1}", approximate=False)
        return int(pipe.execute()[-1])

    def taken(self, batch: str) -> dict[str, Any]:
        """What ``take`` last recorded of its reader's files (empty: nothing)."""
        raw = self.r.hget(self.key(batch), "taken")
        return dict(json.loads(raw)) if raw else {}

    def iter_all(self, batch: str) -> Iterator[JobResult]:
        after = "0-0"
        while True:
            page = self.read(batch, after)
            if not page:
                return
            after = page[-1][0]
            for _, res in page:
                yield res

    def start(
        self, batch: str, job_id: str, line: int | None = None
    ) -> tuple[bool, int, str | None]:
        """At each delivery, one round trip: (already has a result, deliveries started so far,
        why the batch's unstarted jobs were withdrawn, if they were: ``withdraw``). A copy of
        a finished job is not counted: its count left with its result. ``line``: the job's
        input line, for a job known by it (``Envelope.line``)."""
        keys = [self.key(batch), self.key(batch, "done"), self.key(batch, "attempts")]
        done, n, withdrawn = self._start(keys=keys, args=[job_id, self.ttl_s, _place(line)])
        return bool(done), int(n), withdrawn or None

    def start_many(
        self, jobs: list[tuple[str, str, int | None]]
    ) -> list[tuple[bool, int, str | None] | redis.RedisError]:
        """``start`` for several deliveries, (batch, job id, input line) each, in one round trip
        (a pack's jobs), an answer each in order. A start Redis refused has the error in its
        place and counted no delivery, so a retry sends only the refused ones."""
        calls = [
            (
                self._start,
                [self.key(b), self.key(b, "done"), self.key(b, "attempts")],
                [j, self.ttl_s, _place(line)],
            )
            for b, j, line in jobs
        ]
        return [
            a if isinstance(a, redis.RedisError) else (bool(a[0]), int(a[1]), a[2] or None)
            for a in self._scripts(calls)
        ]

    def withdraw(self, batch: str, reason: str) -> bool:
        """Withdraw the batch's jobs that have not started: a worker that takes one records it
        failed (``cancelled`` or ``expired``: ``reason``) instead of running it, so the batch
        still completes, with every result it had. False if there is no such batch."""
        if not self.r.exists(self.key(batch)):
            return False
        if self.r.hsetnx(self.key(batch), "withdrawn", reason):
            self.r.hset(self.key(batch), "withdrawn_at", time.time())
        return True

    def withdrawn(self, batch: str) -> str | None:
        return self.r.hget(self.key(batch), "withdrawn") or None

    def withdrawn_at(self, batch: str) -> float | None:
        at = self.r.hget(self.key(batch), "withdrawn_at")
        return float(at) if at else None

    def close_unstarted(self, batch: str) -> int:
        """Record a failed result, the reason it was withdrawn (``cancelled`` or ``expired``),
        for each of the withdrawn batch's jobs that has none, so the batch ends without a worker
        to take them. A worker that takes one of their messages later finds its result and
        skips it; one running it now has its answer refused as a second result. How many were
        closed."""
        reason = self.withdrawn(batch)
        if reason not in ("cancelled", "expired"):
            return 0
        fmt = "openai" if self.r.hget(self.key(batch), "format") == "openai" else "vqueue"
        error = JobError(type=reason, message=WITHDRAWN[reason])  # type: ignore[arg-type]
        closed = 0
        # their results in one round trip a page: those known by their id, unmarked; then
        # those known by their line, still open
        unmarked: Iterator[dict[str, int | None]] = (
            {i: None for i, e in p.items() if not e} for p in self._mark_pages(batch)
        )
        pages = itertools.chain(unmarked, self._open_pages(batch))
        for page in pages:
            pipe = self.r.pipeline(transaction=False)
            for ident, line in page.items():
                timings = Timings(enqueued_at=0.0, finished_at=time.time())
                self.record(
                    JobResult(id=ident, batch=batch, type="unknown", status="failed",
                              line=line, timings=timings, error=error, format=fmt),
                    pipe,
                )  # fmt: skip
            closed += sum(map(int, pipe.execute()))
        return closed

    def _open_pages(self, batch: str, size: int = 1000) -> Iterator[dict[str, int | None]]:
        """The batch's jobs known by their line, sent and not done, as id -> line, a page a
        round trip (``HSCAN``: a page may repeat an id, which ``record`` counts once)."""
        cursor = 0
        while True:
            cursor, scanned = self.r.hscan(self.key(batch, "done:open"), cursor, count=size)
            yield {ident: int(line) for ident, line in scanned.items()}
            if not cursor:
                return

    def _mark_pages(self, batch: str, size: int = 1000) -> Iterator[dict[str, str]]:
        """The batch's done map, about ``size`` ids a page: the one hash by ``HSCAN``; parts of
        about ``MARKS_PER_SHARD`` ids whole, as many a round trip as make a page."""
        keys = self.mark_keys(batch)
        if len(keys) == 1:
            cursor = 0
            while True:
                cursor, scanned = self.r.hscan(keys[0], cursor, count=size)
                yield scanned
                if not cursor:
                    return
        step = max(1, size // MARKS_PER_SHARD)
        for i in range(0, len(keys), step):
            pipe = self.r.pipeline(transaction=False)
            for k in keys[i : i + step]:
                pipe.hgetall(k)
            page: dict[str, str] = {}
            for part in pipe.execute():
                page.update(part)
            yield page

    def withdrawn_many(self, batches: list[str]) -> list[str | None]:
        pipe = self.r.pipeline(transaction=False)
        for b in batches:
            pipe.hget(self.key(b), "withdrawn")
        return [x or None for x in pipe.execute()]

    def result(self, batch: str, job_id: str) -> JobResult | None:
        """The job's result while it is in Redis (``find``)."""
        return self.find(batch, job_id)[0]

    def find(
        self, batch: str, job_id: str, after: str = "-", page: int = 1000
    ) -> tuple[JobResult | None, str]:
        """The job's result while it is in Redis, and how far the batch's results were read
        for it: by its mark; a job known by its input line has none naming its result (a fed
        batch keeps no index by id), so the results after stream entry ``after`` are read for
        it, and a caller that asks again passes the second value to read only what came since
        (``Batch.result``)."""
        entry = self.marks(batch, [(job_id, None)])[0]
        stream = self.key(batch, "results")
        if entry:
            got = self.r.xrange(stream, min=entry, max=entry)
            return (JobResult.model_validate_json(got[0][1]["result"]) if got else None), after
        if not self.r.exists(self.key(batch, "done:lines")):
            return None, after
        for eid, fields in self._results_after(batch, after, page):
            if fields.get("id") == job_id:
                return JobResult.model_validate_json(fields["result"]), after
            after = eid
        return None, after

    def _entries(self, batch: str, job_ids: set[str]) -> dict[str, str]:
        """The stream entries of ``job_ids``' results, the stream read once, up to the last."""
        found: dict[str, str] = {}
        for eid, fields in self._results_after(batch):
            if fields.get("id") in job_ids:
                found[fields["id"]] = eid
                if len(found) == len(job_ids):
                    break
        return found

    def _results_after(
        self, batch: str, after: str = "-", page: int = 1000
    ) -> Iterator[tuple[str, dict[str, str]]]:
        """The batch's stream entries after entry ``after`` ("-": all), a page a round trip."""
        stream = self.key(batch, "results")
        while True:
            got = self.r.xrange(stream, min=after if after == "-" else f"({after}", count=page)
            yield from got
            if len(got) < page:
                return
            after = got[-1][0]

    # -- workers' liveness: a registry (rq's, dramatiq's), not a scan of the keyspace
    def worker_key(self, name: str) -> str:
        return f"{self.prefix}:worker:{name}"

    def heartbeat(self, name: str, info: dict[str, Any], ttl_s: float) -> None:
        """Advertise a live worker for ``ttl_s``: its info under its own key, its name in the
        registry scored by when that runs out."""
        pipe = self.r.pipeline(transaction=False)
        pipe.set(self.worker_key(name), json.dumps(info), px=int(ttl_s * 1000))
        pipe.zadd(f"{self.prefix}:workers", {name: time.time() + ttl_s})
        pipe.hset(f"{self.prefix}:workers:queue", name, str(info.get("queue", "")))
        pipe.execute()

    def workers(self, lanes: bool = False) -> list[dict[str, Any]]:
        """Live workers' heartbeats, by name: two reads, however large the keyspace.
        ``lanes``: with each worker's urgent process too (its heartbeat names the worker in
        ``urgent_of``), which is part of that worker, not one more."""
        names = self.r.zrangebyscore(f"{self.prefix}:workers", time.time(), "+inf")
        values = self.r.mget([self.worker_key(n) for n in sorted(names)]) if names else []
        beats = [json.loads(v) for v in values if v]
        return beats if lanes else [w for w in beats if not w.get("urgent_of")]

    def consumed(self, queue: str | None) -> bool:
        """Whether some live worker consumes ``queue``."""
        return any(w.get("queue") == queue for w in self.workers())

    def gone_workers(self, queue: str) -> list[tuple[str, float]]:
        """Workers of ``queue`` whose heartbeat ran out, and when: their own queues want
        rescuing (``protocol.routing.rescue_orphans``)."""
        gone = self.r.zrangebyscore(f"{self.prefix}:workers", 0, time.time(), withscores=True)
        if not gone:
            return []
        queues = self.r.hmget(f"{self.prefix}:workers:queue", [n for n, _ in gone])
        return [(n, float(at)) for (n, at), q in zip(gone, queues, strict=True) if q == queue]

    def forget_worker(self, name: str) -> None:
        """Take a worker out of the registry (stopped cleanly, or its queue rescued)."""
        pipe = self.r.pipeline(transaction=False)
        pipe.delete(self.worker_key(name))
        pipe.zrem(f"{self.prefix}:workers", name)
        pipe.hdel(f"{self.prefix}:workers:queue", name)
        pipe.execute()

    # -- dead letters: jobs that exhausted their deliveries, kept with their last error
    def dlq_key(self, part: str = "") -> str:
        return f"{self.prefix}:dlq" + (f":{part}" if part else "")

    def dead_letter(
        self, envelope: Any, result: JobResult, attempts: int, record: bool = True
    ) -> None:
        """Park the job and (``record``) its failed result, so the batch still finishes. The
        entry expires with the batch's results."""
        task_id = f"{result.batch}:{result.id}"
        entry = {
            "task_id": task_id,
            "batch": result.batch,
            "id": result.id,
            "type": result.type,
            "attempts": attempts,
            "error": result.error.model_dump() if result.error else None,
            "worker": result.worker,
            "dead_at": time.time(),
            "envelope": envelope,
        }
        pipe = self.r.pipeline()
        pipe.set(self.dlq_key(f"entry:{task_id}"), json.dumps(entry), ex=self.ttl_s)
        pipe.zadd(self.dlq_key("index"), {task_id: entry["dead_at"]})
        pipe.zremrangebyscore(self.dlq_key("index"), 0, time.time() - self.ttl_s)
        pipe.execute()
        if record:
            self.record(result)

    def dead_letters(self, batch: str | None = None, limit: int = 1000) -> list[dict[str, Any]]:
        self.r.zremrangebyscore(self.dlq_key("index"), 0, time.time() - self.ttl_s)
        ids = self.r.zrange(self.dlq_key("index"), 0, -1)
        if batch:
            ids = [i for i in ids if i.startswith(f"{batch}:")]
        ids = ids[:limit]
        raw = self.r.mget([self.dlq_key(f"entry:{i}") for i in ids]) if ids else []
        return [json.loads(v) for v in raw if v]

    def dead_letter_entry(self, task_id: str) -> dict[str, Any] | None:
        raw = self.r.get(self.dlq_key(f"entry:{task_id}"))
        return json.loads(raw) if raw else None

    def forget(self, batch: str, job_id: str, line: int | None = None) -> bool:
        """Remove a job's result and delivery count so it can run again (a dead letter sent
        again); ``line``: its input line, for a job known by it."""
        return self.forget_many(batch, [(job_id, line)])[0]

    def forget_many(self, batch: str, jobs: list[tuple[str, int | None]]) -> list[bool]:
        """``forget`` for each (id, input line or None) of ``jobs`` (a forced re-run's chunk):
        whether each had a result. The results of jobs known by their line are found by
        reading the batch's results once for them all."""
        keys = [self.key(batch), self.key(batch, "done"), self.key(batch, "results")]
        keys.append(self.key(batch, "attempts"))
        placed = [(i, line) for i, line in jobs if line is not None]
        entries: dict[str, str] = {}
        if placed:
            pipe = self.r.pipeline(transaction=False)
            for _, line in placed:
                pipe.getbit(self.key(batch, "done:lines"), line)
            done = {i for (i, _), bit in zip(placed, pipe.execute(), strict=True) if bit}
            entries = self._entries(batch, done) if done else {}
        calls = [(self._forget, keys, [i, _place(line), entries.get(i, "")]) for i, line in jobs]
        answers = self._scripts(calls)
        for a in answers:
            if isinstance(a, redis.RedisError):
                raise a
        return [bool(a) for a in answers]

    def drop_dead_letter(self, task_id: str) -> None:
        pipe = self.r.pipeline()
        pipe.delete(self.dlq_key(f"entry:{task_id}"))
        pipe.zrem(self.dlq_key("index"), task_id)
        pipe.execute()


def check_batch_id(batch: str) -> None:
    """Batch ids become Redis keys and half of each task id: a safe character set only."""
    if not re.fullmatch(BATCH_PATTERN, batch):
        raise ValueError(
            f"batch id {batch[:80]!r} is not allowed: 1-128 letters, digits, '_', '.' or '-', "
            "starting with a letter or digit"
        )
