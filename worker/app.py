"""The Celery app, its configuration, and the worker lifecycle that owns the engine.

Importing this module is cheap (no vLLM, no torch). The engine is built by the ``worker_init``
signal, before the worker consumes anything, and closed by ``worker_shutdown``: the shape of
arq's ``on_startup``/``on_shutdown``.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any

from celery import Celery, signals

from producer.publish import PRIORITY_SEP, PRIORITY_STEPS, task_name
from producer.routing import move_all, rescue_orphans, worker_queue
from schemas import JOB_TYPES, Settings, get_settings

log = logging.getLogger(__name__)

# Named exit codes (dramatiq's habit): a supervisor can tell a broken engine from a clean stop.
EXIT_ENGINE = 3


def survive_kombu_close_race() -> None:
    """Keep the consumer alive when the broker connection drops with jobs in flight.

    kombu 5.7's Redis channel, on close, first discards its connection pool and then restores
    its unacknowledged messages through a new one, built from the connection's client. When
    that client is already gone, this raises AttributeError. Celery calls that an
    "Unrecoverable error": the consumer stops for good while the process, and its heartbeat,
    live on. Seen in ``tests/test_reliability.py::test_redis_restart_mid_batch``.

    Skipping that restore loses nothing. The messages stay in kombu's unacked set, where the
    tasks still running them ack them, or any worker's visibility-timeout scan returns them.
    """
    from kombu.transport import redis as kombu_redis

    original = kombu_redis.QoS.restore_unacked
    if getattr(original, "_vqueue", False):
        return

    def restore_unacked(self: Any, client: Any = None) -> Any:
        try:
            return original(self, client)
        except AttributeError as exc:
            log.warning(
                "broker connection closed before its %d unacknowledged job(s) could be "
                "restored (%s); they return after the visibility timeout",
                len(self._delivered),
                exc,
            )
            return None

    restore_unacked._vqueue = True  # type: ignore[attr-defined]
    kombu_redis.QoS.restore_unacked = restore_unacked  # type: ignore[method-assign]


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
        # Flower's view: sent/started events and per-type task names.
        worker_send_task_events=True,
        task_send_sent_event=True,
        task_track_started=True,
        worker_hijack_root_logger=False,
    )
    return app


settings = get_settings()
app = create_app(settings)
survive_kombu_close_race()
app.conf.imports = ("worker.tasks",)


class _WorkerState:
    """Process-wide: the engine and the heartbeat that advertises it."""

    engine: Any = None
    name: str = ""
    metrics_url: str | None = None
    stop = threading.Event()


state = _WorkerState()


@signals.worker_init.connect
def _build_engine(sender: Any = None, **_: Any) -> None:
    import importlib

    from . import metrics
    from .engine import ConfigError

    state.metrics_url = metrics.serve(settings.metrics_port, settings.metrics_host)
    try:
        module, _sep, cls = settings.engine_class.partition(":")
        state.engine = getattr(importlib.import_module(module), cls)(settings)
    except (ConfigError, FileNotFoundError) as exc:  # the operator's to fix: a line, no trace
        log.error("invalid worker settings: %s; exiting %d", exc, EXIT_ENGINE)
        os._exit(EXIT_ENGINE)
    except BaseException:
        log.exception("the vLLM engine failed to start; exiting %d", EXIT_ENGINE)
        os._exit(EXIT_ENGINE)  # Celery would log a handler's exception and carry on without it


@signals.worker_ready.connect
def _start_heartbeat(sender: Any = None, **_: Any) -> None:
    state.name = getattr(sender, "hostname", None) or f"vqueue@{socket.gethostname()}"
    threading.Thread(target=_heartbeat, name="vqueue-heartbeat", daemon=True).start()


@signals.worker_shutdown.connect
def _close_engine(**_: Any) -> None:
    state.stop.set()
    try:
        store = _store()
        store.forget_worker(state.name)
        # what producers routed here and nobody took goes back to the shared queue
        move_all(store.r, worker_queue(settings.queue, state.name), settings.queue)
    except Exception:
        pass
    if state.engine is not None:
        state.engine.close()


def _store() -> Any:
    from producer.store import BatchStore

    return BatchStore.from_settings(settings)


def _heartbeat() -> None:
    """Liveness as a Redis key with a TTL (arq's health check): gone means dead or stopped."""
    store = _store()
    while not state.stop.is_set():
        e = state.engine
        info = {
            "name": state.name,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "queue": settings.queue,
            "model": e.model_name if e else settings.model,
            "gpus": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "concurrency": settings.worker_concurrency(),
            "in_flight": e.in_flight if e else 0,
            "max_in_flight": e.max_in_flight if e else 0,
            "jobs_done": e.jobs_done if e else 0,
            "started_at": e.started_at if e else None,
            "updated_at": time.time(),
            "metrics_url": state.metrics_url,
            "routed": True,  # consumes <queue>@<name>: producers may route jobs to it
        }
        stats = getattr(e, "stats", None)
        if stats is not None:
            info.update(stats.snapshot())
        try:
            store.heartbeat(state.name, info, ttl_s=3 * settings.heartbeat_s)
            live = {w["name"] for w in store.workers()}
            moved = rescue_orphans(store.r, settings.queue, live)
            if moved:
                log.warning("moved %d jobs of workers that are gone to %s", moved, settings.queue)
        except Exception as exc:  # Redis restarting: keep trying, the worker itself is fine
            log.warning("heartbeat failed: %s", exc)
        state.stop.wait(settings.heartbeat_s)
