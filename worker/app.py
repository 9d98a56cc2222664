"""The Celery app, its configuration, and the worker lifecycle that owns the engine.

Importing this module is cheap (no vLLM, no torch). The engine is built by the ``worker_init``
signal, before the worker consumes anything, and closed by ``worker_shutdown``: the shape of
arq's ``on_startup``/``on_shutdown``.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import TYPE_CHECKING, Any

from celery import Celery, signals

from protocol.exits import RET_CONFIG, RET_ENGINE
from protocol.routing import (
    embed_queue,
    model_queue,
    move_all,
    rescue_orphans,
    urgent_queue,
    worker_queue,
)
from protocol.wire import PRIORITY_SEP, PRIORITY_STEPS, task_name
from schemas import JOB_TYPES, Settings, get_settings

from .context import Context
from .kombu_patches import guard_closed_channels, reuse_broker_clients

if TYPE_CHECKING:
    from .engine import Engine

log = logging.getLogger(__name__)

# Named exit codes (dramatiq's habit), from the CLI's one table: a supervisor can tell a broken
# engine or configuration from a clean stop.
EXIT_ENGINE = RET_ENGINE


def create_app(settings: Settings | None = None) -> Celery:
    s = settings or get_settings()
    app = Celery("vqueue", broker=s.broker_url, backend=s.backend_url())
    app.conf.update(
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        result_accept_content=["json"],
        # Acknowledge after the result is stored: a worker lost mid-job means redelivery.
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        task_acks_on_failure_or_timeout=True,
        # Prefetch equals the threads pool size: every held job is in the engine at once.
        worker_prefetch_multiplier=1,
        task_default_queue=s.queue,
        task_routes={task_name(t): {"queue": s.queue} for t in JOB_TYPES},
        broker_transport_options={
            "visibility_timeout": s.visibility_timeout_s,
            # look for a dead worker's jobs (unacked past the visibility timeout) every 10 s,
            # not kombu's default of every 10th 10 s tick: one ZRANGE each time
            "unacked_restore_throttle": 1,
            "priority_steps": PRIORITY_STEPS,
            "sep": PRIORITY_SEP,
            "queue_order_strategy": "priority",
        },
        broker_connection_retry_on_startup=True,
        result_expires=s.result_ttl_s,
        # Flower's view: per-type task names, and task events once Flower turns them on (it
        # broadcasts enable_events every 5 s) or from the start with VQUEUE_TASK_EVENTS.
        worker_send_task_events=s.task_events,
        task_send_sent_event=True,
        task_track_started=True,
        worker_hijack_root_logger=False,
    )
    return app


HAND_BACK_S = 5.0  # how long a stopping process has to hand its jobs back before it exits anyway


def exit_after_handing_back(code: int) -> None:
    """End this process with ``code`` through Celery's warm shutdown, which stops the consumer
    first: the jobs the process then hands back (running tasks reject theirs, closing the
    channel restores the prefetched ones) are not taken by it again, and it never exits in the
    middle of taking one. kombu's BRPOP removes a job from its list before the next command
    records it as unacknowledged; a process that ends between the two loses that job, and one
    that keeps consuming while it hands jobs back keeps opening that gap until it exits.
    ``os._exit`` follows after ``HAND_BACK_S`` in case the shutdown hangs: Celery's loop reads
    the flag on each turn, at least once a second, so by then nothing is being taken."""
    from celery.worker import state as worker_state

    worker_state.should_stop = code
    timer = threading.Timer(HAND_BACK_S, os._exit, args=(code,))
    timer.daemon = True  # a shutdown that ends in time exits at once
    timer.start()


settings = get_settings()
if settings.urgent_owner:  # the urgent process ends with the worker that started it, watched
    # from import on: that worker can die while this process is still starting
    from .vllm_ext.plugin import watch_owner

    watch_owner(settings.urgent_owner, on_gone=lambda: exit_after_handing_back(70))
app = create_app(settings)
guard_closed_channels()
reuse_broker_clients()
app.conf.imports = ("worker.tasks",)


def urgent_name(hostname: str) -> str:
    """``vqueue-gpu0@host`` -> ``vqueue-gpu0-urgent@host``: the worker's urgent process."""
    return lane_name(hostname, "urgent")


