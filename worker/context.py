"""What a worker process's tasks and lifecycle hooks share (arq's ``ctx``): one of each, built at
first use and closed as the process stops (``worker.app``'s ``worker_shutdown`` hook).

The engine itself is built by the ``worker_init`` hook, before any task runs, and lives in
``worker.app.state``; these are the resources around it, each cheap to build once and wasteful
to build per job: the result store's client and the broker's, the router for jobs of a model
served elsewhere, the registered templates, the result cache, the permits that bound the jobs
this process runs at once, and the threads that run a pack's jobs.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from schemas import Settings

if TYPE_CHECKING:
    import redis

    from protocol.routing import Router
    from protocol.store import BatchStore

    from .cache import ResultCache
    from .structured import Templates


class Context:
    """The shared resources of one worker process (``worker.app.ctx``). ``state`` is the
    process's ``worker.app.state``: its engine and its Celery pool's size, read when the
    resources that depend on them are first built."""

    def __init__(self, settings: Settings, state: Any) -> None:
        self.settings, self.state = settings, state
        self._lock = threading.Lock()
        self._store: BatchStore | None = None
        self._broker: redis.Redis | None = None
        self._router: Router | None = None
        self._templates: Templates | None = None
        self._cache: ResultCache | None = None
        self._permits: threading.BoundedSemaphore | None = None
        self._pool: ThreadPoolExecutor | None = None

    @property
    def store(self) -> BatchStore:
        """The result store (batches, results, the registry, dead letters, templates)."""
        if self._store is None:
            from protocol.store import BatchStore

            with self._lock:
                self._store = self._store or BatchStore.from_settings(self.settings)
        return self._store

    @property
    def broker(self) -> redis.Redis:
        """A client of the broker's Redis (the queues), which may not be the result store's."""
        if self._broker is None:
            s = self.settings
            if s.broker_url == s.backend_url():
                self._broker = self.store.r
            else:
                from protocol.store import BatchStore

                self._broker = BatchStore.from_url(s.broker_url, retry_s=s.redis_retry_s).r
        return self._broker

    @property
    def router(self) -> Router:
        """Routes a job this worker does not serve to a live worker that does, or to its
        model's own queue (``Settings.unserved_model``)."""
        if self._router is None:
            from protocol.routing import Router

            s = self.settings
            with self._lock:
                self._router = self._router or Router(
                    self.store, self.broker, s.queue, by_prefix=False,
                    wait=s.unserved_model == "wait",
                )  # fmt: skip
        return self._router

    @property
    def templates(self) -> Templates:
        """Extraction templates, built-in and registered (read from the store as jobs name them)."""
        if self._templates is None:
            from .structured import Templates

            store = self.store
            with self._lock:
                self._templates = self._templates or Templates(store.template)
        return self._templates

    @property
    def result_cache(self) -> ResultCache | None:
        """The result cache (``worker.cache``), None when ``VQUEUE_RESULT_CACHE`` is off. Its
        weight fingerprints are read once, at the first job."""
        s = self.settings
        if not s.result_cache:
            return None
        if self._cache is None:
            import redis

            from .cache import ResultCache
            from .models import weights_fingerprint

            url = s.result_cache_url
            r = redis.Redis.from_url(url, socket_timeout=5) if url else None
            with self._lock:
                if self._cache is None:
                    engine = self.state.engine
                    base = weights_fingerprint(engine.model_path)
                    weights = {name: base for name in engine.model_names}
                    for name, (_, _, path) in engine.adapters.items():
                        weights[name] = f"{base}:{weights_fingerprint(path)}"
                    self._cache = ResultCache(r or self.store.r, s.key_prefix, s, weights)
        return self._cache

    def _slots(self) -> int:
        return int(self.state.slots or self.settings.worker_concurrency())

    @property
    def permits(self) -> threading.BoundedSemaphore:
        """The jobs this process runs at once, single or packed: its Celery pool's size (its
        share of the worker's concurrency), which the pool itself bounds only while every
        message is one job."""
        if self._permits is None:
            with self._lock:
                self._permits = self._permits or threading.BoundedSemaphore(self._slots())
        return self._permits

    @property
    def pack_pool(self) -> ThreadPoolExecutor:
        """The threads that run a pack's jobs; they start as jobs need them, and the permits
        bound how many run."""
        if self._pool is None:
            with self._lock:
                self._pool = self._pool or ThreadPoolExecutor(self._slots(), "vqueue-pack")
        return self._pool

    def close(self) -> None:
        """As the process stops, after its tasks ended or were handed back: the pack threads
        go as they finish. The clients stay: the stop's last words (the registry, the queue
        handed back) still go through them."""
        if self._pool is not None:
            self._pool.shutdown(wait=False)
