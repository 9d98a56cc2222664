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
import itertools
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Sized
from typing import Any

import redis
from pydantic import TypeAdapter

from protocol.routing import Router
from protocol.store import BatchStore, refused_for_memory
from protocol.wire import Frame
from schemas import BatchStatus, Envelope, ExtractJob, Job, JobResult, Settings, get_settings
from schemas.jobs import Format

from .batch import PAGE, Batch, _Follow
from .errors import Gone, Refused, SubmissionStopped

log = logging.getLogger("vqueue")
_job_adapter: TypeAdapter[Any] = TypeAdapter(Job)
# Jobs per Redis pipeline flush: large enough to amortize round trips, small enough to stream;
# and a byte bound, so a chunk of long documents stays a reasonable request.
PUBLISH_CHUNK = 1000
# the first chunk: small, so workers start on it while the rest is validated and sent, rather
# than waiting for a whole chunk of 1,000
PUBLISH_FIRST = 32
PUBLISH_CHUNK_BYTES = 16 * 1024 * 1024
# the smallest automatic feed window (Settings.feed_window): enough that a batch of ordinary
# size goes into Redis whole, and workers that start later find work waiting
FEED_WINDOW_MIN = 10_000
# how often the automatic window is sized again from the live workers
FEED_WINDOW_REFRESH_S = 10.0


def new_batch_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:8]