def lane_name(hostname: str, lane: str) -> str:
    """``vqueue-gpu0@host`` -> ``vqueue-gpu0-<lane>@host``: one of the worker's lanes
    (``urgent``, ``bulk1``, ...)."""
    name, at, host = hostname.partition("@")
    return f"{name}-{lane}{at}{host}"


class Lane:
    """A Celery process of the worker's own, a client of the worker's engine core: its
    consumer, task threads, tokenizer and vLLM front end, under a GIL of its own.

    - The urgent lane consumes ``<queue>.urgent`` alone, with ``Settings.urgent_concurrency``
      slots. A Celery consumer whose slots are all taken asks Redis for nothing, whatever
      waits there; with bulk jobs filling the worker's share, this one still takes an urgent
      job at once, and vLLM's priority scheduling runs it ahead of the bulk jobs waiting in
      the engine.
    - A bulk lane (``Settings.bulk_processes`` > 1) consumes what the worker does (the shared
      queue, the worker's own and its models' queues) with its share of the concurrency.

    A lane is started before the engine so that its imports overlap vLLM's load, and joins the
    core when it is up. It exits when the worker dies (``watch_owner``), and the worker stops it
    when it stops. One that dies is not started again: vLLM's engine core takes its clients at
    its own start only; its jobs return after the visibility timeout, and the worker (which
    consumes the urgent queue too) goes on taking them until it restarts."""

    def __init__(self, worker: Any, address: Any, lane: str, slots: int, tag: str = "") -> None:
        self.name = lane_name(worker.hostname, tag or lane)
        self.lane = lane
        self.stopping = threading.Event()
        queue = urgent_queue(settings.queue) if lane == "urgent" else settings.queue
        argv = [
            sys.executable, "-m", "celery", "-A", "worker.app", "worker",
            "--pool", "threads", "--concurrency", str(slots),
            "--queues", queue,
            "--hostname", self.name, "--loglevel", logging.getLevelName(worker.loglevel),
            *(["--task-events"] if settings.task_events else []),
            "--without-mingle", "--without-gossip",
        ]  # fmt: skip
        env = dict(
            os.environ,
            VQUEUE_ENGINE_CLIENT=address.spell(),
            VQUEUE_URGENT_OF=worker.hostname,
            VQUEUE_URGENT_OWNER=str(os.getpid()),
            VQUEUE_LANE=lane,
            VQUEUE_CONCURRENCY=str(slots),
            VQUEUE_METRICS_PORT="0",  # the worker serves the metrics of all its processes
        )
        if lane == "urgent":
            env["VQUEUE_JOBS_PER_MESSAGE"] = "1"
        self.proc = subprocess.Popen(argv, env=env)  # its log is this one's
        log.info("%s process %s started (pid %d)", lane, self.name, self.proc.pid)
        threading.Thread(target=self._watch, name=f"vqueue-{lane}-watch", daemon=True).start()

    def _watch(self) -> None:
        code = self.proc.wait()
        if self.stopping.is_set() or state.dying:
            return
        from . import metrics

        metrics.process_gone(self.proc.pid)
        alone = "urgent jobs are" if self.lane == "urgent" else "its queues' jobs are"
        log.error(
            "%s process %s exited (code %s); its jobs return after the visibility timeout, "
            "and %s taken by this process alone, within its share, until the worker restarts",
            self.lane, self.name, code, alone,
        )  # fmt: skip

    def stop(self) -> None:
        """Ask it to stop (Celery's warm shutdown: it finishes the jobs it holds)."""
        if self.stopping.is_set():
            return
        self.stopping.set()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout_s: float) -> None:
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.error("%s process %d did not stop in time; killing it", self.lane, self.proc.pid)
            self.proc.kill()


class _WorkerState:
    """Process-wide: the engine and the heartbeat that advertises it."""

    engine: Engine | None = None
    name: str = ""
    metrics_url: str | None = None
    lanes: list[Lane] = []  # noqa: RUF012  # the worker's (one process-wide instance)
    stop = threading.Event()
    dying = False  # the engine is gone: jobs taken from here on go straight back
    slots = 0  # this process's Celery pool size, once its consumer is ready


state = _WorkerState()
ctx = Context(settings, state)  # what tasks and hooks share, built as they need it
_dying_lock = threading.Lock()


