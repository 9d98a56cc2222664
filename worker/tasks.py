"""Thin Celery tasks: read the envelope, run the job, store the result, return a short summary.

The summary (not the output) is what Flower sees; the full result is in the batch's stream
(``protocol.store``). A job whose result is already stored is not run again,
so a redelivery after a lost acknowledgement costs a lookup, not a generation.

Every job ends with exactly one result. A task acknowledges its job whatever happens (a failing
task is acked), so nothing may escape it without a result: anything unexpected becomes a failed
result of type ``internal_error``. Only two things hand a job back instead: a dead engine (the
worker restarts) and Redis unreachable (nothing could be recorded); both count as a delivery,
so a job that keeps meeting them is dead-lettered after ``max_deliveries``. Redis full
(``maxmemory`` with ``noeviction``) is waited out where the job is (``while_full``): nothing is
lost and the worker stays up. A Redis error that retrying cannot fix (``WRONGTYPE``) fails the
job instead of looping.
"""

from __future__ import annotations

import collections
import logging
import queue
import re
import threading
import time
from typing import Any, NamedTuple, TypeVar

from celery import Task, signals
from celery.exceptions import Reject
from pydantic import ValidationError
from redis.exceptions import (
    BusyLoadingError,
    ReadOnlyError,
    RedisError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from protocol.store import WITHDRAWN
from protocol.wire import task_name
from schemas import JOB_TYPES, Envelope, JobError, JobResult, Timings
from schemas.jobs import BATCH_PATTERN, CHECKED
from schemas.results import ErrorType

from . import metrics
from .app import app, ctx, engine_died, settings, state
from .backoff import while_full, while_full_each
from .errors import EngineDead, JobsFailed

log = logging.getLogger(__name__)
T = TypeVar("T")


def store() -> Any:
    return ctx.store


def _serving_queue(env: Envelope) -> str | None:
    """For a job naming a model this worker does not serve: the own queue of a live worker
    that serves it, where the job belongs (a dead worker's queue is rescued to the shared one
    whole, and a producer's view of the fleet lags it by up to two seconds), or the model's own
    queue to wait in (``Settings.unserved_model``); None: fail it here."""
    queue, _ = next(iter(ctx.router.route([env]).items()))
    return None if queue == settings.queue else str(queue)


# Redis errors that a retry can outlast: the server restarting, loading its AOF, failing over.
TRANSIENT_REDIS = (
    RedisConnectionError,
    RedisTimeoutError,
    BusyLoadingError,
    ReadOnlyError,
    TryAgainError,
)


# how often a pack's thread, waiting for its next job's permit, looks for a permit again
PERMIT_POLL_S = 0.05


class _Prefetch:
    """Celery's prefetch counted in jobs, not messages. A consumer takes messages until its
    unacknowledged ones reach the prefetch count (its concurrency), so packs of k jobs would
    let it hold k times its share: each received pack lowers the count by its jobs past the
    first until it ends (``run_pack``) or is revoked. Kept here, not by kombu's
    ``decrement_eventually``, which stops at 1 and so could not give back exactly what it
    took. The consumer thread applies the value (``qos.update`` in Celery's event loop)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.qos: Any = None
        self.base = 0
        self.extra = 0

    def take(self, qos: Any, jobs: int) -> None:
        with self._lock:
            if self.qos is None:
                self.qos, self.base = qos, int(qos.value)
            self._move(jobs - 1)

    def give_back(self, jobs: int) -> None:
        with self._lock:
            if self.qos is not None:
                self._move(1 - jobs)

    def _move(self, by: int) -> None:
        self.extra += by
        if self.base:  # 0: no prefetch limit to keep
            self.qos.value = max(1, self.base - self.extra)


_prefetch = _Prefetch()


def _pack_size(args: Any) -> int:
    return len(args[0]) if args and isinstance(args[0], list) else 1


@signals.task_received.connect
def _received(sender: Any = None, request: Any = None, **_: Any) -> None:
    n = _pack_size(getattr(request, "args", None))
    if n > 1 and hasattr(sender, "qos"):
        _prefetch.take(sender.qos, n)


class Delivery(NamedTuple):
    """Who took a message: the worker's name and the message's task id, read once from
    Celery's request. Celery keeps its request per thread, and setting one up builds a Celery
    ``Context``; a pack's generations run in threads of their own and carry this instead, at
    no cost a job."""

    worker: str
    task_id: str | None

    @classmethod
    def of(cls, task: Task) -> Delivery:
        return cls(task.request.hostname or state.name, task.request.id)


def run_pack(task: Task, payloads: list[Any]) -> dict[str, Any]:
    """A message's jobs: one, or a pack (``Settings.jobs_per_message``), the only task path.
    One round trip to Redis starts them all and one records each group of results that ends
    together, whatever the pack's size. Each generation runs at once in a thread of its own
    with a permit; a pack of one, in the message's own thread. The message is acknowledged
    once every job has ended; if any job was handed back (a dead engine, Redis gone), the
    whole pack is, once the rest have ended: their results are stored, so its next delivery
    skips them."""
    try:
        summary, ends = _pack(Delivery.of(task), payloads)
    except TRANSIENT_REDIS as exc:  # before any job ran
        raise _handed_back(exc) from None
    finally:  # what its arrival took of the prefetch (``_received``)
        if len(payloads) > 1:
            _prefetch.give_back(len(payloads))
    if failed := [e for e in ends if e["status"] == "failed"]:
        raise JobsFailed.of(failed, len(payloads))
    return ends[0] if len(payloads) == 1 and ends else summary


def _pack(who: Delivery, payloads: list[Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    pack = _Pack(who, len(payloads))
    pack.admit(payloads)
    pack.run()
    if pack.handed_back is not None:
        raise pack.handed_back
    return pack.summary, pack.ends


class _Pack:
    """One message's jobs on their way: admitted (started in Redis, or answered without a
    generation), waiting for a permit, generating, ended, recorded. The message's thread
    drives every stage; a generation's thread only puts what it ended with on ``ended``.
    Metrics are updated here, once for the jobs that start and once for each group that
    ends, not in every generation's thread: each update takes the one lock that
    prometheus_client's multiprocess mode keeps for all of a process's values."""

    def __init__(self, who: Delivery, jobs: int) -> None:
        self.who = who
        self.summary: dict[str, Any] = {"jobs": jobs}
        self.ends: list[dict[str, Any]] = []  # each job's own summary
        self.results: list[tuple[Any, JobResult]] = []  # (payload, result) to record
        self.to_run: list[tuple[dict[str, Any], Envelope, int]] = []
        # raised once every job that runs has ended
        self.handed_back: BaseException | None = None
        # (payload, its result, its summary, or what it raised), in the order they end
        self.ended: queue.SimpleQueue[tuple[dict[str, Any], Any]] = queue.SimpleQueue()

    def count(self, end: dict[str, Any]) -> None:
        self.ends.append(end)
        self.summary[end["status"]] = self.summary.get(end["status"], 0) + 1

    def hand_back(self, exc: Exception) -> None:
        if self.handed_back is None:
            self.handed_back = _handed_back(exc)

    def admit(self, payloads: list[Any]) -> None:
        """Start every job that reads as one in one round trip; those that need no generation
        (stored already, withdrawn, elsewhere) end here, the rest wait to run."""
        envs = [(p, _parsed(self.who, p)) for p in payloads]
        ready = [(p, e) for p, e in envs if isinstance(e, Envelope)]
        # first, the messages that do not read as a job
        self.results = [(p, e) for p, e in envs if isinstance(e, JobResult)]
        if ready and state.dying:
            _hand_back_dying()
        started = while_full_each(
            "start", store().start_many, [(e.batch, e.job.id, e.line) for _, e in ready]
        )
        for (payload, env), start in zip(ready, started, strict=True):
            try:
                if isinstance(start, RedisError):  # this job's own answer, not the pack's
                    raise start
                step = _admitted(self.who, payload, env, start)
            except TRANSIENT_REDIS as exc:
                self.hand_back(exc)
                continue
            except RedisError as exc:  # retrying cannot fix it
                self.count(_unrecordable(self.who, payload, exc))
                continue
            if isinstance(step, dict):
                self.count(step)
            elif step is not None:
                self.results.append((payload, step))
            else:
                self.to_run.append((payload, env, start[1]))

    def record(self) -> None:
        """Store every result that has ended since the last call, in one round trip."""
        if not self.results:
            return
        observed: list[JobResult] = []
        try:
            recorded = while_full_each("record", store().record_many, [r for _, r in self.results])
        except TRANSIENT_REDIS as exc:
            self.hand_back(exc)
        else:
            for (payload, result), answer in zip(self.results, recorded, strict=True):
                if isinstance(answer, TRANSIENT_REDIS):
                    self.hand_back(answer)
                else:
                    self.count(_summary(self.who, payload, result, answer, observed))
        metrics.observe_many(observed)
        self.results = []

    def generate(self, payload: dict[str, Any], env: Envelope, attempts: int) -> None:
        outcome: Any
        try:
            outcome = _generated(self.who, payload, env, attempts)
        except BaseException as exc:  # Reject, or worse: raised once the rest have ended
            outcome = exc
        finally:
            ctx.permits.release()
        self.ended.put((payload, outcome))

    def run(self) -> None:
        """Each job starts once it has a permit (``permits``: the process's jobs at once,
        whatever their messages); while some of the pack wait for one, this thread records
        what has ended meanwhile, so that a job that ended is never held back by one still
        to start (a worker killed then would run it again)."""
        waiting = collections.deque(self.to_run)
        running = 0  # started, not ended
        held = len(self.to_run)  # started or waiting: the in-flight gauge's share
        metrics.IN_FLIGHT.inc(held)
        try:
            while True:
                self.record()
                # a permit is waited for only while none of this pack runs
                while waiting and ctx.permits.acquire(blocking=not running):
                    job = waiting.popleft()
                    running += 1
                    if len(self.to_run) == 1:  # a pack of one (urgent, a short batch): here
                        self.generate(*job)
                    else:
                        ctx.pack_pool.submit(self.generate, *job)
                if not running:
                    break
                done = self._ended(PERMIT_POLL_S if waiting else None)
                running -= len(done)
                held -= len(done)
                metrics.IN_FLIGHT.dec(len(done))
                for payload, outcome in done:
                    if isinstance(outcome, BaseException):
                        self.handed_back = self.handed_back or outcome
                    elif isinstance(outcome, dict):
                        self.count(outcome)
                    else:
                        self.results.append((payload, outcome))
        finally:  # what is still running or waiting if the loop ended early
            metrics.IN_FLIGHT.dec(held)

    def _ended(self, timeout: float | None) -> list[tuple[dict[str, Any], Any]]:
        """At least one that has ended (none if ``timeout`` passes first), then whatever
        else has ended meanwhile."""
        try:
            done = [self.ended.get(timeout=timeout)]
        except queue.Empty:
            return []
        while not self.ended.empty():
            done.append(self.ended.get())
        return done


def _handed_back(exc: Exception) -> Reject:
    """Redis stayed away past the client's retries. Acknowledging would drop the job (a
    failing task is acked): it goes back instead. Its result, if it was stored after all,
    makes the redelivery a lookup, and each delivery counts toward ``max_deliveries``, so this
    cannot loop forever."""
    log.error("job not recorded (%s: %s); back to the queue", type(exc).__name__, exc)
    return Reject(f"{type(exc).__name__}: {exc}", requeue=True)


def _parsed(who: Delivery, payload: Any) -> Envelope | JobResult:
    """The job's envelope, or the failed result of a message that does not read as one:
    producers validate first, so that is a hand-made message, failed, never a crash."""
    try:
        return Envelope.model_validate(payload, context=CHECKED)
    except ValidationError as exc:
        return _failed(who, payload, "invalid_job", str(exc).splitlines()[0])


def _hand_back_dying() -> None:
    """The engine is gone and the process about to exit: the job goes back, uncounted."""
    time.sleep(0.5)  # its consumer stops within a second: no cycling the queue till then
    raise Reject("the engine died; the job goes back to the queue", requeue=True)


def _admitted(
    who: Delivery, payload: dict[str, Any], env: Envelope, started: tuple[bool, int, str | None]
) -> dict[str, Any] | JobResult | None:
    """What a delivery comes to once started (``BatchStore.start``): a summary when nothing
    is left to do (a duplicate, a job sent on to its model's worker, a dead letter), a result
    to record without the engine (its batch withdrawn), or None: generate it."""
    done, attempts, withdrawn = started
    if done:
        metrics.duplicate(env.job.type)
        return {"id": env.job.id, "status": "duplicate"}
    if withdrawn in WITHDRAWN:  # the batch was cancelled, or ran out of time
        message = WITHDRAWN[withdrawn]
        result = _failed(who, payload, withdrawn, message, env)  # type: ignore[arg-type]
        result.deliveries = attempts
        return result
    if attempts > settings.max_deliveries:
        return _dead_letter(env, payload, attempts, who.worker)
    if (
        env.model is not None
        and state.engine is not None
        and env.model not in state.engine.model_names
        and (home := _serving_queue(env)) is not None
    ):  # sent on before this delivery is acknowledged: at worst it arrives twice, and
        # the second finds the first's result (``start``'s done)
        from protocol.wire import send_envelopes

        while_full("forward", lambda: send_envelopes(ctx.broker, [env], home))
        return {"id": env.job.id, "status": "forwarded", "to": home}
    return None


def _summary(
    who: Delivery,
    payload: Any,
    result: JobResult,
    recorded: bool | RedisError,
    observed: list[JobResult] | None = None,
) -> dict[str, Any]:
    """What Flower shows of a job whose result went to Redis: ``recorded`` False means an
    earlier delivery's result was there first; an error, that Redis refused it for good. A
    recorded result goes to its metrics, or to ``observed`` for a pack's thread to count
    together (``metrics.observe_many``)."""
    if isinstance(recorded, RedisError):
        return _unrecordable(who, payload, recorded)
    if recorded and observed is not None:
        observed.append(result)
    elif recorded:
        metrics.observe(result)
    else:
        metrics.duplicate(result.type)
    summary = {"id": result.id, "status": result.status, "tokens": result.usage.completion_tokens}
    if result.error:
        summary["error"] = result.error.type
    return summary


def _generated(
    who: Delivery, payload: dict[str, Any], env: Envelope, attempts: int
) -> JobResult | dict[str, Any]:
    """The job's result from the engine, its delivery count set, whatever happens on the way
    but two things: a dead engine or Redis gone hands it back (``Reject``). A summary instead
    when Redis refused for good what the job needed of it (``_unrecordable``)."""
    from .runner import run_job

    try:
        if state.engine is None:  # its start failed: the process is on its way out
            raise EngineDead("this process has no engine")
        result = run_job(env, state.engine, settings, who.worker, ctx.templates, ctx.result_cache)
    except EngineDead:
        engine_died()
        raise Reject("the engine died; the job goes back to the queue", requeue=True) from None
    except TRANSIENT_REDIS as exc:
        raise _handed_back(exc) from None
    except RedisError as exc:
        return _unrecordable(who, payload, exc)
    except Exception as exc:  # a bug of ours, or a library's surprise: this job fails alone
        log.exception("job %s of batch %s failed unexpectedly", env.job.id, env.batch)
        result = _failed(who, payload, "internal_error", f"{type(exc).__name__}: {exc}", env)
    result.deliveries = attempts
    return result


def _failed(
    who: Delivery,
    payload: Any,
    error: ErrorType,
    message: str,
    env: Envelope | None = None,
) -> JobResult:
    """A failed result for a job, from its envelope, or as much of the raw message as reads."""
    kind: str
    if env is not None:
        ident, batch, kind = env.job.id, env.batch, env.job.type
    else:
        job = payload.get("job") if isinstance(payload, dict) else None
        job = job if isinstance(job, dict) else {}
        batch_id = payload.get("batch") if isinstance(payload, dict) else None
        ident = str(job.get("id", who.task_id))
        batch, kind = str(batch_id or ""), str(job.get("type", "unknown"))
        if not re.fullmatch(BATCH_PATTERN, batch):  # a key of another batch's, perhaps
            batch = "invalid-messages"
    return JobResult(
        id=ident,
        batch=batch,
        type=kind,
        status="failed",
        timings=Timings(enqueued_at=env.enqueued_at if env else 0.0, finished_at=time.time()),
        worker=who.worker,
        metadata=env.job.metadata if env else {},
        format=env.format if env else "vqueue",
        line=env.line if env else None,
        prefix_key=env.prefix_key if env else None,
        error=JobError(type=error, message=message[:2000]),
    )


def _unrecordable(who: Delivery, payload: Any, exc: RedisError) -> dict[str, Any]:
    """Redis refused an operation for good (a key of the wrong type, out of memory): record a
    failed result if Redis still takes one, else park the job as a dead letter, else say so
    loudly. The job is acknowledged: requeueing it would meet the same error forever."""
    message = f"Redis refused to record this job: {type(exc).__name__}: {exc}"
    try:
        env: Envelope | None = Envelope.model_validate(payload, context=CHECKED)
    except ValidationError:
        env = None
    result = _failed(who, payload, "internal_error", message, env)
    try:
        if store().record(result):
            metrics.observe(result)
        log.error("job %s of batch %s failed: %s", result.id, result.batch, message)
    except RedisError as again:
        try:
            store().dead_letter(payload, result, 1, record=False)
            log.error("job %s of batch %s: no result could be recorded (%s); parked as a dead "
                      "letter", result.id, result.batch, again)  # fmt: skip
        except RedisError:
            log.critical(
                "job %s of batch %s cannot be recorded at all (%s; then %s); it is dropped",
                result.id, result.batch, exc, again,
            )  # fmt: skip
    return {"id": result.id, "status": "failed", "error": "internal_error"}


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
        deliveries=attempts,
        line=env.line,
        metadata=env.job.metadata,
        format=env.format,
        prefix_key=env.prefix_key,
        error=JobError(
            type="dead_letter",
            message=f"started {delivered} times and never finished (its worker was lost, or "
            f"Redis failed, each time; VQUEUE_MAX_DELIVERIES={settings.max_deliveries}); see "
            "'vqueue dlq show'",
        ),
    )
    while_full("record", lambda: store().dead_letter(payload, result, delivered))
    metrics.observe(result)
    return {"id": result.id, "status": "failed", "error": "dead_letter"}


def _line(payload: Any) -> int | None:
    """The input line a raw message's job came from (``Envelope.line``), when it says one."""
    line = payload.get("line") if isinstance(payload, dict) else None
    return line if isinstance(line, int) and not isinstance(line, bool) and line >= 1 else None


@signals.task_revoked.connect
def _revoked(sender: Any = None, request: Any = None, **_: Any) -> None:
    """A job revoked before it ran (Flower, ``celery control revoke``) still ends with a
    result, ``cancelled``, so its batch completes; a revoked pack, each of its jobs. Task ids
    are ``batch:job`` (a pack's: its first job's, ``+N`` more) and batch ids hold no ``:``
    (``schemas.jobs.BATCH_PATTERN``), so the id says which job it was; a pack's argument
    names the rest."""
    if not getattr(sender, "name", "").startswith("vqueue."):
        return
    task_id = str(getattr(request, "id", "") or "")
    batch, sep, job_id = task_id.partition(":")
    if not sep or not re.fullmatch(BATCH_PATTERN, batch):
        return
    args = getattr(request, "args", None) or [None]
    jobs = [(batch, job_id, _line(args[0]))]
    if isinstance(args[0], list):
        if len(args[0]) > 1:  # it never runs: what its arrival took of the prefetch comes back
            _prefetch.give_back(len(args[0]))
        packed = [p for p in args[0] if isinstance(p, dict) and isinstance(p.get("job"), dict)]
        jobs = [(str(p.get("batch", "")), str(p["job"].get("id", "")), _line(p)) for p in packed]
    for batch, job_id, line in jobs:
        if not job_id or not re.fullmatch(BATCH_PATTERN, batch):
            continue
        result = JobResult(
            id=job_id,
            batch=batch,
            type=sender.name.removeprefix("vqueue."),
            status="failed",
            timings=Timings(enqueued_at=0.0, finished_at=time.time()),
            worker=state.name,
            line=line,
            error=JobError(type="cancelled", message="revoked before it ran"),
        )
        try:
            if store().record(result):
                metrics.observe(result)
        except RedisError as exc:
            log.error("revoked job %s of batch %s: no result recorded (%s)", job_id, batch, exc)


def _register(job_type: str) -> None:
    # ignore_result: the result lives in the batch stream; a second copy in Celery's backend
    # would cost a MULTI/SET/PUBLISH per job. Flower still sees the summary in task events.
    @app.task(name=task_name(job_type), bind=True, ignore_result=True, throws=(JobsFailed,))
    def _task(self: Task, payload: dict[str, Any] | list[Any]) -> dict[str, Any]:
        # a message of one job carries it alone (its Flower args read as one job): a pack of one
        return run_pack(self, payload if isinstance(payload, list) else [payload])


for _t in JOB_TYPES:
    _register(_t)