class Client:
    """Submits jobs to the queue and reads results back; thread-safe for submitting."""

    def __init__(
        self,
        settings: Settings | None = None,
        on_wait: Callable[[str], None] | None = None,
        stop: threading.Event | None = None,
        **overrides: Any,
    ) -> None:
        self.settings = (settings or get_settings()).model_copy(update=overrides)
        # told why submission is pausing (rate limit, full queue); the CLI prints it
        self.on_wait = on_wait
        # set by whoever feeds through this client when the feed must end: every wait for
        # room (rate, depth, window) can last as long as the queue stays full, so each one
        # looks at it, and ends with ``Gone``
        self._stop = stop or threading.Event()
        self._told = ""
        s = self.settings
        self.store = BatchStore.from_settings(s)
        self._templates_seen: set[str] = set()
        # jobs go to the broker; batches and results live in the result backend (often the same)
        same = s.broker_url == s.backend_url()
        self.broker = (
            self.store.r if same else BatchStore.from_url(s.broker_url, retry_s=s.redis_retry_s).r
        )
        self.router = Router(
            self.store, self.broker, s.queue, s.route_spill_depth, by_prefix=s.prefix_routing,
            wait=s.unserved_model == "wait",
        )  # fmt: skip
        self._window, self._window_at = FEED_WINDOW_MIN, -FEED_WINDOW_REFRESH_S
        self._per, self._per_at = self.settings.jobs_per_message, -FEED_WINDOW_REFRESH_S

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
        force: bool = False,
        position: int | None = None,
        expected: int | None = None,
    ) -> Batch:
        """Validate and enqueue ``jobs`` in pipelined chunks; returns once all are in Redis.
        A batch holds at most its window of jobs in Redis (``window``): past it, this waits
        for workers to finish some, so a big input is fed as they go.

        Dicts are validated against the job models first (``pydantic.ValidationError`` on a bad
        one, before anything of that chunk is sent). ``seal=False`` leaves the batch open for
        more ``submit_many`` calls with the same id; ``seal_batch`` closes it. An id that already
        has a result in the batch is skipped, unless ``force``: then its result is withdrawn and
        it runs again; one queued in it already is not sent again (``Batch.queued_before``;
        ``_publish`` says when it is). ``position``: how many of the input's jobs came before
        ``jobs``; given, the batch records with each chunk how many are sent
        (``BatchStore.fed_position``), so a feed whose process dies resumes where it stopped.
        ``expected``: about how many jobs the batch will hold, when known, so a new batch's
        done marks are stored compactly (``BatchStore.create``); ``len(jobs)`` where it has one.
        """
        batch_id = batch or new_batch_id()
        if expected is None and isinstance(jobs, Sized):
            expected = len(jobs)
        self.store.create(batch_id, "vqueue", source, queue=self.settings.queue, expected=expected)
        if position is not None:
            self.store.feed_start(batch_id, f"{socket.gethostname()}:{os.getpid()}")
        chunk: list[Envelope] = []
        size = skipped = queued_before = 0
        # a chunk never outgrows the queue-depth limit, or it could never be admitted; chunks
        # grow from PUBLISH_FIRST to PUBLISH_CHUNK, doubling
        cap = min(PUBLISH_CHUNK, self.settings.max_queue_depth or PUBLISH_CHUNK)
        cap = min(cap, max(self.window() // 4, 1))  # a window passes several chunks at once
        chunk_jobs = min(PUBLISH_FIRST, cap)
        sent = 0
        try:
            for item in jobs:
                env = self._envelope(item, batch_id)
                chunk.append(env)
                size += len(env.wire()) + 1024  # the envelope, and Celery's headers around it
                if len(chunk) >= chunk_jobs or size >= PUBLISH_CHUNK_BYTES:
                    fed = None if position is None else position + sent + len(chunk)
                    done, queued = self._publish(chunk, batch_id, force, fed)
                    skipped, queued_before = skipped + done, queued_before + queued
                    sent += len(chunk)
                    if on_progress:
                        on_progress(len(chunk))
                    chunk, size = [], 0
                    chunk_jobs = min(2 * chunk_jobs, cap)
            if chunk:
                fed = None if position is None else position + sent + len(chunk)
                done, queued = self._publish(chunk, batch_id, force, fed)
                skipped, queued_before = skipped + done, queued_before + queued
                sent += len(chunk)
                if on_progress:
                    on_progress(len(chunk))
        except redis.RedisError as exc:
            raise self._stopped(batch_id, sent - skipped, exc) from None
        if seal:
            self.store.seal(batch_id, fed_all=True)
        b = Batch(self, batch_id)
        b.skipped, b.queued_before = skipped, queued_before
        return b

    def lost(self, batch_id: str) -> bool:
        """Whether jobs of the batch are lost: it is sealed and not complete, yet no job waits
        for this client's queue's workers, none of them is running one, and no result has come
        for longer than the visibility timeout (after which Redis hands back what a dead
        worker had reserved). A worker killed while it took a job off its list loses that
        one job (docs/reliability.md); its id is claimed and has no result."""
        st = self.store.status(batch_id)
        if st is None or not st.sealed or st.done >= st.total or self.store.withdrawn(batch_id):
            return False
        quiet_s = time.time() - (st.updated_at or st.created_at)
        if quiet_s < self.settings.visibility_timeout_s + self.settings.lost_job_grace_s:
            return False
        busy = any(
            w.get("in_flight")
            for w in self.store.workers()
            if w.get("queue") == self.settings.queue
        )
        return not busy and self.waiting() == 0

    def resend(self, jobs: Iterable[Job | dict[str, Any] | Envelope], batch_id: str) -> int:
        """Send again those of ``jobs`` (the batch's input, read again) that were sent and have
        no result; each runs once, whichever copy a worker takes first. How many went."""
        sent = 0
        chunk: list[Envelope] = []
        for item in itertools.chain(jobs, [None]):  # the input streamed, never held whole
            if item is not None:
                chunk.append(self._envelope(item, batch_id))
            if len(chunk) >= PUBLISH_CHUNK or (item is None and chunk):
                done = self.store.marks(batch_id, [(e.job.id, e.line) for e in chunk])
                todo = [e for e, d in zip(chunk, done, strict=True) if d == ""]
                if todo:
                    self._publish(todo, batch_id, again=True)
                    sent += len(todo)
                chunk = []
        return sent

    def _stopped(self, batch_id: str, sent: int, exc: redis.RedisError) -> SubmissionStopped:
        if refused_for_memory(exc):
            why = "Redis is full (maxmemory) and refused the next jobs"
        else:
            why = f"Redis refused the next jobs ({type(exc).__name__}: {exc})"
        reason = (
            f"{why}; the {sent} jobs before them are enqueued and run. Once Redis has room, "
            f"submit the same input again with --batch {batch_id}: only what is missing is sent"
        )
        try:
            self.store.stop_submission(batch_id, reason)
        except redis.RedisError as again:  # Redis gone: the batch stays open, waiting says so
            log.warning("batch %s: could not record why submission stopped: %s", batch_id, again)
        return SubmissionStopped(batch_id, sent, reason)

    def seal_batch(self, batch_id: str) -> None:
        self.store.seal(batch_id)

    def cancel(self, batch_id: str) -> bool:
        """Withdraw the batch's jobs that have not started: each ends with a ``cancelled``
        result, so the batch completes, keeping what finished. Jobs already generating are
        aborted within about a second. With no live worker on the batch's queue, the results
        are recorded here, so the batch ends now. False if there is no such batch."""
        if not self.store.withdraw(batch_id, "cancelled"):
            return False
        if self.store.unpause(batch_id) is not None:  # its canary failed: the rest never goes
            self.store.seal(batch_id, fed_all=True)
        if not self.store.consumed(self.store.queue_of(batch_id)):
            self.store.close_unstarted(batch_id)
        return True

    def _envelope(self, item: Any, batch_id: str) -> Envelope:
        tenant = self.settings.tenant
        if isinstance(item, Envelope):  # it joins this batch and tenant, whatever it was made for
            if (item.batch, item.tenant) == (batch_id, tenant):
                return item
            return Envelope(**{**dict(item), "batch": batch_id, "tenant": tenant})
        job = item if not isinstance(item, dict) else _job_adapter.validate_python(item)
        try:
            return self.envelope(job, batch_id)
        except ValueError as exc:
            raise ValueError(f"job {job.id}: {exc}") from None

    def envelope(
        self,
        job: Job,
        batch_id: str,
        *,
        fmt: Format = "vqueue",
        model: str | None = None,
        cache: bool = True,
        line: int | None = None,
    ) -> Envelope:
        """What travels for ``job`` in batch ``batch_id``, this client's tenant's: the one
        builder every way in uses (``submit``, ``vqueue submit``, the HTTP batches). ``line``:
        its line in the batch's input file, by which it is then known. ``ValueError``, saying
        why, for a job that cannot be enqueued: a template nobody registered, or a job whose
        message cannot be written."""
        if problem := self.template_problem(job):
            raise ValueError(problem)
        try:
            env = Envelope(
                job=job, batch=batch_id, format=fmt, model=model, enqueued_at=time.time(),
                tenant=self.settings.tenant, cache=cache, line=line,
            )  # fmt: skip
            env.wire()  # serialized once here: a job nested past what JSON can write fails now
        except (ValueError, RecursionError) as exc:
            raise ValueError(f"cannot be enqueued: {exc}") from None
        return env

    def template_problem(self, job: Job) -> str | None:
        """Why ``job`` cannot run here for its template, or None: the one template check."""
        name = job.template if isinstance(job, ExtractJob) else None
        if name is None or self.template_known(name):
            return None
        return f"unknown template {name!r} (see 'vqueue templates list')"

    def template_known(self, name: str) -> bool:
        """A built-in or registered extraction template (looked up once per name)."""
        from schemas.templates import BUILTIN

        if name in BUILTIN or name in self._templates_seen:
            return True
        if self.store.template(name, self.settings.tenant) is None:
            return False
        self._templates_seen.add(name)
        return True

    def _publish(
        self,
        envelopes: list[Envelope],
        batch_id: str,
        force: bool = False,
        fed: int | None = None,
        again: bool = False,
    ) -> tuple[int, int]:
        """Claim, then send, one chunk (a round trip each); returns how many were skipped
        because their id already has a result in this batch, and how many because it is
        queued already.

        Claiming first means a fast worker can never finish more jobs than ``total`` says, and a
        re-submitted id is counted once. Where queues and batches share one Redis, claim and
        push are one step, so an id claimed before and not finished is queued (or running)
        already and is not sent again unless ``again`` (or ``force``) says its message is gone.
        With a broker of its own the send follows the claim, and may have died with its
        producer: such an id is sent again, and the worker runs it once.
        """
        self._admit(len(envelopes), batch_id)
        if force:  # a forced re-run: withdraw the results these jobs have
            self.store.forget_many(batch_id, [(e.job.id, e.line) for e in envelopes])
        # a prefix group's jobs travel together, so an engine takes them in one stretch
        envelopes = sorted(envelopes, key=lambda e: e.prefix_key or "")
        if self.broker is self.store.r:  # queues and batches in one Redis: one atomic step
            messages = self._frames(envelopes)
            flags = self.store.claim_send(batch_id, messages, fed, again or force)
            return flags.count(-1), 0 if again or force else flags.count(0)
        flags = self.store.claim(batch_id, [(e.job.id, e.line) for e in envelopes])
        todo = [e for e, f in zip(envelopes, flags, strict=True) if f >= 0]
        self._send(todo)
        if fed is not None:  # after the send: a feed that dies between resends, never skips
            self.store.r.hset(self.store.key(batch_id), mapping={"fed": fed, "fed_at": time.time()})
        return len(envelopes) - len(todo), 0

    def _route(self, envelopes: list[Envelope]) -> list[tuple[str, list[Envelope]]]:
        """Urgent jobs to the urgent queue, which no worker's full share of bulk jobs blocks;
        the rest to the worker their prefix routes them to, or to the shared queue. Embedding
        jobs go to pooling workers, urgent or not (``protocol.routing``)."""
        from protocol.routing import urgent_queue

        s = self.settings
        out = []
        urgent: list[Envelope] = []
        rest: list[Envelope] = []
        for e in envelopes:
            is_urgent = e.job.priority >= s.urgent_priority and e.job.type != "embed"
            (urgent if is_urgent else rest).append(e)
        if urgent:
            out.append((urgent_queue(s.queue), urgent))
            envelopes = rest
        if self.router.by_prefix or any(
            e.model is not None or e.job.type == "embed" for e in envelopes
        ):
            out.extend(self.router.route(envelopes).items())
        else:
            out.append((s.queue, envelopes))
        return [(queue, group) for queue, group in out if group]

    def _frames(self, envelopes: list[Envelope]) -> list[Frame]:
        """``envelopes`` routed, as messages: an urgent job alone in its message, so that
        nothing waits on its way; the rest ``jobs_per_message`` to a message."""
        from protocol.routing import urgent_queue
        from protocol.wire import frames

        urgent, per = urgent_queue(self.settings.queue), self.jobs_per_message()
        out: list[Frame] = []
        for queue, group in self._route(envelopes):
            out += frames(group, queue, 1 if queue == urgent else per)
        return out

    def _send(self, envelopes: list[Envelope]) -> None:
        from protocol.wire import push

        push(self.broker, self._frames(envelopes))

    def jobs_per_message(self) -> int:
        """Jobs a bulk message carries: ``Settings.jobs_per_message``, at most half the least
        concurrency among the live workers of this queue. A worker holds a pack whole, so one
        larger than its share would keep jobs waiting on a busy worker that the rest of the
        fleet could run, and a worker killed would hand back more than it was running."""
        now = time.monotonic()
        if now - self._per_at >= FEED_WINDOW_REFRESH_S:
            self._per_at = now
            shares = [
                int(w.get("concurrency") or 0)
                for w in self.store.workers()
                if w.get("queue") == self.settings.queue
            ]
            least = min((c for c in shares if c > 0), default=0)
            per = self.settings.jobs_per_message
            self._per = max(1, min(per, least // 2)) if least else per
        return self._per

    def window(self) -> int:
        """Jobs of one batch that may be in Redis at once (``Settings.feed_window``); by
        default four times what the live workers on this queue hold in flight, so each has
        its next jobs waiting, and at least ``FEED_WINDOW_MIN``."""
        if self.settings.feed_window:
            return self.settings.feed_window
        now = time.monotonic()
        if now - self._window_at >= FEED_WINDOW_REFRESH_S:
            self._window_at = now
            held = sum(
                int(w.get("max_in_flight") or w.get("concurrency") or 0)
                for w in self.store.workers()
                if w.get("queue") == self.settings.queue and w.get("routed")
            )
            self._window = max(FEED_WINDOW_MIN, 4 * held)
        return self._window

    def _admit(self, n: int, batch_id: str | None = None) -> None:
        """Wait (or refuse) until the tenant's rate and the queue's depth admit ``n`` more;
        then, for a batch, wait until its window has room (never refused: the window is how a
        big input is fed, not a limit on it)."""
        s = self.settings
        rate, burst = s.tenant_rate(s.tenant), s.rate_limit_burst
        taken = 0
        while rate > 0 and taken < n:  # in burst-sized bites: more could never pass at once
            bite = min(n - taken, burst)
            wait = self.store.take_tokens(s.tenant, bite, rate, burst)
            if wait:
                if batch_id is not None:
                    self.store.feed_alive(batch_id)
                self._pause(f"tenant {s.tenant!r} is over its {rate:g} jobs/s", wait)
            else:
                taken += bite
        while s.max_queue_depth:
            depth = self.waiting()
            if depth + n <= s.max_queue_depth:
                return
            limit = f"VQUEUE_MAX_QUEUE_DEPTH={s.max_queue_depth}"
            if batch_id is not None:
                self.store.feed_alive(batch_id)
            self._pause(f"queue {s.queue!r} is full ({limit})", 1.0)
        while batch_id is not None:
            window = self.window()
            held = self.store.unfinished(batch_id)
            if held + n <= window or held <= 0:
                return
            self.store.feed_alive(batch_id)
            why = (f"batch {batch_id} holds its window of {window} jobs in Redis; the rest of "
                   "the input follows as workers finish them")  # fmt: skip
            if self.on_wait and why != self._told:
                self.on_wait(f"feeding: {why}")
            self._told = why
            self._sleep(0.2)

    def _pause(self, why: str, seconds: float) -> None:
        if self.settings.on_limit == "refuse":
            raise Refused(f"submission refused: {why}")
        if self.on_wait and why != self._told:  # once per reason, not once per poll
            self.on_wait(f"waiting: {why}")
        self._told = why
        self._sleep(min(max(seconds, 0.01), 5.0))

    def _sleep(self, seconds: float) -> None:
        if self._stop.wait(seconds):
            raise Gone("the batch left Redis while it was fed")

    def requeue_dead_letter(self, task_id: str) -> bool:
        """Run a dead-lettered job again: its failed result is withdrawn, its envelope sent to
        this client's queue. False when there is no such dead letter."""
        entry = self.store.dead_letter_entry(task_id)
        if entry is None:
            return False
        env = Envelope.model_validate(entry["envelope"])
        self.store.forget(env.batch, env.job.id, env.line)
        self._send([env])
        self.store.drop_dead_letter(task_id)
        return True

    def queue_depth(self, queue: str | None = None) -> int:
        """Jobs waiting in one queue (by default the shared one)."""
        from protocol.wire import queue_depth

        return queue_depth(self.broker, queue or self.settings.queue)

    def waiting(self) -> int:
        """Jobs waiting for this client's queue's workers: the shared queue and each live
        worker's own (prefix routing sends most jobs there), which ``max_queue_depth`` bounds."""
        from protocol.routing import embed_queue, urgent_queue, worker_queue

        queues = [self.settings.queue, urgent_queue(self.settings.queue),
                  embed_queue(self.settings.queue)]  # fmt: skip
        queues += [
            worker_queue(self.settings.queue, w["name"])
            for w in self.store.workers()
            if w.get("queue") == self.settings.queue and w.get("routed")
        ]
        return sum(self.queue_depth(q) for q in queues)


class AsyncClient:
    """The asyncio face of ``Client``: submission runs in a thread, results stream natively."""

    def __init__(self, settings: Settings | None = None, **overrides: Any) -> None:
        import redis.asyncio as aioredis

        self._sync = Client(settings, **overrides)
        self.settings = self._sync.settings
        from redis.asyncio.retry import Retry
        from redis.backoff import ExponentialBackoff
        from redis.exceptions import BusyLoadingError, ConnectionError, TimeoutError

        self._r = aioredis.Redis.from_url(
            self.settings.backend_url(),
            decode_responses=True,
            retry=Retry(ExponentialBackoff(cap=2.0, base=0.05), int(self.settings.redis_retry_s)),
            retry_on_error=[BusyLoadingError, ConnectionError, TimeoutError],
        )

    async def submit_many(self, jobs: Iterable[Any], batch: str | None = None) -> str:
        items = list(jobs)
        b = await asyncio.to_thread(self._sync.submit_many, items, batch)
        return b.id

    async def submit(self, job: Any, batch: str | None = None) -> str:
        return await self.submit_many([job], batch)

    async def status(self, batch: str) -> BatchStatus:
        return await asyncio.to_thread(self._sync.batch(batch).status)

    async def results(self, batch: str, timeout: float | None = None) -> AsyncIterator[JobResult]:
        """Results of ``batch`` as they complete, until the last one (``Batch.results``'s
        rules: ``WaitTimeout``, ``Stalled``)."""
        store = self._sync.store
        stream, after = store.key(batch, "results"), "0-0"
        follow = await asyncio.to_thread(_Follow, self._sync.batch(batch), timeout, None, True)
        while True:
            if follow.complete:
                low = f"({after}" if after != "0-0" else "-"
                entries = await self._r.xrange(stream, min=low, count=PAGE)
            else:
                resp = await self._r.xread({stream: after}, count=PAGE, block=follow.block_ms())
                entries = resp[0][1] if resp else []
            for entry_id, fields in entries:
                after = entry_id  # resume point for the next read
                yield JobResult.model_validate_json(fields["result"])
            counted = follow.took(len(entries))
            if follow.complete:
                if not entries:
                    return
                continue
            if counted or (len(entries) < PAGE and follow.due()):  # caught up: the last?
                await asyncio.to_thread(follow.check)

    async def result(self, batch: str, job_id: str, timeout: float | None = None) -> JobResult:
        return await asyncio.to_thread(self._sync.batch(batch).result, job_id, timeout)

    async def aclose(self) -> None:
        await self._r.aclose()
