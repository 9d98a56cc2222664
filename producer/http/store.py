"""Where ``vqueue serve`` keeps its tenants' keys, files and batch objects: Redis, under the key
prefix, and file contents under ``VQUEUE_FILES_DIR``; with the leases that let several server
processes share one Redis."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import secrets
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis
from redis.exceptions import LockError
from redis.lock import Lock

from protocol.store import BatchStore
from schemas import BatchStatus, Settings
from schemas.api import FINAL_STATES, BatchObject, BatchUsage, FileObject, RequestCounts
from schemas.settings import cache_dir

log = logging.getLogger(__name__)

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


def _safe_name(filename: str) -> str:
    """An upload's name as it is echoed back (the file object, ``Content-Disposition``): its
    last path part, printable characters only, bounded."""
    name = os.path.basename(filename.replace("\\", "/"))
    name = "".join(c for c in name if c.isprintable() and c not in '"')[:200]
    return name or "upload.jsonl"


class TooLarge(ValueError):
    pass


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
