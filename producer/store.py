"""Where batches and results live in Redis, written by workers and read by producers.

Per batch ``b`` (keys under the settings' ``key_prefix``):

- ``{p}:batch:{b}``          hash: total, completed, failed, rejected, sealed, created_at, ...
- ``{p}:batch:{b}:done``     hash: job id -> stream entry id; a job's result is written once
- ``{p}:batch:{b}:results``  stream: one entry per finished job, ``result`` = JobResult JSON

A stream lets any number of readers follow a batch as it completes, resume after a disconnect
from the last entry id they saw, and read the whole batch again later, without polling.
Recording is one Lua script, so a duplicate delivery of the same job never counts twice.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import redis

from schemas import BatchStatus, JobResult

# KEYS: batch hash, done hash, results stream. ARGV: job id, result json, status field, ttl.
_RECORD = """
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then return 0 end
local entry = redis.call('XADD', KEYS[3], '*', 'id', ARGV[1], 'result', ARGV[2])
redis.call('HSET', KEYS[2], ARGV[1], entry)
redis.call('HINCRBY', KEYS[1], ARGV[3], 1)
redis.call('HSET', KEYS[1], 'updated_at', ARGV[5])
for i = 1, 3 do redis.call('EXPIRE', KEYS[i], ARGV[4]) end
return 1
"""


class BatchStore:
    """Typed access to batch counters and results; one instance per process is plenty."""

    def __init__(self, client: redis.Redis, prefix: str = "vqueue", ttl_s: int = 7 * 24 * 3600):
        self.r = client
        self.prefix = prefix
        self.ttl_s = ttl_s
        self._record = client.register_script(_RECORD)

    @classmethod
    def from_url(cls, url: str, prefix: str = "vqueue", ttl_s: int = 7 * 24 * 3600) -> BatchStore:
        client = redis.Redis.from_url(
            url, decode_responses=True, health_check_interval=30, socket_keepalive=True
        )
        return cls(client, prefix, ttl_s)

    def key(self, batch: str, part: str = "") -> str:
        return f"{self.prefix}:batch:{batch}" + (f":{part}" if part else "")

    # -- producer side
    def create(self, batch: str, fmt: str, source: str | None = None) -> None:
        now = time.time()
        fields: dict[str, Any] = {"total": 0, "completed": 0, "failed": 0, "rejected": 0}
        fields.update(sealed=0, created_at=now, format=fmt, source=source or "")
        pipe = self.r.pipeline()
        pipe.hset(self.key(batch), mapping=fields)
        pipe.expire(self.key(batch), self.ttl_s)
        pipe.execute()

    def add_total(self, pipe: Any, batch: str, total: int) -> None:
        """Queue the ``total`` update on ``pipe`` so it travels with the jobs it counts."""
        pipe.hincrby(self.key(batch), "total", total)

    def delete(self, batch: str) -> None:
        self.r.delete(self.key(batch), self.key(batch, "done"), self.key(batch, "results"))

    def seal(self, batch: str, rejected: int = 0) -> None:
        """Mark submission finished: from now on ``total`` is final, and waiting can end.
        ``rejected`` counts the input lines refused at submit."""
        pipe = self.r.pipeline()
        if rejected:
            pipe.hincrby(self.key(batch), "rejected", rejected)
        pipe.hset(self.key(batch), "sealed", 1)
        pipe.execute()

    # -- worker side
    def record(self, result: JobResult) -> bool:
        """Store one result; False if this job already had one (duplicate delivery)."""
        keys = [
            self.key(result.batch),
            self.key(result.batch, "done"),
            self.key(result.batch, "results"),
        ]
        field = "completed" if result.status == "completed" else "failed"
        args = [result.id, result.model_dump_json(), field, self.ttl_s, time.time()]
        return bool(self._record(keys=keys, args=args))

    # -- reading
    def status(self, batch: str) -> BatchStatus | None:
        h = self.r.hgetall(self.key(batch))
        if not h:
            return None
        return BatchStatus(
            batch=batch,
            total=int(h.get("total", 0)),
            completed=int(h.get("completed", 0)),
            failed=int(h.get("failed", 0)),
            rejected=int(h.get("rejected", 0)),
            created_at=float(h.get("created_at", 0)),
            updated_at=float(h["updated_at"]) if h.get("updated_at") else None,
        )

    def is_sealed(self, batch: str) -> bool:
        return self.r.hget(self.key(batch), "sealed") == "1"

    def read(
        self, batch: str, after: str = "0-0", block_ms: int | None = None, count: int = 1000
    ) -> list[tuple[str, JobResult]]:
        """Results recorded after stream entry ``after``; waits up to ``block_ms`` for the first."""
        stream = self.key(batch, "results")
        if block_ms is None:
            entries = self.r.xrange(stream, min=f"({after}" if after != "0-0" else "-", count=count)
        else:
            resp = self.r.xread({stream: after}, count=count, block=block_ms)
            entries = resp[0][1] if resp else []
        return [(eid, JobResult.model_validate_json(f["result"])) for eid, f in entries]

    def iter_all(self, batch: str) -> Iterator[JobResult]:
        after = "0-0"
        while True:
            page = self.read(batch, after)
            if not page:
                return
            after = page[-1][0]
            for _, res in page:
                yield res

    def has_result(self, batch: str, job_id: str) -> bool:
        return bool(self.r.hexists(self.key(batch, "done"), job_id))

    def result(self, batch: str, job_id: str) -> JobResult | None:
        entry = self.r.hget(self.key(batch, "done"), job_id)
        if entry is None:
            return None
        got = self.r.xrange(self.key(batch, "results"), min=entry, max=entry)
        return JobResult.model_validate_json(got[0][1]["result"]) if got else None

    # -- workers' liveness
    def worker_key(self, name: str) -> str:
        return f"{self.prefix}:worker:{name}"

    def heartbeat(self, name: str, info: dict[str, Any], ttl_s: float) -> None:
        self.r.set(self.worker_key(name), json.dumps(info), px=int(ttl_s * 1000))

    def workers(self) -> list[dict[str, Any]]:
        keys = sorted(self.r.scan_iter(match=self.worker_key("*"), count=500))
        values = self.r.mget(keys) if keys else []
        return [json.loads(v) for v in values if v]

    def forget_worker(self, name: str) -> None:
        self.r.delete(self.worker_key(name))