def engine_died() -> None:
    """Exit non-zero so the supervisor restarts the worker, once every job this process holds
    is handed back (those it cannot hand back return after the visibility timeout). Called by
    the task that met the dead engine, or by the engine's own watch when it dies with no job
    running here: an idle worker must not sit on a dead engine until its next job."""
    with _dying_lock:
        if state.dying:
            return
        state.dying = True
    log.critical("the vLLM engine died; exiting %d for a restart", EXIT_ENGINE)
    exit_after_handing_back(EXIT_ENGINE)


def remove_stale_files(directories: tuple[str, ...] = ("/dev/shm", tempfile.gettempdir())) -> int:
    """Remove what processes that are gone left behind: engine-core sockets and confidence boards
    are named ``vqueue-<kind>-<pid>-...`` after the process that made them, and one killed
    (``kill -9``, the OOM killer) never removes its own. Returns how many were removed."""
    removed = 0
    for directory in directories:
        for path in glob.glob(os.path.join(directory, "vqueue-*-*-*")):
            match = re.fullmatch(r"vqueue-(?:core|confidence)-(\d+)-.*", os.path.basename(path))
            if match is None:
                continue
            try:
                os.kill(int(match.group(1)), 0)
                continue  # its process lives
            except ProcessLookupError:
                pass
            except PermissionError:
                continue  # someone else's, and alive
            with contextlib.suppress(OSError):
                os.unlink(path)
                removed += 1
    return removed


@signals.worker_init.connect
def _build_engine(sender: Any = None, **_: Any) -> None:
    import importlib

    from . import metrics
    from .engine import ConfigError

    if not settings.urgent_of and (n := remove_stale_files()):
        log.info("removed %d socket(s) and board(s) left by processes that are gone", n)

    state.metrics_url = metrics.serve(settings.metrics_port, settings.metrics_host)
    # One interpreter holds Celery's consumer, the task threads, the tokenizer and vLLM's loop,
    # and each Redis reply waits for the GIL. Python hands the GIL to a waiting thread only
    # every switch interval (5 ms by default), so while another thread computes, every round
    # trip costs up to that: a convoy. A shorter interval keeps the consumer moving
    # (benchmarks/investigations/gil_switch.py).
    sys.setswitchinterval(settings.gil_switch_ms / 1000)
    warn_if_redis_may_evict(_store().r, "the result store")
    if settings.broker_url != settings.backend_url():
        warn_if_redis_may_evict(_broker(), "the broker")
    try:
        module, _sep, name = settings.engine_class.partition(":")
        engine_class = getattr(importlib.import_module(module), name)
        state.engine = _engine(engine_class, sender)
        if state.engine.plan is not None and not settings.urgent_of:
            metrics.report_plan(state.engine.plan)
        state.engine.on_death(engine_died)
        from .runner import warm_grammar_check

        warm_grammar_check(state.engine, settings)
        if not settings.urgent_of:
            threading.Thread(target=_say_sandbox, name="vqueue-sandbox", daemon=True).start()
    except (ConfigError, FileNotFoundError) as exc:  # the operator's to fix: a line, no trace
        log.error("invalid worker settings: %s; exiting %d", exc, RET_CONFIG)
        os._exit(RET_CONFIG)
    except BaseException:
        log.exception("the vLLM engine failed to start; exiting %d", EXIT_ENGINE)
        os._exit(EXIT_ENGINE)  # Celery would log a handler's exception and carry on without it


def _say_sandbox() -> None:
    """At start, whether codegen jobs' tests can run here: a fresh host without bubblewrap
    fails each such job ``sandbox_unavailable``, and an operator should read why once."""
    from .sandbox import sandbox_problem

    if (problem := sandbox_problem()) is not None:
        log.warning(
            "codegen jobs with tests will fail sandbox_unavailable: %s; this worker looks again "
            "at each such job, every %.0f s at most, and needs no restart", problem,
            sandbox_problem.recheck_s,
        )  # fmt: skip


