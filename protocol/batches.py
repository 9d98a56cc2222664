"""A batch's jobs: claimed at submit, started and recorded by workers, withdrawn.

Per batch ``b`` (keys under the settings' ``key_prefix``):

- ``{p}:batch:{b}``          hash: total, completed, failed, rejected, sealed, created_at, ...
                             (the feed's fields: ``protocol.feeds``)
- ``{p}:batch:{b}:done``     hash: job id -> "" once enqueued, its stream entry id once done;
                             a batch whose size was known when it was made (``shards``) splits it
                             into ``{p}:batch:{b}:done:{k}``, ``k`` from the id's hash
                             (``mark_shard``), each small enough for Redis's compact encoding
- ``{p}:batch:{b}:done:lines`` bitmap: bit n set once the job of the input's line n is done;
                             a job that carries its line (``Envelope.line``: a batch fed from a
                             file) is known by that place instead of by a mark under its id
- ``{p}:batch:{b}:done:open`` hash: job id -> line, for such jobs enqueued and not done yet
- ``{p}:batch:{b}:results``  stream: one entry per finished job, ``result`` = JobResult JSON
                             (read by ``protocol.results``)
- ``{p}:batch:{b}:attempts`` hash: job id -> deliveries started, until its result is recorded
                             (a poison job is dead-lettered)

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
import math
import re
import time
from collections.abc import Iterator
from typing import Any

import redis

from schemas import JobError, JobResult, Timings
from schemas.jobs import BATCH_PATTERN

from .scripts import StoreBase
from .wire import Frame

# what a job withdrawn before it started is told, by the reason its batch was withdrawn
WITHDRAWN = {
    "cancelled": "not run: its batch was cancelled before the job started",
    "expired": "not run: its batch's completion window ended before the job started",
}

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


def check_batch_id(batch: str) -> None:
    """Batch ids become Redis keys and half of each task id: a safe character set only."""
    if not re.fullmatch(BATCH_PATTERN, batch):
        raise ValueError(
            f"batch id {batch[:80]!r} is not allowed: 1-128 letters, digits, '_', '.' or '-', "
            "starting with a letter or digit"
        )


class Batches(StoreBase):
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
        self.lua["split"](keys=[key], args=[shards], client=pipe)
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
        return [int(f) for f in self.lua["claim"](keys=keys, args=args)]

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
        return [int(f) for f in self.lua["claim_send"](keys=keys, args=args)]

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

    def record(self, result: JobResult, pipe: Any = None) -> bool:
        """Store one result; False if this job already had one (duplicate delivery). Given a
        pipeline, the call joins it and its answer comes with the pipeline's."""
        keys, args = self._record_call(result)
        return bool(self.lua["record"](keys=keys, args=args, client=pipe or self.r))

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
        answers = self.run_scripts([(self.lua["record"], *self._record_call(r)) for r in results])
        return [a if isinstance(a, redis.RedisError) else bool(a) for a in answers]

    def start(
        self, batch: str, job_id: str, line: int | None = None
    ) -> tuple[bool, int, str | None]:
        """At each delivery, one round trip: (already has a result, deliveries started so far,
        why the batch's unstarted jobs were withdrawn, if they were: ``withdraw``). A copy of
        a finished job is not counted: its count left with its result. ``line``: the job's
        input line, for a job known by it (``Envelope.line``)."""
        keys = [self.key(batch), self.key(batch, "done"), self.key(batch, "attempts")]
        done, n, withdrawn = self.lua["start"](keys=keys, args=[job_id, self.ttl_s, _place(line)])
        return bool(done), int(n), withdrawn or None

    def start_many(
        self, jobs: list[tuple[str, str, int | None]]
    ) -> list[tuple[bool, int, str | None] | redis.RedisError]:
        """``start`` for several deliveries, (batch, job id, input line) each, in one round trip
        (a pack's jobs), an answer each in order. A start Redis refused has the error in its
        place and counted no delivery, so a retry sends only the refused ones."""
        calls = [
            (
                self.lua["start"],
                [self.key(b), self.key(b, "done"), self.key(b, "attempts")],
                [j, self.ttl_s, _place(line)],
            )
            for b, j, line in jobs
        ]
        return [
            a if isinstance(a, redis.RedisError) else (bool(a[0]), int(a[1]), a[2] or None)
            for a in self.run_scripts(calls)
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

    def withdrawn_many(self, batches: list[str]) -> list[str | None]:
        pipe = self.r.pipeline(transaction=False)
        for b in batches:
            pipe.hget(self.key(b), "withdrawn")
        return [x or None for x in pipe.execute()]

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
