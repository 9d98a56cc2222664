"""Routing: each job goes to a worker serving the model it names, and among those to the one
its prefix key hashes to.

Every worker consumes the shared queue and a queue of its own (``<queue>@<worker>``). A producer
ranks the live workers (their heartbeats) for each job by rendezvous hashing on the job's prefix
key, so jobs sharing a prefix meet on one engine, whose prefix cache then serves them, and a
worker joining or leaving moves only the keys it wins or held. A worker whose own queue already
holds ``spill`` jobs is passed over for the least-loaded one: caches stay warm without hot spots.
With no live worker, jobs go to the shared queue, which any worker takes from.

A job naming a model (``Envelope.model``) is routed among the live workers that serve it (their
heartbeat's ``models``), with or without prefix routing; with none serving it, it goes to the
shared queue, where the worker that takes it fails it ``model_not_found``, or, to wait, to the
model's own queue (``model_queue``), which a worker serving it takes from when it starts.

Embedding jobs (``embed``) need a worker on a pooling model (its heartbeat's ``runner``), and
such a worker answers nothing else: it consumes its own queue, its names' queues and the
embedding queue (``embed_queue``), never the shared or urgent ones. An embedding job naming no
model is routed among the live pooling workers, and waits in the embedding queue while none
lives; a job of any other type naming none is routed among the generating workers only. A job
naming a model goes to the workers serving it, whatever their kind: one of the wrong kind
fails it alone (``wrong_model_kind``).

A dead worker's queue is not stranded: live workers move its jobs to the shared queue
(``rescue_orphans``, from the worker registry in ``store``), and a worker stopping cleanly moves
its own.
"""

from __future__ import annotations

import hashlib
import time
from collections import defaultdict
from typing import Any

import redis

from schemas import Envelope

from .wire import queue_depth, queue_keys


def worker_queue(queue: str, worker: str) -> str:
    return f"{queue}@{worker}"


def model_queue(queue: str, model: str) -> str:
    """Where jobs naming ``model`` wait while no live worker serves it
    (``Settings.unserved_model`` "wait"); every worker consumes its names' queues."""
    return f"{queue}~{model}"


def embed_queue(queue: str) -> str:
    """Where embedding jobs naming no model wait for a worker on a pooling model; only such
    workers consume it."""
    return f"{queue}.embed"


def urgent_queue(queue: str) -> str:
    """Where jobs at ``Settings.urgent_priority`` or above wait: every worker on ``queue``
    consumes it beside its other queues, and each worker's urgent process consumes it alone,
    with slots beyond the worker's share of bulk jobs (worker/app.py: ``Lane``)."""
    return f"{queue}.urgent"


def rank(prefix_key: str, workers: list[str]) -> list[str]:
    """Workers by rendezvous (highest random weight) score for ``prefix_key``, best first."""

    def score(w: str) -> int:
        return int.from_bytes(hashlib.blake2b(f"{prefix_key}|{w}".encode(), digest_size=8).digest())

    return sorted(workers, key=score, reverse=True)


class Router:
    """Chooses a queue per job; one per producer, its view of the fleet refreshed every 2 s."""

    def __init__(
        self,
        store: Any,
        broker: redis.Redis,
        queue: str,
        spill: int = 0,
        by_prefix: bool = True,
        wait: bool = False,
    ) -> None:
        self.store, self.broker, self.queue, self.spill = store, broker, queue, spill
        self.by_prefix = by_prefix  # off: only jobs naming a model are routed
        self.wait = wait  # a model nobody serves: its own queue, not the shared one
        self._workers: dict[str, int] = {}  # name -> spill threshold
        self._models: dict[str, list[str]] = {}  # served name -> the workers serving it
        self._pooling: list[str] = []  # the live workers on a pooling model (embed jobs)
        self._seen = 0.0

    def workers(self) -> dict[str, int]:
        if time.monotonic() - self._seen > 2.0:
            live = [
                w for w in self.store.workers() if w.get("queue") == self.queue and w.get("routed")
            ]
            # one routed queue per engine, which its worker consumes
            self._workers = {
                w["name"]: self.spill or max(int(w.get("concurrency") or 1), 1) for w in live
            }
            models: dict[str, list[str]] = defaultdict(list)
            for w in live:
                for m in w.get("models") or [w.get("model")]:
                    if m:
                        models[m].append(w["name"])
            self._models = {m: sorted(ws) for m, ws in models.items()}
            self._pooling = sorted(w["name"] for w in live if w.get("runner") == "pooling")
            self._seen = time.monotonic()
        return self._workers

    def route(self, envelopes: list[Envelope]) -> dict[str, list[Envelope]]:
        workers = self.workers()
        pooling = self._pooling
        generating = sorted(set(workers) - set(pooling))
        depth: dict[str, int] = {}
        out: dict[str, list[Envelope]] = defaultdict(list)
        for env in envelopes:
            if env.model is not None:
                names = self._models.get(env.model)
                if not names:  # nobody serves it: wait for one, or the worker taking it says so
                    out[model_queue(self.queue, env.model) if self.wait else self.queue].append(env)
                    continue
            elif env.job.type == "embed":
                names = pooling
                if not names:  # an embedding worker takes it when one starts
                    out[embed_queue(self.queue)].append(env)
                    continue
            elif self.by_prefix and generating:
                names = generating
            else:
                out[self.queue].append(env)
                continue
            for w in names:
                if w not in depth:
                    depth[w] = queue_depth(self.broker, worker_queue(self.queue, w))
            target = rank(env.prefix_key or env.job.id, names)[0]
            if depth[target] >= workers[target]:  # backed up: the least-loaded takes it
                target = min(names, key=lambda w: depth[w] / workers[w])
            depth[target] += 1
            out[worker_queue(self.queue, target)].append(env)
        return out


def move_all(broker: redis.Redis, src: str, dst: str) -> int:
    """Move every job of queue ``src`` (all priority lists) to ``dst``, oldest first."""
    moved = 0
    for s, d in zip(queue_keys(src), queue_keys(dst), strict=True):
        while broker.lmove(s, d, "RIGHT", "LEFT") is not None:
            moved += 1
    return moved


def rescue_orphans(
    store: Any, broker: redis.Redis, queue: str, watch_s: float, me: str | None = None
) -> int:
    """Move the jobs in the own queues of ``queue``'s workers that are gone (heartbeat run out)
    to the shared queue: no scan of the keyspace. A dead worker's unacknowledged jobs return to
    its own queue (kombu restores a job to the queue it came from) once the visibility timeout
    has passed, so its queue is watched for ``watch_s`` after its death, then forgotten.

    ``me`` is the calling worker: after Redis was away for longer than a heartbeat lasts, its
    own entry has run out too, yet it is alive and consumes its queue; it is never rescued."""
    moved = 0
    now = time.time()
    for name, gone_at in store.gone_workers(queue):
        if name == me:
            continue
        own = worker_queue(queue, name)
        if queue_depth(broker, own):
            moved += move_all(broker, own, queue)
        if now - gone_at > watch_s:
            store.forget_worker(name)
    return moved
