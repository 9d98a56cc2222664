"""The worker's exceptions, under one root (``WorkerError``), flat.

Two kinds reach a job's result: ``JobFailed`` (the job cannot run, or its answer is unusable:
its ``type`` is the result's ``JobError.type``), and what the engine says of one request
(``JobTimeout``, ``JobWithdrawn``, ``EngineError``). ``EngineDead`` ends the worker, not a job;
``JobsFailed`` is how a finished message with failed jobs shows in Celery's events.
"""

from __future__ import annotations

from typing import Any

from schemas.results import ErrorType


class WorkerError(Exception):
    """Anything the worker raises on purpose."""


class JobFailed(WorkerError):
    """The job fails with ``type`` and ``message`` (its ``JobError``), before or after the engine
    ran it: a schema that does not compile, no room for an answer, an answer that does not
    parse or fit its schema, tests that no answer passed."""

    def __init__(self, type_: ErrorType, message: str) -> None:
        super().__init__(message)
        self.type, self.message = type_, message


class JobTimeout(WorkerError):
    """The request was still running after ``job_timeout_s``; it was aborted in the engine."""


class JobWithdrawn(WorkerError):
    """The job's batch was cancelled, or its completion window ended, while it generated; the
    request was aborted in the engine. ``reason``: ``cancelled`` or ``expired``."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"aborted in the engine: its batch was {reason} while it generated")
        self.reason = reason


class EngineError(WorkerError):
    """The engine refused or failed one request; the job fails, the worker carries on."""


class EngineDead(WorkerError):
    """The engine core is gone: no job can run here any more; the worker must restart."""


class JobsFailed(WorkerError):
    """A message that ended with a failed job: every job has its result and the message is
    acknowledged (``task_acks_on_failure_or_timeout``), but Celery's events, and so Flower,
    show it as FAILURE with each failed job's id and reason, not as a green SUCCESS. The
    tasks declare it (``throws``): Celery logs it as an expected error, one line, no trace."""

    SHOWN = 5  # failed jobs named in the message; the rest are counted

    @classmethod
    def of(cls, failed: list[dict[str, Any]], jobs: int) -> JobsFailed:
        # one plain message argument: Celery pickles the exception for its events
        named = ", ".join(f"{e['id']} ({e.get('error', 'failed')})" for e in failed[: cls.SHOWN])
        more = f" and {len(failed) - cls.SHOWN} more" if len(failed) > cls.SHOWN else ""
        of = f" of {jobs}" if jobs > 1 else ""
        return cls(f"{len(failed)}{of} job(s) failed: {named}{more}")
