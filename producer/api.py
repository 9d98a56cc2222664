"""``vqueue serve``: OpenAI's Files and Batches API in front of the queue, for services that do
not speak Python or Celery, and for the official ``openai`` SDK (``base_url`` pointing here).

A batch is a vqueue batch under the same id: the server checks the whole input file first
(an invalid line fails the batch with OpenAI-style ``errors``, nothing runs), then submits it
with the producer's ``Client`` as the caller's tenant, so that tenant's rate and queue-depth
limits apply here, on the server. A background loop (and every read) moves batches along:
counts from the batch store, the deadline of ``completion_window``, and at the end the output
and error files written from the stored results. Cancel and expiry withdraw the jobs not yet
started (the worker checks at each job's start); jobs already running finish and are kept.

Tenants are bearer API keys (``vqueue keys create TENANT``), stored as SHA-256 digests only.
A tenant sees only its own files and batches: anyone else's are 404, never 403. Metadata lives
in Redis under the key prefix, file contents under ``VQUEUE_FILES_DIR``.
"""

import asyncio
import collections
import contextlib
import hashlib
import json
import logging
import os
import secrets
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import redis
from pydantic import ValidationError
from redis.exceptions import LockError
from redis.lock import Lock

from protocol.store import BatchStore, refused_for_memory
from schemas import (
    BatchStatus,
    Envelope,
    ExtractJob,
    JobResult,
    Settings,
    get_settings,
    output_line,
)
from schemas.api import (
    ENDPOINT_FORMAT,
    FINAL_STATES,
    BatchCreate,
    BatchError,
    BatchErrors,
    BatchList,
    BatchObject,
    BatchUsage,
    ExpiresAfter,
    FileDeleted,
    FileList,
    FileObject,
    ModelList,
    ModelObject,
    RequestCounts,
    window_seconds,
)
from schemas.settings import cache_dir

from .client import Gone
from .inputs import parse_lines, read_lines

log = logging.getLogger(__name__)

# at most this many line errors are kept on a failed batch (OpenAI's object is a short list)
MAX_BATCH_ERRORS = 100
# how an input line of each form is named when it is in a batch for another endpoint
LINE_KIND = {
    "vqueue": "vqueue job",
    "openai": "/v1/chat/completions",
    "openai_completions": "/v1/completions",
    "openai_responses": "/v1/responses",
}
# a request body other than an upload: a batch's create call is a few hundred bytes
MAX_REQUEST_BYTES = 1 << 20

# a batch's lock (ApiStore.lock) lapses this long after the process holding it died
LOCK_S = 30


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _private(path: str, flags: int) -> int:
    """``open``'s opener for tenants' files: readable by the server's user alone."""
    return os.open(path, flags, 0o600)


def _expired(f: FileObject) -> bool:
    """Past its ``expires_at``: gone to its tenant even before ``ApiStore.expire`` deletes it."""
    return f.expires_at is not None and f.expires_at <= time.time()


def _expires_after(form: Any) -> int | str | None:
    """An upload's ``expires_after[anchor]``/``expires_after[seconds]`` form fields, as the
    ``openai`` SDK sends them: the seconds to keep the file, None to keep it until deleted, or
    what is wrong with them."""
    anchor, seconds = form.get("expires_after[anchor]"), form.get("expires_after[seconds]")
    if anchor is None and seconds is None:
        return None
    try:
        return ExpiresAfter.model_validate({"anchor": anchor, "seconds": seconds}).seconds
    except ValidationError:
        return ("expires_after needs anchor 'created_at' and seconds from 3600 to 2592000, "
                f"not {str(anchor)[:40]!r} and {str(seconds)[:40]!r}")  # fmt: skip


def uses_cache(b: BatchObject) -> bool:
    """A batch's jobs may be answered from the result cache unless its ``metadata`` says
    ``"cache": "false"`` (or off, no, 0)."""
    value = (b.metadata or {}).get("cache", "true").strip().lower()
    return value not in ("false", "off", "no", "0")


def canary_share(metadata: dict[str, str] | None) -> float | None:
    """The share of its input a batch runs first as a canary (``metadata`` ``"canary":
    "2%"``, producer/canary.py), or None; ``ValueError`` for a value that is not a share."""
    value = (metadata or {}).get("canary", "").strip()
    if not value:
        return None
    from .canary import parse_share

    return parse_share(value)


def _safe_name(filename: str) -> str:
    """An upload's name as it is echoed back (the file object, ``Content-Disposition``): its
    last path part, printable characters only, bounded."""
    name = os.path.basename(filename.replace("\\", "/"))
    name = "".join(c for c in name if c.isprintable() and c not in '"')[:200]
    return name or "upload.jsonl"