def _engine(engine_class: Any, worker: Any) -> Any:
    """The worker's engine: a lane joins the worker's engine core; the worker launches it for
    itself and its lanes (started now, to import while vLLM loads), where this vLLM lets
    clients share one core (``compat.shared_core_missing``); an engine stub
    (``Settings.engine_class``, queue tests) gets none of that."""
    from .vllm_ext.client import CoreAddress

    if settings.engine_client:
        return engine_class(settings, join=CoreAddress.parse(settings.engine_client))
    bulk = settings.bulk_processes or 1
    urgent = settings.urgent_concurrency and _runner() == "generate"  # an embedding: no lane
    lanes = ["bulk"] * (bulk - 1) + (["urgent"] if urgent else [])
    if not lanes or engine_class.__module__ != "worker.engine":
        return engine_class(settings)
    from .vllm_ext.compat import shared_core_missing

    if (reason := shared_core_missing()) is not None:
        log.error(
            "no %s process: %s; this process takes every job alone, urgent ones within its "
            "share (docs/vllm-compat.md)", " or ".join(sorted(set(lanes))), reason,
        )  # fmt: skip
        return engine_class(settings)
    addresses = CoreAddress.fresh(1 + len(lanes))
    share = settings.bulk_share()
    for i, (lane, address) in enumerate(zip(lanes, addresses[1:], strict=True), start=1):
        slots = settings.urgent_concurrency if lane == "urgent" else share
        state.lanes.append(
            Lane(worker, address, lane, slots, "" if lane == "urgent" else f"bulk{i}")
        )
    return engine_class(settings, share=addresses)


@signals.celeryd_after_setup.connect
def _add_queues(sender: Any = None, instance: Any = None, **_: Any) -> None:
    """Beside the queues it was started with (the shared one), the worker consumes:

    - the urgent queue, which its urgent process (``Lane``) consumes alone;
    - its own queue, ``<queue>@<worker>``, where producers route jobs by prefix
      (protocol/routing.py);
    - the queue of each name it serves, ``<queue>~<name>``, where jobs naming a model wait
      while no live worker serves it (``Settings.unserved_model``).

    Added here, Celery's way (``celeryd_after_setup``), so that a worker started with plain
    ``celery -A worker.app worker`` consumes the queue its heartbeat advertises too."""
    if instance is None or settings.lane == "urgent":
        return
    queues = instance.app.amqp.queues
    if _runner() == "pooling":  # embedding jobs only: never the shared or the urgent queue
        queues.select_add(embed_queue(settings.queue))
        queues.deselect([settings.queue])
    elif not settings.lane:  # a bulk lane consumes what its worker does, but the urgent queue
        queues.select_add(urgent_queue(settings.queue))
    owner = settings.urgent_of or str(sender or instance.hostname)
    queues.select_add(worker_queue(settings.queue, owner))
    try:
        names = [*settings.served_names(), *settings.adapters()]
    except ValueError:  # a malformed adapter list: the engine's start says so (exit 10)
        names = settings.served_names()
    for name in names:
        queues.select_add(model_queue(settings.queue, name))


def _runner() -> str:
    """What this worker's model does (``Settings.runner``): decided before its engine exists,
    since it picks the queues the worker takes from."""
    from .models import model_runner

    try:
        return model_runner(settings.model, settings.runner)
    except (FileNotFoundError, RuntimeError):  # no such model: the engine's start says so
        return "generate"


@signals.worker_ready.connect
def _start_heartbeat(sender: Any = None, **_: Any) -> None:
    state.name = getattr(sender, "hostname", None) or f"vqueue@{socket.gethostname()}"
    state.slots = int(getattr(getattr(sender, "pool", None), "limit", 0) or 0)
    from .vllm_ext.client import freeze_heap

    freeze_heap()  # the engine, the consumer and the pool's threads are up
    threading.Thread(target=_heartbeat, name="vqueue-heartbeat", daemon=True).start()
    threading.Thread(target=_withdrawals, name="vqueue-withdrawals", daemon=True).start()


@signals.worker_shutting_down.connect
def _stop_lanes(**_: Any) -> None:
    for lane in state.lanes:  # each finishes its jobs while this process finishes its own
        lane.stop()


@signals.worker_shutdown.connect
def _close_engine(**_: Any) -> None:
    state.stop.set()
    for lane in state.lanes:
        lane.stop()
    for lane in state.lanes:
        lane.wait(settings.job_timeout_s + 30)
    from . import metrics

    shared = metrics.multiprocess_dir()
    if not settings.urgent_of and shared and os.path.basename(shared).startswith("vqueue-metrics-"):
        shutil.rmtree(shared, ignore_errors=True)  # `vqueue worker` made it for this run
    try:
        _store().forget_worker(state.name)
        # what producers routed here and nobody took goes back to the shared queue
        move_all(_broker(), worker_queue(settings.queue, state.name), settings.queue)
    except Exception as exc:  # noqa: BLE001  # a live worker's heartbeat rescues them later
        log.warning("could not hand this worker's own queue back: %s", exc)
    ctx.close()
    if state.engine is not None:
        state.engine.close()


