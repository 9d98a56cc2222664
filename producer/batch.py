"""A handle on one batch (``Batch``): its counters, its results as they arrive, waiting for it
to end; and the rules of waiting (``_Follow``): a caller's timeout, no live worker, no new
result for too long, jobs lost on the way.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Iterator
from typing import Protocol

from protocol.store import BatchStore
from schemas import BatchStatus, JobResult, Settings

from .errors import BatchNotFound, Stalled, WaitTimeout

log = logging.getLogger("vqueue")
# a feed that has not shown it is alive for this long is taken for dead (its process killed)
FEED_STALE_S = 30.0


def feed_stopped(fed_at: float | None, fed_by: str | None) -> bool:
    """Whether a feed not finished has stopped: its process, on this host, is gone, or it
    has not shown it was alive for ``FEED_STALE_S``."""
    host, _, pid = (fed_by or "").rpartition(":")
    if host == socket.gethostname() and pid.isdigit():
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # another user's process, alive
            pass
    return time.time() - (fed_at or 0) > FEED_STALE_S


class Owner(Protocol):
    """What a batch handle needs of the client it came from (``producer.client.Client``)."""

    settings: Settings
    store: BatchStore
    on_wait: Callable[[str], None] | None

    def lost(self, batch_id: str) -> bool: ...


# How often a waiting reader asks whether any worker consumes the batch's queue.
LIVENESS_CHECK_S = 5.0


PAGE = 1000  # results per read of a batch's stream
# How often a reader that keeps catching up with a running batch asks whether it is complete:
# the question is two Redis calls, which cost more than the few results a short page brings.
# A reader from the stream's start asks at once when its count of results reaches the batch's
# total (``_Follow.took``); one that resumed midway waits at most this long past the last result.
COMPLETE_CHECK_S = 0.05


class _Follow:
    """One reader's wait on a batch, shared by every loop that waits (``Batch.results``,
    ``Batch.wait``, ``Batch.result``, ``AsyncClient.results``): when the batch is complete, and
    when waiting stopped making sense. Nothing here reads results; the loops do."""

    def __init__(
        self,
        batch: Batch,
        timeout: float | None,
        on_lost: Callable[[], None] | None = None,
        counting: bool = False,
    ) -> None:
        s = batch.client.settings
        # called when jobs of the batch were lost on the way (``Client.lost``), to send them
        # again; checked once no result has come for the visibility timeout and the grace
        self.on_lost, self.lost_checked = on_lost, 0.0
        self.lost_after = s.visibility_timeout_s + s.lost_job_grace_s
        self.batch, self.store = batch, batch.client.store
        self.queue = self.store.queue_of(batch.id) or s.queue
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.no_worker_s, self.stall_s = s.wait_no_worker_s, s.wait_stall_s
        self.complete, self.asked_at = False, 0.0
        # A reader of the stream from its start (``counting``) that has taken as many results
        # as a sealed batch has jobs most likely has them all: a sealed batch's total is final,
        # and a job's result is in the stream once, unless a forced re-run replaced one the
        # reader had taken already. So it asks then, not at the next due check; the counts
        # (``check``) decide.
        self.counting, self.taken, self.total = counting, 0, None  # type: bool, int, int | None
        now = time.monotonic()
        self.done, self.progress_at = -1, now
        self.checked_at, self.alone_since = 0.0, None  # type: float, float | None
        self.told_alone = self.told_stall = self.told_feed = False

    def took(self, n: int) -> bool:
        """The reader took ``n`` more results off the stream; True when it should ``check``
        now, whether or not a check is due: its count has reached the batch's total."""
        self.taken += n
        return bool(n) and self.counting and self.total is not None and self.taken >= self.total

    def due(self) -> bool:
        """Whether a reader that caught up should ``check`` now (``COMPLETE_CHECK_S``)."""
        return time.monotonic() - self.asked_at >= COMPLETE_CHECK_S

    def block_ms(self) -> int:
        """How long the next read of the stream may wait for a result: until the next check
        is due, so the last result is followed by the news of completion within
        ``COMPLETE_CHECK_S``; a second while checks are due (XREAD's 0 is forever: never 0)."""
        wait = self.asked_at + COMPLETE_CHECK_S - time.monotonic()
        return 1000 if wait <= 0 else max(1, int(1000 * wait))

    def check(self) -> bool:
        """After a wait that brought nothing: True once every job has a result (read once
        more, then stop); raises ``WaitTimeout`` or ``Stalled`` when waiting should end."""
        self.asked_at = time.monotonic()
        # A worker stores a result and counts it in one script, so once the counts say complete
        # every result is in the stream; the caller reads once more to take any stored since.
        sealed = self.store.is_sealed(self.batch.id)  # first: once sealed, the total is final
        st = self.batch.status()
        if sealed:
            self.total = st.total
        self.complete = sealed and st.done >= st.total
        if self.complete:
            return True
        now = time.monotonic()
        if st.done != self.done:
            self.done, self.progress_at, self.told_stall = st.done, now, False
        if self.deadline is not None and now > self.deadline:
            raise WaitTimeout(f"batch {self.batch.id}: {st.remaining} jobs still running")
        if st.paused and st.done >= st.total:
            raise Stalled(
                f"batch {self.batch.id} is paused: its canary failed; 'vqueue status "
                f"{self.batch.id}' says why, 'vqueue resume {self.batch.id}' sends the rest of "
                f"its input, 'vqueue cancel {self.batch.id}' ends it"
            )
        if now - self.checked_at >= LIVENESS_CHECK_S:
            self.checked_at = now
            self._check_workers(now, st.remaining)
            if st.fed is not None and not self.told_feed and feed_stopped(st.fed_at, st.fed_by):
                self.told_feed = True
                self._say(
                    f"batch {self.batch.id}: its feed stopped after {st.fed} jobs of its input; "
                    f"submit the same input again with --batch {self.batch.id} to send the rest"
                )
        idle = now - self.progress_at
        if self.on_lost and idle > self.lost_after and now - self.lost_checked > self.lost_after:
            self.lost_checked = now
            if self.batch.client.lost(self.batch.id):
                self.on_lost()
        if self.stall_s and idle > self.stall_s:
            raise Stalled(
                f"batch {self.batch.id}: no new result for {idle:.0f}s with {st.remaining} jobs "
                f"left (VQUEUE_WAIT_STALL_S={self.stall_s:g}); the jobs stay queued. If a "
                f"worker is idle, submit the input again with --batch {self.batch.id}: only its "
                "unfinished jobs are sent"
            )
        if self.stall_s and idle > self.stall_s / 2 and not self.told_stall:
            self.told_stall = True
            self._say(f"batch {self.batch.id}: no new result for {idle:.0f}s")
        return False

    def _check_workers(self, now: float, remaining: int) -> None:
        live = any(w.get("queue") == self.queue for w in self.store.workers())
        if live:
            if self.alone_since is not None:
                self._say(f"a worker consumes queue {self.queue!r} again")
            self.alone_since, self.told_alone = None, False
            return
        if self.alone_since is None:
            self.alone_since = now
        if not self.told_alone:
            self.told_alone = True
            self._say(
                f"no live worker consumes queue {self.queue!r}: the batch's {remaining} "
                "remaining jobs wait there until one starts"
            )
        alone = now - self.alone_since
        if self.no_worker_s and alone > self.no_worker_s:
            raise Stalled(
                f"batch {self.batch.id}: no live worker has consumed queue {self.queue!r} for "
                f"{alone:.0f}s (VQUEUE_WAIT_NO_WORKER_S={self.no_worker_s:g}); its "
                f"{remaining} remaining jobs stay queued"
            )

    def _say(self, message: str) -> None:
        say = self.batch.client.on_wait
        if say is not None:
            say(message)
        else:
            log.warning("%s", message)