class ApiStore:
    """Files, batches and API keys: metadata in Redis, file contents on disk."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.batches = BatchStore.from_settings(settings)
        self.r = self.batches.r
        self.p = f"{settings.key_prefix}:api"
        self.dir = Path(settings.files_dir or cache_dir() / "files").expanduser()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.dir.chmod(0o700)  # tenants' inputs and results: the server's user alone

    # -- keys
    def create_key(self, tenant: str) -> str:
        key = "vq-" + secrets.token_urlsafe(32)
        self.r.hset(f"{self.p}:keys", _digest(key), tenant)
        return key

    def revoke(self, tenant: str) -> int:
        keys = self.r.hgetall(f"{self.p}:keys")
        gone = [d for d, t in keys.items() if t == tenant]
        if gone:
            self.r.hdel(f"{self.p}:keys", *gone)
        return len(gone)

    def tenant_of(self, key: str) -> str | None:
        t = self.r.hget(f"{self.p}:keys", _digest(key))
        return str(t) if t else None

    # -- files
    def add_file(
        self, tenant: str, src: Any, filename: str, purpose: str, limit: int,
        ttl_s: int | None = None,
    ) -> FileObject:  # fmt: skip
        """Copy an upload (a file object) in under a new id; ``TooLarge`` past ``limit``."""
        fid = "file-" + secrets.token_hex(16)
        path = self.dir / fid
        size = 0
        with open(path, "wb", opener=_private) as out:
            while chunk := src.read(1 << 20):
                size += len(chunk)
                if size > limit:
                    out.close()
                    path.unlink(missing_ok=True)
                    raise TooLarge
                out.write(chunk)
        return self.register(tenant, fid, _safe_name(filename), purpose, size, ttl_s)

    def register(
        self, tenant: str, fid: str, filename: str, purpose: str, size: int,
        ttl_s: int | None = None,
    ) -> FileObject:  # fmt: skip
        """Record a file kept on disk; one with ``ttl_s`` is deleted that long after it."""
        now = int(time.time())
        f = FileObject(
            id=fid, bytes=size, created_at=now, filename=filename, purpose=purpose,
            expires_at=now + ttl_s if ttl_s else None,
        )  # type: ignore[arg-type]  # fmt: skip
        pipe = self.r.pipeline()
        pipe.hset(f"{self.p}:file:{fid}", mapping={"tenant": tenant, "obj": f.model_dump_json()})
        pipe.zadd(f"{self.p}:tenant:{tenant}:files", {fid: time.time()})
        pipe.hincrby(f"{self.p}:tenant:{tenant}:usage", "bytes", size)
        if f.expires_at:
            pipe.zadd(f"{self.p}:files:expiring", {fid: f.expires_at})
        pipe.execute()
        return f

    def expire(self, now: float | None = None) -> int:
        """Delete the files past their ``expires_at``, record and bytes; how many went."""
        due = self.r.zrangebyscore(f"{self.p}:files:expiring", 0, now or time.time(), 0, 1000)
        gone = 0
        for fid in due:
            h = self.r.hgetall(f"{self.p}:file:{fid}")
            if h:
                gone += self._remove(h["tenant"], FileObject.model_validate_json(h["obj"]))
            else:
                self.r.zrem(f"{self.p}:files:expiring", fid)
        return gone

    def usage(self, tenant: str) -> tuple[int, int, int]:
        """What the tenant holds against its quotas: files, their bytes, batches not ended."""
        pipe = self.r.pipeline(transaction=False)
        pipe.zcard(f"{self.p}:tenant:{tenant}:files")
        pipe.hget(f"{self.p}:tenant:{tenant}:usage", "bytes")
        pipe.scard(f"{self.p}:tenant:{tenant}:active")
        files, size, batches = pipe.execute()
        return int(files), int(size or 0), int(batches)

    def open_jobs(self, tenant: str, but: str = "") -> int:
        """Jobs of the tenant's batches not ended (``but`` that one) that have no result yet."""
        ids = [i for i in self.r.smembers(f"{self.p}:tenant:{tenant}:active") if i != but]
        pipe = self.r.pipeline(transaction=False)
        for i in ids:
            pipe.hget(f"{self.p}:batch:{i}", "obj")
            pipe.hmget(self.batches.key(i), "completed", "failed")
        replies = pipe.execute()
        left = 0
        for raw, (completed, failed) in zip(replies[::2], replies[1::2], strict=True):
            if raw:
                total = BatchObject.model_validate_json(raw).request_counts.total
                left += max(total - int(completed or 0) - int(failed or 0), 0)
        return left

    def file(self, tenant: str, fid: str) -> FileObject | None:
        h = self.r.hgetall(f"{self.p}:file:{fid}")
        if not h or h.get("tenant") != tenant:
            return None
        f = FileObject.model_validate_json(h["obj"])
        return None if _expired(f) else f

    def path(self, fid: str) -> Path:
        return self.dir / fid

    def lines_over(self, fid: str, limit: int) -> bool:
        """Whether the file holds more than ``limit`` non-blank lines; reads no further."""
        n = 0
        try:
            with open(self.path(fid), "rb") as fh:
                for line in fh:
                    n += bool(line.strip())
                    if n > limit:
                        return True
        except FileNotFoundError:  # validation reports it as file_not_found
            return False
        return False

    def files(self, tenant: str) -> list[FileObject]:
        ids = self.r.zrevrange(f"{self.p}:tenant:{tenant}:files", 0, -1)
        pipe = self.r.pipeline(transaction=False)  # one round trip for the whole list
        for i in ids:
            pipe.hgetall(f"{self.p}:file:{i}")
        found = (
            FileObject.model_validate_json(h["obj"])
            for h in pipe.execute()
            if h and h.get("tenant") == tenant
        )
        return [f for f in found if not _expired(f)]

    def delete_file(self, tenant: str, fid: str) -> bool:
        f = self.file(tenant, fid)
        return f is not None and self._remove(tenant, f)

    def _remove(self, tenant: str, f: FileObject) -> bool:
        """False when another server process removed it first: its bytes are given back once."""
        pipe = self.r.pipeline()
        pipe.zrem(f"{self.p}:tenant:{tenant}:files", f.id)
        pipe.zrem(f"{self.p}:files:expiring", f.id)
        if not self.r.delete(f"{self.p}:file:{f.id}"):
            pipe.execute()
            return False
        pipe.hincrby(f"{self.p}:tenant:{tenant}:usage", "bytes", -f.bytes)
        pipe.execute()
        self.path(f.id).unlink(missing_ok=True)
        return True

    # -- batches
    def save(self, tenant: str, b: BatchObject, pipe: Any = None) -> None:
        own = pipe is None
        pipe = self.r.pipeline() if own else pipe
        pipe.hset(f"{self.p}:batch:{b.id}", mapping={"tenant": tenant, "obj": b.model_dump_json()})
        pipe.zadd(f"{self.p}:tenant:{tenant}:batches", {b.id: b.created_at}, nx=True)
        if b.status in FINAL_STATES:
            pipe.srem(f"{self.p}:active", b.id)
            pipe.srem(f"{self.p}:tenant:{tenant}:active", b.id)
        else:
            pipe.sadd(f"{self.p}:active", b.id)
            pipe.sadd(f"{self.p}:tenant:{tenant}:active", b.id)
        if own:
            pipe.execute()

    def update(self, bid: str, unless: tuple[str, ...] = (), **changes: Any) -> BatchObject | None:
        """Change fields of the stored batch atomically (WATCH): every server process and the
        request handlers update batches at once, and a status must never be lost to a
        concurrent write of the counts. A batch whose status is in ``unless`` is left as is."""
        key = f"{self.p}:batch:{bid}"
        with self.r.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(key)
                    h = pipe.hgetall(key)
                    if not h:
                        return None
                    b = BatchObject.model_validate_json(h["obj"])
                    if b.status in unless:
                        pipe.reset()
                        return self.live(b)
                    b = b.model_copy(update=changes)
                    if b.status in FINAL_STATES and "request_counts" not in changes:
                        b = self._counted(b)  # an ended batch keeps its last counts
                    pipe.multi()
                    self.save(h["tenant"], b, pipe)
                    pipe.execute()
                    return self.live(b)
                except redis.WatchError:
                    continue

    def batch(
        self, tenant: str | None, bid: str, live: bool = True
    ) -> tuple[str, BatchObject] | None:
        """(its tenant, the batch); None when absent or another tenant's. ``live=False`` leaves
        an open batch's counts as last stored, for a caller that reads them itself
        (``Batches.advance``): one read of the batch store's counters a call, not three."""
        h = self.r.hgetall(f"{self.p}:batch:{bid}")
        if not h or (tenant is not None and h.get("tenant") != tenant):
            return None
        b = BatchObject.model_validate_json(h["obj"])
        return h["tenant"], self.live(b) if live else b

    def live(self, b: BatchObject) -> BatchObject:
        """An open batch's counts, tokens and model, read from the batch store's own fields,
        which every worker increments as it records a result. The stored object takes them
        only when the batch ends: a batch in progress is never rewritten for its counts."""
        if b.status in FINAL_STATES or b.status == "validating":
            return b
        return self._counted(b)

    def _counted(self, b: BatchObject) -> BatchObject:
        st = self.batches.status(b.id)
        return b if st is None else b.model_copy(update=_progress(b, st))

    def batch_ids(self, tenant: str) -> list[str]:
        return list(self.r.zrevrange(f"{self.p}:tenant:{tenant}:batches", 0, -1))

    def active(self) -> list[str]:
        return list(self.r.smembers(f"{self.p}:active"))

    def feeding(self, bid: str) -> bool:
        """Whether some server process holds the batch's feed (``feed``)."""
        return bool(self.r.exists(f"{self.p}:feed:{bid}"))

    @contextlib.contextmanager
    def feed(self, bid: str, ttl_s: float = 30.0) -> Iterator[threading.Event | None]:
        """The right to check and submit the batch's input, held by one server process at a
        time: None when another holds it. A thread renews it while held, so it lapses only when
        its process dies (or stalls past ``ttl_s``), and another process's sweep
        (``Batches.advance``) resumes the feed. The event is set when the batch is gone from
        Redis (deleted, FLUSHALL) or the lease was lost: stop then. A redis-py ``Lock``: its
        token is checked by a script on every renewal and release, so a holder whose lease
        lapsed can neither renew nor release the next holder's."""
        lease = self._lease(f"{self.p}:feed:{bid}", ttl_s)
        if lease is None:
            yield None
            return
        gone, done = threading.Event(), threading.Event()

        def renew() -> None:
            while not done.wait(ttl_s / 3):
                try:
                    if not self.r.exists(f"{self.p}:batch:{bid}"):
                        gone.set()
                        return
                    lease.reacquire()
                except LockError:  # it lapsed, and may be another's now
                    gone.set()
                    return
                except redis.RedisError:  # away for a moment: the lease has ttl_s to spare
                    continue

        threading.Thread(target=renew, name=f"vqueue-feed-{bid[-8:]}", daemon=True).start()
        try:
            yield gone
        finally:
            done.set()
            _release(lease)

    @contextlib.contextmanager
    def lock(self, bid: str, ttl_s: int = LOCK_S) -> Iterator[Lock | None]:
        """One server process moves a batch at a time (several may serve one Redis): the lease,
        or None when another process holds it. Short, so that a process killed while it holds
        it stops the batch only that long: work under it that may last longer renews it
        (``Lock.reacquire``, which raises ``LockError`` once the lease is no longer this
        process's, and the work stops)."""
        lease = self._lease(f"{self.p}:lock:{bid}", ttl_s)
        try:
            yield lease
        finally:
            if lease is not None:
                _release(lease)

    def _lease(self, key: str, ttl_s: float) -> Lock | None:
        lease = self.r.lock(key, timeout=ttl_s, blocking=False, thread_local=False)
        return lease if lease.acquire() else None