def _store() -> Any:
    return ctx.store


def _broker() -> Any:
    """A client of the broker's Redis (the queues), which may not be the result store's."""
    return ctx.broker


def warn_if_redis_may_evict(client: Any, what: str) -> str | None:
    """Log an error when Redis may evict keys: an eviction can drop queued jobs or a batch's
    done map. Returns the policy (None when Redis does not say, as managed services may not)."""
    try:
        policy = str(client.config_get("maxmemory-policy").get("maxmemory-policy", ""))
    except Exception:  # noqa: BLE001  # CONFIG disabled: nothing to check
        return None
    if policy and policy != "noeviction":
        log.error(
            "Redis (%s) runs with maxmemory-policy=%s: when it fills up it evicts keys, which "
            "can drop queued jobs or a batch's results. Run it with maxmemory-policy noeviction "
            "(docs/reliability.md)",
            what,
            policy,
        )
    return policy


def _withdrawals() -> None:
    """Aborts in the engine the running jobs of cancelled batches (`vqueue cancel`, the HTTP
    API): one round trip a second, for the batches in the engine now."""
    store = _store()
    while not state.stop.wait(1.0):
        engine = state.engine
        batches = engine.active_batches() if engine is not None else []
        if engine is None or not batches:
            continue
        try:
            reasons = store.withdrawn_many(batches)
        except Exception as exc:  # noqa: BLE001  # Redis restarting: next second
            log.debug("withdrawals: %s", exc)
            continue
        for batch, why in zip(batches, reasons, strict=True):
            # cancelled: stop now; expired: only the jobs not started go, the running finish
            if why == "cancelled" and (n := engine.abort_batch(batch, why)):
                log.info("batch %s %s: aborted %d running job(s)", batch, why, n)


def _heartbeat() -> None:
    """Liveness as a Redis key with a TTL (arq's health check): gone means dead or stopped."""
    store, broker = _store(), _broker()
    of = settings.urgent_of
    while not state.stop.is_set():
        e = state.engine
        info = {
            "name": state.name,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "queue": settings.queue,
            "model": e.model_name if e else settings.served_names()[0],
            "models": e.model_names if e else settings.served_names(),  # all it answers to
            "gpus": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "concurrency": settings.worker_concurrency(),
            "in_flight": e.in_flight if e else 0,
            "max_in_flight": e.max_in_flight if e else 0,
            "jobs_done": e.jobs_done if e else 0,
            "started_at": e.started_at if e else None,
            "updated_at": time.time(),
            "metrics_url": state.metrics_url,
            # consumes <queue>@<name>: producers may route jobs to it (the urgent process
            # consumes the urgent queue alone)
            "routed": not of,
            # the worker whose engine this process shares (``Lane``), and which lane it is; a
            # registry entry with it set is part of that worker, not a worker of its own
            "urgent_of": of or None,
            "lane": settings.lane or None,
            # "pooling": it takes embed jobs alone (protocol/routing.py)
            "runner": e.runner if e else _runner(),
        }
        if e is not None and e.stats is not None:
            info.update(e.stats.snapshot())
        if e is not None and e.plan is not None:  # `vqueue status` shows its optimizations
            info["engine"] = e.plan.as_dict()
        try:
            store.heartbeat(state.name, info, ttl_s=3 * settings.heartbeat_s)
            # a dead worker's jobs come back to its own queue after the visibility timeout
            watch_s = 2 * settings.visibility_timeout_s + 60
            # never this engine's own queue: it is consumed here, whatever the registry says
            moved = rescue_orphans(store, broker, settings.queue, watch_s, me=of or state.name)
            if moved:
                log.warning("moved %d jobs of workers that are gone to %s", moved, settings.queue)
        except Exception as exc:  # Redis restarting: keep trying, the worker itself is fine
            log.warning("heartbeat failed: %s", exc)
        state.stop.wait(settings.heartbeat_s)
