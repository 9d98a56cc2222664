"""The producer's errors, under one root (``VQueueError``), flat; ``producer`` exports them."""

from __future__ import annotations


class VQueueError(Exception):
    """Root of the producer's errors."""


class BatchNotFound(VQueueError):
    pass


class WaitTimeout(VQueueError):
    """The caller's own ``timeout`` passed."""


class Stalled(VQueueError):
    """Waiting stopped making sense: no live worker consumes the batch's queue, or the batch
    has had no new result for too long (``VQUEUE_WAIT_NO_WORKER_S``, ``VQUEUE_WAIT_STALL_S``).
    The batch itself is untouched: its jobs stay queued, and waiting again resumes."""


class Refused(VQueueError):
    """Submission refused at a limit (tenant rate, queue depth) under ``on_limit="refuse"``."""


class SubmissionStopped(VQueueError):
    """Redis refused a chunk (full: ``maxmemory``; or gone past the retries). The chunks
    before it are enqueued and run; the batch is sealed with the reason (``BatchStatus.error``)
    where Redis still takes that, so it ends once they have. Submitting the same input again
    with the same batch id sends only what is not enqueued yet."""

    def __init__(self, batch: str, sent: int, reason: str) -> None:
        super().__init__(f"batch {batch}: {reason}")
        self.batch, self.sent, self.reason = batch, sent, reason


class Gone(VQueueError):
    """The batch left Redis while it was fed (deleted, FLUSHALL): the feeder set the client's
    ``stop`` event, and a feed waiting for room stops instead of waiting on."""