def _release(lease: Lock) -> None:
    """Give a lease back; one that lapsed (and may be another's) is left alone."""
    with contextlib.suppress(LockError, redis.RedisError):
        lease.release()


CANCEL_GRACE_S = 30  # a cancelled batch's queued jobs left to the workers this long
DRAIN_BUDGET_S = 2.0  # a batch's results written out per turn of the mover, at most this long
LOST_CHECK_S = 30.0  # how often a batch that is not complete is asked whether jobs were lost


class TooLarge(ValueError):
    pass


class Feeder:
    """Runs ``Batches.submit`` on a few threads, fairly: each tenant's batches wait in a line of
    their own, the threads serve the lines in turn, and one tenant runs at most ``per_tenant``
    at once, so a tenant's many big batches never keep another's one-line batch validating."""

    def __init__(self, run: Any, threads: int = 8, per_tenant: int = 2) -> None:
        self._run, self.per_tenant = run, per_tenant
        self._cond = threading.Condition()
        self._lines: dict[str, collections.deque[str]] = {}
        self._running: collections.Counter[str] = collections.Counter()
        self._known: set[str] = set()  # waiting or running here
        for i in range(threads):
            threading.Thread(target=self._work, name=f"vqueue-feeder-{i}", daemon=True).start()

    def feed(self, tenant: str, bid: str) -> None:
        """Queue the batch, unless it is waiting or running in this process already."""
        with self._cond:
            if bid in self._known:
                return
            self._known.add(bid)
            self._lines.setdefault(tenant, collections.deque()).append(bid)
            self._cond.notify()

    def _next(self) -> tuple[str, str] | None:
        for tenant in list(self._lines):  # the first tenant served goes to the back after
            if self._running[tenant] < self.per_tenant:
                line = self._lines.pop(tenant)
                bid = line.popleft()
                if line:
                    self._lines[tenant] = line
                return tenant, bid
        return None

    def _work(self) -> None:
        while True:
            with self._cond:
                while (turn := self._next()) is None:
                    self._cond.wait()
                tenant, bid = turn
                self._running[tenant] += 1
            try:
                self._run(tenant, bid)
            except Exception:  # submit fails its batch itself; this is a bug of ours
                log.exception("batch %s: feeding failed", bid)
            finally:
                with self._cond:
                    self._running[tenant] -= 1
                    self._known.discard(bid)
                    self._cond.notify_all()


