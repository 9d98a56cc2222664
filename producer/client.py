"""The Python client backend services use: submit jobs, follow batches, read results.

Only Celery, Redis and pydantic are imported here: a producer never needs vLLM or torch.

    from producer import Client
    client = Client()                                  # VQUEUE_BROKER_URL etc.
    batch = client.submit_many([{"type": "summarize", "text": "..."}])
    for result in batch.results():                     # as they complete
        print(result.id, result.status, result.text)
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from typing import Any

import redis
from pydantic import TypeAdapter

from schemas import BatchStatus, Envelope, Job, JobResult, Settings, get_settings

from .store import BatchStore

_job_adapter: TypeAdapter[Any] = TypeAdapter(Job)
# Jobs per Redis pipeline flush: large enough to amortize round trips, small enough to stream.
PUBLISH_CHUNK = 1000


class VQueueError(Exception):
    """Root of the producer's errors."""


class BatchNotFound(VQueueError):
    pass


class WaitTimeout(VQueueError):
    pass


def new_batch_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:8]


class Batch:
    """A handle on one batch: its counters and its results, as they arrive."""

    def __init__(self, client: Client, batch_id: str) -> None:
        self.client = client
        self.id = batch_id
        self.last_entry = "0-0"  # the stream entry of the last result read; resume from it

    def __repr__(self) -> str:
        return f"Batch({self.id!r})"

    def status(self) -> BatchStatus:
        st = self.client.store.status(self.id)
        if st is None:
            raise BatchNotFound(f"no batch {self.id!r} (expired, or another broker/key prefix?)")
        return st

    def results(self, timeout: float | None = None, after: str = "0-0") -> Iterator[JobResult]:
        """Every result of the batch, in completion order, blocking until the last one.

        ``after`` resumes from a stream entry id (``Batch.last_entry``) instead of the start.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        store = self.client.store
        while True:
            page = store.read(self.id, after, block_ms=1000)
            for after, res in page:
                self.last_entry = after
                yield res
            if not page:
                st = self.status()
                if store.is_sealed(self.id) and st.done >= st.total:
                    return
                if deadline is not None and time.monotonic() > deadline:
                    raise WaitTimeout(f"batch {self.id}: {st.remaining} jobs still running")

    def wait(self, timeout: float | None = None, poll_s: float = 0.5) -> BatchStatus:
        """Block until every job of the batch has a result; returns the final counters."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            st = self.status()
            if self.client.store.is_sealed(self.id) and st.done >= st.total:
                return st
            if deadline is not None and time.monotonic() > deadline:
                raise WaitTimeout(f"batch {self.id}: {st.remaining} jobs still running")
            time.sleep(poll_s)

    def result(self, job_id: str, timeout: float | None = None) -> JobResult:
        """Wait for one job's result."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            res = self.client.store.result(self.id, job_id)
            if res is not None:
                return res
            if deadline is not None and time.monotonic() > deadline:
                raise WaitTimeout(f"job {job_id} of batch {self.id} has no result yet")
            self.client.store.read(self.id, "$", block_ms=500)  # wake on the next result


class Client:
    """Submits jobs to the queue and reads results back; thread-safe for submitting."""

    def __init__(self, settings: Settings | None = None, **overrides: Any) -> None:
        self.settings = (settings or get_settings()).model_copy(update=overrides)
        s = self.settings
        self.store = BatchStore.from_url(s.backend_url(), s.key_prefix, s.result_ttl_s)
        # jobs go to the broker; batches and results live in the result backend (often the same)
        same = s.broker_url == s.backend_url()
        self.broker = self.store.r if same else redis.Redis.from_url(s.broker_url)

    def batch(self, batch_id: str) -> Batch:
        return Batch(self, batch_id)

    def submit(self, job: Job | dict[str, Any], batch: str | None = None) -> Batch:
        """Enqueue one job (a batch of one); ``batch.result(job.id)`` waits for it."""
        return self.submit_many([job], batch=batch)

    def submit_many(
        self,
        jobs: Iterable[Job | dict[str, Any] | Envelope],
        batch: str | None = None,
        source: str | None = None,
        seal: bool = True,
        on_progress: Callable[[int], None] | None = None,
    ) -> Batch:
        """Validate and enqueue ``jobs`` in pipelined chunks; returns once all are in Redis.

        Dicts are validated against the job models first (``pydantic.ValidationError`` on a bad
        one, before anything of that chunk is sent). ``seal=False`` leaves the batch open for
        more ``submit_many`` calls with the same id; ``seal_batch`` closes it.
        """
        batch_id = batch or new_batch_id()
        if self.store.status(batch_id) is None:
            self.store.create(batch_id, "vqueue", source)
        chunk: list[Envelope] = []
        for item in jobs:
            chunk.append(self._envelope(item, batch_id))
            if len(chunk) >= PUBLISH_CHUNK:
                self._publish(chunk, batch_id)
                if on_progress:
                    on_progress(len(chunk))
                chunk = []
        if chunk:
            self._publish(chunk, batch_id)
            if on_progress:
                on_progress(len(chunk))
        if seal:
            self.store.seal(batch_id)
        return Batch(self, batch_id)

    def seal_batch(self, batch_id: str) -> None:
        self.store.seal(batch_id)

    def _envelope(self, item: Any, batch_id: str) -> Envelope:
        if isinstance(item, Envelope):
            return item
        job = item if not isinstance(item, dict) else _job_adapter.validate_python(item)
        return Envelope(job=job, batch=batch_id, enqueued_at=time.time())

    def _publish(self, envelopes: list[Envelope], batch_id: str) -> None:
        """Count, then send, one chunk (a pipelined round trip each).

        Counting first means a fast worker can never finish more jobs than ``total`` says.
        """
        from .publish import send_envelopes

        pipe = self.store.r.pipeline(transaction=False)
        self.store.add_total(pipe, batch_id, len(envelopes))
        pipe.execute()
        send_envelopes(self.broker, envelopes, self.settings.queue)

    def queue_depth(self, queue: str | None = None) -> int:
        from .publish import queue_depth

        return queue_depth(self.broker, queue or self.settings.queue)


class AsyncClient:
    """The asyncio face of ``Client``: submission runs in a thread, results stream natively."""

    def __init__(self, settings: Settings | None = None, **overrides: Any) -> None:
        import redis.asyncio as aioredis

        self._sync = Client(settings, **overrides)
        self.settings = self._sync.settings
        self._r = aioredis.Redis.from_url(self.settings.backend_url(), decode_responses=True)

    async def submit_many(self, jobs: Iterable[Any], batch: str | None = None) -> str:
        items = list(jobs)
        b = await asyncio.to_thread(self._sync.submit_many, items, batch)
        return b.id

    async def submit(self, job: Any, batch: str | None = None) -> str:
        return await self.submit_many([job], batch)

    async def status(self, batch: str) -> BatchStatus:
        return await asyncio.to_thread(self._sync.batch(batch).status)

    async def results(self, batch: str, timeout: float | None = None) -> AsyncIterator[JobResult]:
        """Results of ``batch`` as they complete, until the last one."""
        store = self._sync.store
        stream, after = store.key(batch, "results"), "0-0"
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            resp = await self._r.xread({stream: after}, count=1000, block=1000)
            entries = resp[0][1] if resp else []
            for entry_id, fields in entries:
                after = entry_id  # resume point for the next read
                yield JobResult.model_validate_json(fields["result"])
            if not entries:
                st = await self.status(batch)
                if await self._r.hget(store.key(batch), "sealed") == "1" and st.done >= st.total:
                    return
                if deadline is not None and time.monotonic() > deadline:
                    raise WaitTimeout(f"batch {batch}: {st.remaining} jobs still running")

    async def result(self, batch: str, job_id: str, timeout: float | None = None) -> JobResult:
        return await asyncio.to_thread(self._sync.batch(batch).result, job_id, timeout)

    async def aclose(self) -> None:
        await self._r.aclose()
