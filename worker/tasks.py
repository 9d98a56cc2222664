"""Thin Celery tasks: read the envelope, run the job, store the result, return a short summary.

The summary (not the output) is what Flower sees; the full result is in the batch's stream
(``producer.store``). A job whose result is already stored is not run again,
so a redelivery after a lost acknowledgement costs a lookup, not a generation.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from celery import Task
from celery.exceptions import Reject
from pydantic import ValidationError
from redis.exceptions import RedisError

from producer.publish import task_name
from schemas import JOB_TYPES, Envelope, JobError, JobResult, Timings

from . import metrics
from .app import EXIT_ENGINE, app, settings, state
from .engine import EngineDead

log = logging.getLogger(__name__)
_store: Any = None
_lock = threading.Lock()
_dying = False


def store() -> Any:
    global _store
    if _store is None:
        from producer.store import BatchStore

        _store = BatchStore.from_settings(settings)
    return _store


_templates: Any = None


def templates() -> Any:
    global _templates
    if _templates is None:
        from .structured import Templates

        _templates = Templates(lambda name: store().template(name))
    return _templates


def run(task: Task, payload: dict[str, Any]) -> dict[str, Any]:
    with metrics.IN_FLIGHT.track_inprogress():
        try:
            return _run(task, payload)
        except RedisError as exc:
            # Redis stayed away past the client's retries. Acknowledging would drop the job
            # (a failing task is acked): hand it back instead; its result, if it was stored
            # after all, makes the redelivery a lookup.
            log.error("job not recorded (%s: %s); back to the queue", type(exc).__name__, exc)
            raise Reject(f"{type(exc).__name__}: {exc}", requeue=True) from None


def _run(task: Task, payload: dict[str, Any]) -> dict[str, Any]:
    from .runner import run_job

    try:
        env = Envelope.model_validate(payload)
    except ValidationError as exc:
        # Producers validate first, so this is a hand-made message: fail it, never crash.
        job = payload.get("job") if isinstance(payload, dict) else None
        result = JobResult(
            id=str((job or {}).get("id", task.request.id)),
            batch=str(payload.get("batch", "unknown")) if isinstance(payload, dict) else "unknown",
            type=str((job or {}).get("type", "unknown")),
            status="failed",
            timings=Timings(enqueued_at=0.0),
            worker=task.request.hostname,
            error=JobError(type="invalid_job", message=str(exc).splitlines()[0]),
        )
    else:
        if _dying:  # the engine is gone and the process about to exit: hand back, uncounted
            time.sleep(0.5)
            raise Reject("the engine died; the job goes back to the queue", requeue=True)
        done, attempts = store().start(env.batch, env.job.id)
        if done:
            metrics.duplicate(env.job.type)
            return {"id": env.job.id, "status": "duplicate"}
        worker = task.request.hostname or state.name
        if attempts > settings.max_deliveries:
            return _dead_letter(env, payload, attempts, worker)
        try:
            result = run_job(env, state.engine, settings, worker, templates())
        except EngineDead:
            _engine_died()
            raise Reject("the engine died; the job goes back to the queue", requeue=True) from None
    if store().record(result):
        metrics.observe(result)
    else:
        metrics.duplicate(result.type)
    summary = {"id": result.id, "status": result.status, "tokens": result.usage.completion_tokens}
    if result.error:
        summary["error"] = result.error.type
    return summary


def _engine_died() -> None:
    """Exit non-zero so the supervisor restarts the worker; other tasks get 2 s to hand their
    jobs back (the rest return to the queue after the visibility timeout)."""
    global _dying
    with _lock:
        if not _dying:
            _dying = True
            log.critical("the vLLM engine died; exiting %d for a restart", EXIT_ENGINE)
            threading.Timer(2.0, os._exit, args=(EXIT_ENGINE,)).start()


def _dead_letter(
    env: Envelope, payload: dict[str, Any], attempts: int, worker: str
) -> dict[str, Any]:
    """A job that was running each time its worker died: park it instead of killing another.
    Its failed result lets the batch finish; ``vqueue dlq requeue`` runs it again."""
    delivered = attempts - 1
    result = JobResult(
        id=env.job.id,
        batch=env.batch,
        type=env.job.type,
        status="failed",
        timings=Timings(enqueued_at=env.enqueued_at),
        worker=worker,
        metadata=env.job.metadata,
        format=env.format,
        prefix_key=env.prefix_key,
        error=JobError(
            type="dead_letter",
            message=f"started {delivered} times and never finished (its worker was lost each "
            f"time; VQUEUE_MAX_DELIVERIES={settings.max_deliveries}); see 'vqueue dlq show'",
        ),
    )
    store().dead_letter(payload, result, delivered)
    metrics.observe(result)
    return {"id": result.id, "status": "failed", "error": "dead_letter"}


def _register(job_type: str) -> None:
    # ignore_result: the result lives in the batch stream; a second copy in Celery's backend
    # would cost a MULTI/SET/PUBLISH per job. Flower still sees the summary in task events.
    @app.task(name=task_name(job_type), bind=True, ignore_result=True)
    def _task(self: Task, payload: dict[str, Any]) -> dict[str, Any]:
        return run(self, payload)


for _t in JOB_TYPES:
    _register(_t)