class Batches:
    """What moves a batch through its states; every method is safe to call again."""

    def __init__(self, store: ApiStore) -> None:
        self.store = store
        self.settings = store.settings
        self.feeder = Feeder(self.submit)
        self._lost_checked: dict[str, float] = {}  # batch -> when Client.lost was last asked

    def create(self, tenant: str, req: BatchCreate) -> BatchObject:
        now = int(time.time())
        b = BatchObject(
            id="batch_" + secrets.token_hex(16),
            endpoint=req.endpoint,
            input_file_id=req.input_file_id,
            completion_window=req.completion_window,
            status="validating",
            created_at=now,
            expires_at=now + window_seconds(req.completion_window),
            metadata=req.metadata,
            output_expires_after=req.output_expires_after,
        )
        self.store.save(tenant, b)
        return b

    @staticmethod
    def _lines(fh: Any) -> Iterator[Any]:
        fh.seek(0)
        yield from parse_lines(read_lines(fh))

    def submit(self, tenant: str, bid: str) -> None:
        """Check every line of the input file, then enqueue them all, or fail the batch; it
        runs off the request, so whatever goes wrong ends the batch ``failed``, saying why,
        never leaves it ``validating``. Its schemas are checked as this tenant's, so they never
        take every schema check from the others (``schemas.grammar_check``)."""
        from schemas import grammar_check

        as_tenant = grammar_check.tenant.set(tenant)
        try:
            with self.store.feed(bid, self.settings.api_feed_lease_s) as gone:
                if gone is not None:  # else another server process feeds it
                    self._submit(tenant, bid, gone)
        except Gone:
            log.warning("batch %s left Redis while it was fed; its feed stopped", bid)
        except Exception as exc:  # the file gone from disk, Redis away, a bug of ours
            if isinstance(exc, FileNotFoundError):
                error = BatchError(code="file_not_found", message="the input file was deleted")
            else:  # what went wrong is the operator's to read, in the server's log
                log.exception("batch %s: validation failed", bid)
                why = f"the server failed to check this batch's input; its log says why ({bid})"
                error = BatchError(code="server_error", message=why)
            self._update(
                tenant, bid, ("in_progress", "cancelling", *FINAL_STATES), status="failed",
                failed_at=int(time.time()), errors=BatchErrors(data=[error]),
            )  # fmt: skip
        finally:
            grammar_check.tenant.reset(as_tenant)

    def _submit(self, tenant: str, bid: str, gone: threading.Event) -> None:
        """Check the input, then send it; or, for a batch whose feed died with its process
        (``in_progress``, not sealed), send the rest from where that feed stopped."""
        found = self.store.batch(tenant, bid)
        if found is None:
            return
        b = found[1]
        if b.status != "validating" and not self._unfed(b):
            return
        # held open from here: a delete of the file cannot take it from under the batch
        with open(self.store.path(b.input_file_id), "rb") as fh:
            self._check_and_send(tenant, b, fh, gone)

    def _canary_waits(self, b: BatchObject) -> bool:
        """The batch's canary waits for its answers, which it reads from Redis: none leaves
        for the output file until they are judged."""
        return canary_share(b.metadata) is not None and not self.store.batches.canary_judged(b.id)

    def _unfed(self, b: BatchObject) -> bool:
        """In progress, but its input not all submitted (the batch store has not sealed it),
        and not paused by its canary."""
        if b.status != "in_progress" or self.store.batches.is_sealed(b.id):
            return False
        return not self.store.batches.is_paused(b.id)

    def _check_and_send(self, tenant: str, b: BatchObject, fh: Any, gone: threading.Event) -> None:
        from .client import Client

        bid, s = b.id, self.settings
        client = Client(s, stop=gone, tenant=tenant, on_limit="wait")
        want = ENDPOINT_FORMAT[b.endpoint]
        if b.status == "in_progress":  # a feed resumed: its input was checked and counted
            if self._canary(client, b, fh, gone):
                self._send(client, b, fh, gone, self.store.batches.fed_position(bid))
            return
        ceiling, budget = s.priority_ceiling(tenant), s.token_budget(tenant)
        errors: list[BatchError] = []
        bad = total = 0
        for p in self._lines(fh):
            message = p.error
            if message is None and p.job.priority > ceiling:
                message = f"priority {p.job.priority} is over this tenant's ceiling of {ceiling}"
            if message is None and (p.job.max_tokens or 0) > budget:
                message = f"max_tokens {p.job.max_tokens} is over this tenant's {budget}"
            if message is None and p.format != want:
                message = (f"a {LINE_KIND[p.format]} line in a batch for {b.endpoint}: its "
                           f"lines are {LINE_KIND[want]} lines")  # fmt: skip
            name = p.job.template if isinstance(p.job, ExtractJob) else None
            if message is None and name is not None and not client.template_known(name):
                message = f"unknown template {name!r}"
            if message is not None:
                bad += 1
                if len(errors) < MAX_BATCH_ERRORS:
                    errors.append(BatchError(code="invalid_request", message=message, line=p.line))
            total += 1
        now = int(time.time())
        if bad or not total:
            if not total:
                errors.append(BatchError(code="empty_file", message="the input file has no lines"))
            self._update(
                tenant, bid, status="failed", failed_at=now, errors=BatchErrors(data=errors),
                request_counts=RequestCounts(total=total),
            )  # fmt: skip
            return
        if self.store.open_jobs(tenant, but=bid) + total > s.api_max_open_jobs:
            why = f"its {total} jobs would pass the tenant's {s.api_max_open_jobs} not finished"
            quota = BatchErrors(data=[BatchError(code="quota_exceeded", message=why)])
            self._update(tenant, bid, status="failed", failed_at=now, errors=quota,
                         request_counts=RequestCounts(total=total))  # fmt: skip
            return

        # the batch exists in the store before it is in_progress, so a cancel from now on
        # reaches its jobs
        client.store.create(
            bid, "vqueue", b.input_file_id, queue=self.settings.queue, expected=total
        )
        started = self._update(
            tenant, bid, ("cancelling", *FINAL_STATES), status="in_progress", in_progress_at=now,
            request_counts=RequestCounts(total=total),
        )  # fmt: skip
        if started is None or started.status != "in_progress":  # cancelled while validating
            self._update(tenant, bid, status="cancelled", cancelled_at=int(time.time()),
                         request_counts=RequestCounts(total=total))  # fmt: skip
            return
        if self._canary(client, b, fh, gone, total):
            self._send(client, b, fh, gone, 0)

    def _canary(
        self, client: Any, b: BatchObject, fh: Any, gone: threading.Event, lines: int = 0
    ) -> bool:
        """Run the batch's canary, if its metadata asks for one and it has not run: whether
        the rest may be sent. One that fails pauses the batch (``BatchStore.canary_ended``)
        until ``vqueue resume`` or a cancel; a feed resumed after its process died runs the
        canary it did not finish, its jobs sent already skipped."""
        from .canary import pick, run

        share = canary_share(b.metadata)
        st = self.store.batches.status(b.id)
        if share is None or st is None:
            return True
        if st.canary is not None:  # judged before: a passed canary, or a resumed batch
            return not st.paused
        lines = lines or sum(1 for _ in self._lines(fh))
        picked = pick(self._lines(fh), share, self.settings.canary_min_jobs, lines, b.id)
        jobs = [self._envelope(client, b, p) for p in picked]

        def tick(_st: BatchStatus) -> None:
            if gone.is_set():
                raise Gone(b.id)

        _sent, report = run(client, b.id, jobs, tick)  # read before any leaves (_canary_waits)
        self.store.batches.canary_ended(b.id, report)
        if not report.passed:
            log.warning("batch %s paused: its canary failed: %s", b.id, "; ".join(report.reasons))
        return report.passed

    @staticmethod
    def _envelope(client: Any, b: BatchObject, p: Any) -> Envelope:
        """The line's envelope, known by its line: the batch's only input is its file."""
        return Envelope(
            job=p.job, batch=b.id, format=p.format, model=p.model, enqueued_at=time.time(),
            tenant=client.settings.tenant, cache=uses_cache(b), line=p.line,
        )  # fmt: skip

    def _send(self, client: Any, b: BatchObject, fh: Any, gone: threading.Event, skip: int) -> None:
        """Submit the input's jobs after the first ``skip``, recording the position as it goes
        (``Client.submit_many``'s ``position``), and seal the batch."""
        from .client import SubmissionStopped

        bid = b.id

        def envelopes() -> Iterator[Envelope]:
            for i, p in enumerate(self._lines(fh)):
                if gone.is_set():
                    raise Gone(bid)
                if i >= skip:
                    yield self._envelope(client, b, p)

        try:
            client.submit_many(envelopes(), batch=bid, source=b.input_file_id, position=skip)
        except SubmissionStopped as exc:  # Redis full or gone: what was sent still runs, and
            # the batch ends failed with the reason once it has (``advance``)
            log.error("batch %s: submission stopped: %s", bid, exc.reason)
        except Gone:
            raise
        except Exception:  # a limit refused, a bug of ours: likewise
            log.exception("batch %s: submission stopped", bid)
            why = f"the server stopped submitting this batch; its log says why ({bid})"
            client.store.stop_submission(bid, why)

    def _update(
        self, tenant: str, bid: str, unless: tuple[str, ...] = FINAL_STATES, **changes: Any
    ) -> BatchObject | None:
        return self.store.update(bid, unless, **changes)

    def cancel(self, tenant: str, bid: str) -> BatchObject | None:
        found = self.store.batch(tenant, bid)
        if found is None:
            return None
        b = found[1]
        if b.status in FINAL_STATES or b.status == "cancelling":
            return b
        # first the jobs (a batch still validating has none yet: submit sees the status)
        self.store.batches.withdraw(bid, "cancelled")
        if self.store.batches.unpause(bid) is not None:  # its canary failed: the rest never goes
            self.store.batches.seal(bid, fed_all=True)
        return self._update(
            tenant, bid, ("cancelling", *FINAL_STATES), status="cancelling",
            cancelling_at=int(time.time()),
        )  # fmt: skip

    def advance(self, bid: str) -> BatchObject | None:
        """Counts, deadline, and the end: output and error files, the final state."""
        found = self.store.batch(None, bid, live=False)
        if found is None:
            return None
        tenant, b = found
        if b.status in FINAL_STATES:
            return b
        if b.status in ("in_progress", "cancelling") and not self._canary_waits(b):
            # results leave Redis as they arrive
            with self.store.lock(bid) as mine:
                if mine:
                    with contextlib.suppress(LockError):  # lapsed: another process drains it
                        self._drain(b, mine, budget_s=DRAIN_BUDGET_S)
        if b.status == "validating" or self._unfed(b):
            return self.store.live(self._sweep(tenant, b))
        st = self.store.batches.status(bid)
        if st is None:  # the batch store expired it
            return self._update(tenant, bid, status="expired", expired_at=int(time.time()))
        now = int(time.time())
        changes = _progress(b, st)
        expiring = self.store.batches.withdrawn(bid) == "expired"
        if b.status == "in_progress" and b.expires_at and now >= b.expires_at and not expiring:
            self.store.batches.withdraw(bid, "expired")
        sealed = self.store.batches.is_sealed(bid)
        if sealed and st.done < st.total and self._close_withdrawn(bid):
            st = self.store.batches.status(bid) or st
            changes = _progress(b, st)
        if sealed and st.done < st.total:
            self._resend_lost(tenant, b)
        if not (sealed and st.done >= st.total):
            return b.model_copy(update=changes)  # counts are read live (ApiStore.live)
        with self.store.lock(bid) as mine:
            if not mine:
                return b.model_copy(update=changes)
            self._update(tenant, bid, status="finalizing", finalizing_at=now, **changes)
            try:
                out, err = self._write_outputs(tenant, b, mine)
            except LockError:  # the lease lapsed mid-write: its next holder ends the batch
                return b.model_copy(update=changes)
            # how it ended is what was withdrawn, if anything: the first of cancel and expiry;
            # else failed if submission stopped early (what did run is in the files)
            why = self.store.batches.withdrawn(bid)
            end = {"cancelled": "cancelled", "expired": "expired"}.get(why or "", "completed")
            if end == "completed" and st.error:
                end = "failed"
                stopped = BatchError(code="submission_failed", message=st.error)
                changes["errors"] = BatchErrors(data=[stopped])
            done = int(time.time())
            changes.update(output_file_id=out, error_file_id=err, status=end)
            changes[f"{end}_at"] = done
            return self._update(tenant, bid, **changes)

    def _resend_lost(self, tenant: str, b: BatchObject) -> None:
        """Jobs of the batch lost on the way (``Client.lost``: a worker killed as it took one)
        are sent again from the input file, so the batch ends; checked every
        ``LOST_CHECK_S`` per batch, under the batch's lock."""
        from .client import Client

        now = time.monotonic()
        if now - self._lost_checked.get(b.id, -LOST_CHECK_S) < LOST_CHECK_S:
            return
        self._lost_checked[b.id] = now
        client = Client(self.settings, tenant=tenant, on_limit="wait")
        if not client.lost(b.id):
            return
        try:
            with self.store.lock(b.id) as mine, open(self.store.path(b.input_file_id), "rb") as fh:
                if not mine:
                    return
                jobs = (self._envelope(client, b, p) for p in self._lines(fh) if p.error is None)
                sent = client.resend(jobs, b.id)
        except FileNotFoundError:  # its input deleted: the batch ends at its window's end
            log.error("batch %s has lost jobs and its input file is gone", b.id)
            return
        log.warning("batch %s: %d job(s) were lost on the way (a worker killed as it took "
                    "them); sent again from its input", b.id, sent)  # fmt: skip

    def _close_withdrawn(self, bid: str) -> bool:
        """Whether the withdrawn batch's jobs without a result were closed here: at once when
        no live worker consumes its queue (none would take them), else once the workers had
        their turn (a cancelled job running is aborted within a second; an expired one runs
        to its end, at most ``job_timeout_s``) and some are still queued behind other work."""
        batches = self.store.batches
        why, at = batches.withdrawn(bid), batches.withdrawn_at(bid)
        if why not in ("cancelled", "expired") or at is None:
            return False
        grace = CANCEL_GRACE_S if why == "cancelled" else self.settings.job_timeout_s + 30
        if time.time() < at + grace and batches.consumed(batches.queue_of(bid)):
            return False
        if closed := batches.close_unstarted(bid):
            log.info("batch %s %s: closed %d job(s) no worker took", bid, why, closed)
        return True

    def _sweep(self, tenant: str, b: BatchObject) -> BatchObject:
        """A batch being checked or submitted: if no server process feeds it (its feeder died
        with its process), feed it here; past its deadline unchecked, it expires."""
        if self.store.feeding(b.id):
            return b
        if b.status == "validating" and b.expires_at and time.time() >= b.expires_at:
            why = "the completion window ended before the batch's input was checked"
            expired = BatchErrors(data=[BatchError(code="expired", message=why)])
            now = int(time.time())
            return self._update(tenant, b.id, status="expired", expired_at=now, errors=expired) or b
        self.feeder.feed(tenant, b.id)
        return b

    def _drain(self, b: BatchObject, lease: Lock, budget_s: float | None = None) -> dict[str, str]:
        """Append the batch's results recorded since the last call to its output and error
        files (OpenAI's lines, or vqueue's for ``/v1/vqueue/jobs``), then let them leave Redis:
        Redis holds a batch's results only until they are on disk here. The files' lengths and
        the last result written are recorded together after each write, and a call cut short
        (its process killed) is undone by cutting the files back to the recorded lengths, so
        every result is written once. The caller holds the batch's lock (``ApiStore.lock``),
        ``lease``, renewed after each page: once it is no longer this process's, the drain
        stops (``LockError``) before it writes again, and the next holder's cut undoes a page
        half written.
        ``budget_s``: stop after this long even if more results wait (the mover serves every
        batch in turn); None: until none is left. Returns the state: file ids, counts, sizes."""
        key = f"{self.store.p}:out:{b.id}"
        state = self.store.r.hgetall(key)
        if not state:
            state = {"ok": "file-" + secrets.token_hex(16), "err": "file-" + secrets.token_hex(16)}
            state.update(after="0-0", ok_bytes="0", err_bytes="0", ok_n="0", err_n="0")
            self.store.r.hset(key, mapping=state)
            self.store.r.expire(key, self.settings.result_ttl_s)
        page = self.store.batches.read(b.id, state["after"], count=1000)
        if not page:
            return state
        vqueue_lines = b.endpoint == "/v1/vqueue/jobs"
        files = {}
        try:
            for k in ("ok", "err"):
                path = self.store.path(state[k])
                files[k] = open(path, "r+b" if path.exists() else "wb", opener=_private)
                files[k].truncate(int(state[f"{k}_bytes"]))  # a cut-short write undone
                files[k].seek(int(state[f"{k}_bytes"]))
            started = time.monotonic()
            while page:
                counts = {"ok": 0, "err": 0}
                for _entry, r in page:
                    line = vqueue_line(r) if vqueue_lines else output_line(r)
                    k = "ok" if r.status == "completed" else "err"
                    files[k].write(json.dumps(line).encode() + b"\n")
                    counts[k] += 1
                for fh in files.values():
                    fh.flush()
                    os.fsync(fh.fileno())
                state["after"] = page[-1][0]
                for k in ("ok", "err"):
                    state[f"{k}_bytes"] = str(files[k].tell())
                    state[f"{k}_n"] = str(int(state[f"{k}_n"]) + counts[k])
                self.store.r.hset(key, mapping=state)
                self.store.batches.take(b.id, state["after"])
                lease.reacquire()
                if budget_s is not None and time.monotonic() - started > budget_s:
                    break
                page = self.store.batches.read(b.id, state["after"], count=1000)
        finally:
            for fh in files.values():
                fh.close()
        return state

    def _write_outputs(
        self, tenant: str, b: BatchObject, lease: Lock
    ) -> tuple[str | None, str | None]:
        """The output and error files, whole (``_drain``), registered as the tenant's files;
        one that got no line is removed."""
        state = self._drain(b, lease)
        names = {"ok": f"{b.id}_output.jsonl", "err": f"{b.id}_error.jsonl"}
        got: dict[str, str | None] = {}
        after = b.output_expires_after
        ttl = after.seconds if after else self.settings.api_output_ttl_s
        for k in names:
            path = self.store.path(state[k])
            if int(state[f"{k}_n"]):
                self.store.register(tenant, state[k], names[k], "batch_output", path.stat().st_size,
                                    ttl)  # fmt: skip
                got[k] = state[k]
            else:
                path.unlink(missing_ok=True)
                got[k] = None
        self.store.r.delete(f"{self.store.p}:out:{b.id}")
        return got["ok"], got["err"]

    def outputs(self, bid: str) -> dict[str, Any]:
        """What of a batch's results is on disk so far: file ids, lines, bytes (tests, ops)."""
        state = self.store.r.hgetall(f"{self.store.p}:out:{bid}")
        return {k: (v if k in ("ok", "err", "after") else int(v)) for k, v in state.items()}


