"""Workers' liveness: a registry (rq's, dramatiq's), not a scan of the keyspace.

- ``{p}:workers``          sorted set: worker name -> when its heartbeat expires
- ``{p}:workers:queue``    hash: worker name -> the queue it consumes (to rescue a dead one's)
- ``{p}:worker:{name}``    string: the worker's last heartbeat (JSON), with a TTL
"""

from __future__ import annotations

import json
import time
from typing import Any

from .scripts import StoreBase


class Registry(StoreBase):
    def worker_key(self, name: str) -> str:
        return f"{self.prefix}:worker:{name}"

    def heartbeat(self, name: str, info: dict[str, Any], ttl_s: float) -> None:
        """Advertise a live worker for ``ttl_s``: its info under its own key, its name in the
        registry scored by when that runs out."""
        pipe = self.r.pipeline(transaction=False)
        pipe.set(self.worker_key(name), json.dumps(info), px=int(ttl_s * 1000))
        pipe.zadd(f"{self.prefix}:workers", {name: time.time() + ttl_s})
        pipe.hset(f"{self.prefix}:workers:queue", name, str(info.get("queue", "")))
        pipe.execute()

    def workers(self, lanes: bool = False) -> list[dict[str, Any]]:
        """Live workers' heartbeats, by name: two reads, however large the keyspace.
        ``lanes``: with each worker's urgent process too (its heartbeat names the worker in
        ``urgent_of``), which is part of that worker, not one more."""
        names = self.r.zrangebyscore(f"{self.prefix}:workers", time.time(), "+inf")
        values = self.r.mget([self.worker_key(n) for n in sorted(names)]) if names else []
        beats = [json.loads(v) for v in values if v]
        return beats if lanes else [w for w in beats if not w.get("urgent_of")]

    def consumed(self, queue: str | None) -> bool:
        """Whether some live worker consumes ``queue``."""
        return any(w.get("queue") == queue for w in self.workers())

    def gone_workers(self, queue: str) -> list[tuple[str, float]]:
        """Workers of ``queue`` whose heartbeat ran out, and when: their own queues want
        rescuing (``protocol.routing.rescue_orphans``)."""
        gone = self.r.zrangebyscore(f"{self.prefix}:workers", 0, time.time(), withscores=True)
        if not gone:
            return []
        queues = self.r.hmget(f"{self.prefix}:workers:queue", [n for n, _ in gone])
        return [(n, float(at)) for (n, at), q in zip(gone, queues, strict=True) if q == queue]

    def forget_worker(self, name: str) -> None:
        """Take a worker out of the registry (stopped cleanly, or its queue rescued)."""
        pipe = self.r.pipeline(transaction=False)
        pipe.delete(self.worker_key(name))
        pipe.zrem(f"{self.prefix}:workers", name)
        pipe.hdel(f"{self.prefix}:workers:queue", name)
        pipe.execute()
