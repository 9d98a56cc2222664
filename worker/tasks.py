"""Thin Celery tasks: read the envelope, run the job, store the result, return a short summary.

The summary (not the output) is what Flower sees; the full result is in the batch's stream
(``producer.store``). A job whose result is already stored is not run again,
so a redelivery after a lost acknowledgement costs a lookup, not a generation.
"""

from __future__ import annotations

from typing import Any

from celery import Task
from pydantic import ValidationError

from producer.publish import task_name
from schemas import JOB_TYPES, Envelope, JobError, JobResult, Timings

from . import metrics
from .app import app, settings, state

_store: Any = None


def store() -> Any:
    global _store
    if _store is None:
        from producer.store import BatchStore

        _store = BatchStore.from_url(
            settings.backend_url(), settings.key_prefix, settings.result_ttl_s
        )
    return _store


def run(task: Task, payload: dict[str, Any]) -> dict[str, Any]:
    with metrics.IN_FLIGHT.track_inprogress():
        return _run(task, payload)


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
        if store().has_result(env.batch, env.job.id):
            metrics.duplicate(env.job.type)
            return {"id": env.job.id, "status": "duplicate"}
        result = run_job(env, state.engine, settings, task.request.hostname or state.name)
    if store().record(result):
        metrics.observe(result)
    else:
        metrics.duplicate(result.type)
    summary = {"id": result.id, "status": result.status, "tokens": result.usage.completion_tokens}
    if result.error:
        summary["error"] = result.error.type
    return summary


def _register(job_type: str) -> None:
    # ignore_result: the result lives in the batch stream; a second copy in Celery's backend
    # would cost a MULTI/SET/PUBLISH per job. Flower still sees the summary in task events.
    @app.task(name=task_name(job_type), bind=True, ignore_result=True)
    def _task(self: Task, payload: dict[str, Any]) -> dict[str, Any]:
        return run(self, payload)


for _t in JOB_TYPES:
    _register(_t)