def _progress(b: BatchObject, st: BatchStatus) -> dict[str, Any]:
    """The batch object's counts, tokens and model, from the batch store's counters."""
    usage = BatchUsage(
        input_tokens=st.prompt_tokens,
        output_tokens=st.completion_tokens,
        total_tokens=st.prompt_tokens + st.completion_tokens,
    )
    counts = RequestCounts(total=b.request_counts.total, completed=st.completed, failed=st.failed)
    return {"request_counts": counts, "usage": usage, "model": st.model, "paused": st.paused,
            "canary": st.canary}  # fmt: skip


def vqueue_line(r: JobResult) -> dict[str, Any]:
    """A vqueue job's result as a batch output line: the ``JobResult`` as the response body,
    less what would tell one tenant about the fleet or others' work: which worker ran it, and
    how much of its prompt was already cached."""
    body = json.loads(r.model_dump_json(exclude={"worker": True, "usage": {"cached_tokens"}}))
    if r.status == "completed":
        return {
            "id": f"batch_req_{r.id}",
            "custom_id": r.id,
            "response": {"status_code": 200, "request_id": r.id, "body": body},
            "error": None,
        }
    err = r.error
    return {
        "id": f"batch_req_{r.id}",
        "custom_id": r.id,
        "response": None,
        "error": {"code": err.type if err else "error", "message": err.message if err else ""},
    }