class Batch:
    """A handle on one batch: its counters and its results, as they arrive."""

    def __init__(self, client: Owner, batch_id: str) -> None:
        self.client = client
        self.id = batch_id
        self.last_entry = "0-0"  # the stream entry of the last result read; resume from it
        # submit_many: jobs not sent because their id already had a result in this batch, and
        # because it was queued in it already
        self.skipped = self.queued_before = 0

    def __repr__(self) -> str:
        return f"Batch({self.id!r})"

    def status(self) -> BatchStatus:
        st = self.client.store.status(self.id)
        if st is None:
            raise BatchNotFound(f"no batch {self.id!r} (expired, or another broker/key prefix?)")
        return st

    def results(
        self,
        timeout: float | None = None,
        after: str = "0-0",
        on_lost: Callable[[], None] | None = None,
    ) -> Iterator[JobResult]:
        """Every result of the batch, in completion order, blocking until the last one.

        ``after`` resumes from a stream entry id (``Batch.last_entry``) instead of the start.
        Raises ``WaitTimeout`` past ``timeout``, and ``Stalled`` when no live worker consumes
        the batch's queue, or no result comes, for longer than the settings allow.
        ``on_lost``: called when jobs of the batch were lost on the way (``Client.lost``), to
        send them again (``Client.resend``).
        """
        follow = _Follow(self, timeout, on_lost, counting=after == "0-0")
        store = self.client.store
        while True:
            page = store.read(
                self.id, after, block_ms=None if follow.complete else follow.block_ms(), count=PAGE
            )
            for after, res in page:
                self.last_entry = after
                yield res
            counted = follow.took(len(page))
            if follow.complete:
                if not page:
                    return
                continue
            if counted or (len(page) < PAGE and follow.due()):  # caught up: was that the last?
                follow.check()

    def wait(self, timeout: float | None = None, poll_s: float = 0.5) -> BatchStatus:
        """Block until every job of the batch has a result; returns the final counters."""
        follow = _Follow(self, timeout)
        while not follow.check():
            time.sleep(poll_s)
        return self.status()

    def result(self, job_id: str, timeout: float | None = None) -> JobResult:
        """Wait for one job's result."""
        follow = _Follow(self, timeout)
        after = "-"  # how far the results were read for it (a job known by its line)
        while True:
            res, after = self.client.store.find(self.id, job_id, after)
            if res is not None:
                return res
            if follow.check():  # complete: its result is stored by now, or it is not in the batch
                res, _ = self.client.store.find(self.id, job_id, after)
                if res is None:
                    raise BatchNotFound(f"batch {self.id} is complete and has no job {job_id!r}")
                return res
            self.client.store.read(self.id, "$", block_ms=500)  # wake on the next result