# ------------------------------------------------------------------------------ the app


def create_app(settings: Settings | None = None) -> Any:
    from fastapi import Depends, FastAPI, Header, HTTPException, Request
    from fastapi.concurrency import run_in_threadpool
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import FileResponse, JSONResponse, Response
    from prometheus_client import CONTENT_TYPE_LATEST, Counter, generate_latest

    s = settings or get_settings()
    store = ApiStore(s)
    batches = Batches(store)
    requests_total = Counter(
        "vqueue_api_requests_total", "HTTP API requests", ["method", "route", "status"]
    )
    batch_states = Counter(
        "vqueue_api_batches_total", "Batches by the state they ended in", ["status"]
    )

    async def mover() -> None:
        """Moves every open batch along (counts, deadlines, the end) and deletes expired files."""
        while True:
            await asyncio.sleep(s.api_poll_s)
            try:
                await run_in_threadpool(store.expire)
                for bid in await run_in_threadpool(store.active):
                    before = await run_in_threadpool(store.batch, None, bid, False)
                    b = await run_in_threadpool(batches.advance, bid)
                    if b and before and b.status != before[1].status and b.status in FINAL_STATES:
                        batch_states.labels(b.status).inc()
            except Exception:  # Redis away for a moment: try again next round
                log.exception("moving batches along")

    @contextlib.asynccontextmanager
    async def lifespan(_app: Any) -> AsyncIterator[None]:
        task = asyncio.create_task(mover())
        yield
        task.cancel()

    app = FastAPI(title="vqueue", version="0.1.0", lifespan=lifespan)
    upload_limit = s.max_file_bytes + 65536  # the file, and the form around it
    app.add_middleware(
        BodyLimit, limit=lambda path: upload_limit if path == "/v1/files" else MAX_REQUEST_BYTES
    )

    @app.get("/metrics", include_in_schema=False)
    def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.middleware("http")
    async def count(request: Request, call_next: Any) -> Any:
        response = await call_next(request)
        route = request.scope.get("route")
        path = getattr(route, "path", "other")
        requests_total.labels(request.method, path, str(response.status_code)).inc()
        return response

    def fail(status: int, message: str, code: str | None = None) -> HTTPException:
        return HTTPException(status, {"message": message, "type": "invalid_request_error",
                                      "param": None, "code": code})  # fmt: skip

    @app.exception_handler(HTTPException)
    async def openai_errors(_request: Request, exc: HTTPException) -> JSONResponse:
        detail = exc.detail if isinstance(exc.detail, dict) else {"message": str(exc.detail)}
        detail.setdefault("type", "invalid_request_error")
        return JSONResponse({"error": detail}, status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def openai_validation(_request: Request, exc: RequestValidationError) -> JSONResponse:
        """A bad request body as OpenAI answers it: 400, the first problem, the field named."""
        first = exc.errors()[0] if exc.errors() else {}
        where = [str(x) for x in first.get("loc", ()) if x != "body"]
        message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
        param = ".".join(where) or None
        error = {"message": f"{param}: {message}" if param else message, "param": param,
                 "type": "invalid_request_error", "code": "invalid_request"}  # fmt: skip
        return JSONResponse({"error": error}, status_code=400)

    def tenant(authorization: str | None = Header(default=None)) -> str:
        if not authorization or not authorization.lower().startswith("bearer "):
            raise fail(401, "missing bearer API key (Authorization: Bearer ...)", "invalid_api_key")
        t = store.tenant_of(authorization[7:].strip())
        if t is None:
            raise fail(401, "invalid API key", "invalid_api_key")
        return t

    @app.get("/healthz")
    def healthz() -> dict[str, Any]:
        """Ready when Redis takes a write: a full Redis answers PING but refuses every batch."""
        try:
            store.r.set(f"{store.p}:healthz", str(time.time()), ex=60)
        except Exception as exc:
            if refused_for_memory(exc):
                raise fail(503, "redis is full (maxmemory): it refuses writes") from None
            raise fail(503, f"redis: {type(exc).__name__}") from None
        return {"status": "ok", "workers": len(store.batches.workers())}

    @app.get("/v1/models", response_model=ModelList)
    def models(_who: str = Depends(tenant)) -> ModelList:
        """The models live workers serve, by every name they answer to (``served_names``), each
        once, with when its first worker started."""
        since: dict[str, int] = {}
        for w in store.batches.workers():
            started = int(w.get("started_at") or time.time())
            names = w.get("models") or ([w["model"]] if w.get("model") else [])
            for model in names:
                since[model] = min(since.get(model, started), started)
        return ModelList(data=[ModelObject(id=m, created=t) for m, t in sorted(since.items())])

    @app.post("/v1/files", response_model=FileObject)
    async def upload(request: Request, who: str = Depends(tenant)) -> FileObject:
        files, held, _ = await run_in_threadpool(store.usage, who)
        if files >= s.api_max_files:
            raise fail(429, f"this tenant keeps {files} files, its quota; delete some first",
                       "quota_exceeded")  # fmt: skip
        room = s.api_max_stored_bytes - held
        if room <= 0:
            raise fail(429, "this tenant's files fill its storage quota; delete some first",
                       "quota_exceeded")  # fmt: skip
        limit = min(s.max_file_bytes, room)  # the body as it arrives is bounded by ``BodyLimit``
        # Starlette spools each file part to disk past 1 MiB: the upload is never held whole
        form = await request.form(max_files=1, max_fields=8)
        purpose, upload = form.get("purpose"), form.get("file")
        if purpose != "batch":
            raise fail(400, "purpose must be 'batch'", "invalid_purpose")
        if upload is None or isinstance(upload, str):
            raise fail(400, "no file part named 'file'")
        ttl = _expires_after(form)
        if isinstance(ttl, str):
            raise fail(400, ttl, "invalid_expires_after")
        try:
            return await run_in_threadpool(
                store.add_file, who, upload.file, upload.filename or "upload.jsonl", "batch",
                limit, ttl,
            )  # fmt: skip
        except TooLarge:
            if limit < s.max_file_bytes:
                raise fail(429, f"the file is larger than the {room} bytes left of this "
                           "tenant's storage quota", "quota_exceeded") from None  # fmt: skip
            raise fail(413, f"the file is over the {limit}-byte limit (VQUEUE_MAX_FILE_BYTES)",
                       "file_too_large") from None  # fmt: skip
        finally:
            await form.close()

    @app.get("/v1/files", response_model=FileList)
    def list_files(who: str = Depends(tenant)) -> FileList:
        data = store.files(who)
        return FileList(data=data, first_id=data[0].id if data else None,
                        last_id=data[-1].id if data else None)  # fmt: skip

    @app.get("/v1/files/{fid}", response_model=FileObject)
    def get_file(fid: str, who: str = Depends(tenant)) -> FileObject:
        f = store.file(who, fid)
        if f is None:
            raise fail(404, f"no file {fid!r}")
        return f

    @app.get("/v1/files/{fid}/content")
    def file_content(fid: str, who: str = Depends(tenant)) -> Any:
        f = store.file(who, fid)
        if f is None or not store.path(fid).exists():
            raise fail(404, f"no file {fid!r}")
        return FileResponse(store.path(fid), media_type="application/jsonl", filename=f.filename)

    @app.delete("/v1/files/{fid}", response_model=FileDeleted)
    def delete_file(fid: str, who: str = Depends(tenant)) -> FileDeleted:
        if not store.delete_file(who, fid):
            raise fail(404, f"no file {fid!r}")
        return FileDeleted(id=fid, deleted=True)

    @app.post("/v1/batches", response_model=BatchObject)
    async def create_batch(req: BatchCreate, who: str = Depends(tenant)) -> BatchObject:
        f = await run_in_threadpool(store.file, who, req.input_file_id)
        if f is None:
            raise fail(404, f"no file {req.input_file_id!r}")
        if f.purpose != "batch":
            raise fail(400, "the input file's purpose must be 'batch'")
        limit = s.api_max_batch_requests
        if await run_in_threadpool(store.lines_over, req.input_file_id, limit):
            raise HTTPException(400, {
                "message": f"the input file has more than {limit} requests, the most one batch "
                "takes (VQUEUE_API_MAX_BATCH_REQUESTS); split it",
                "type": "invalid_request_error", "param": "input_file_id",
                "code": "too_many_requests",
            })  # fmt: skip
        try:
            canary_share(req.metadata)
        except ValueError as exc:
            raise fail(400, f"metadata canary: {exc}") from None
        open_batches = (await run_in_threadpool(store.usage, who))[2]
        if open_batches >= s.api_max_open_batches:
            raise fail(429, f"this tenant has {open_batches} batches not ended, its quota",
                       "quota_exceeded")  # fmt: skip
        b = await run_in_threadpool(batches.create, who, req)
        batches.feeder.feed(who, b.id)  # checked and submitted off the request, in turn
        return b

    @app.get("/v1/batches/{bid}", response_model=BatchObject)
    def get_batch(bid: str, who: str = Depends(tenant)) -> BatchObject:
        if store.batch(who, bid, live=False) is None:
            raise fail(404, f"no batch {bid!r}")
        b = batches.advance(bid)
        assert b is not None
        return b

    @app.get("/v1/batches", response_model=BatchList)
    def list_batches(
        after: str | None = None, limit: int = 20, who: str = Depends(tenant)
    ) -> BatchList:
        limit = max(1, min(limit, 100))
        ids = store.batch_ids(who)
        if after is not None:
            ids = ids[ids.index(after) + 1 :] if after in ids else []
        page = [found[1] for i in ids[: limit + 1] if (found := store.batch(who, i))]
        more = len(page) > limit
        page = page[:limit]
        return BatchList(data=page, first_id=page[0].id if page else None,
                         last_id=page[-1].id if page else None, has_more=more)  # fmt: skip

    @app.post("/v1/batches/{bid}/cancel", response_model=BatchObject)
    def cancel_batch(bid: str, who: str = Depends(tenant)) -> BatchObject:
        b = batches.cancel(who, bid)
        if b is None:
            raise fail(404, f"no batch {bid!r}")
        return b

    return app


class BodyLimit:
    """Refuses a request body past ``limit(path)`` bytes with 413, counted as it arrives, so a
    chunked upload (no Content-Length) is bounded like any other. The app sees the request end
    where the limit passed, and whatever it answers to that is replaced by the 413."""

    def __init__(self, app: Any, limit: Any) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit(scope["path"])
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > limit:
            await self._refuse(send, limit)
            return
        seen, over = 0, False

        async def counted() -> Any:
            nonlocal seen, over
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    over = True
                    return {"type": "http.disconnect"}
            return message

        async def unless_over(message: Any) -> None:
            if not over:
                await send(message)

        try:
            await self.app(scope, counted, unless_over)
        except Exception:
            if not over:
                raise
        if over:
            await self._refuse(send, limit)

    @staticmethod
    async def _refuse(send: Any, limit: int) -> None:
        body = json.dumps({"error": {
            "message": f"the request body is over its {limit}-byte limit",
            "type": "invalid_request_error", "param": None, "code": "request_too_large",
        }}).encode()  # fmt: skip
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json")]})  # fmt: skip
        await send({"type": "http.response.body", "body": body})


def serve(host: str, port: int, settings: Settings | None = None) -> None:
    """One server process: its request handlers share the GIL with the feeder threads that
    parse and check tenants' files, so it hands the GIL on as often as a worker does
    (``gil_switch_ms``): a tenant's small request gets in between another's lines
    (docs/benchmarks.md, one tenant beside another's flood)."""
    import uvicorn

    s = settings or get_settings()
    sys.setswitchinterval(s.gil_switch_ms / 1000)
    uvicorn.run(create_app(s), host=host, port=port, log_level="warning")
