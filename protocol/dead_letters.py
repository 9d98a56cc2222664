"""Dead letters: jobs that exhausted their deliveries, kept with their last error and envelope.

- ``{p}:dlq:entry:{task}``   string: one dead letter (task id ``batch:job``), envelope included;
                             expires with the results (``result_ttl_s``)
- ``{p}:dlq:index``          sorted set: task ids by the time they died (pruned as they expire)
"""

from __future__ import annotations

import json
import time
from typing import Any

from schemas import JobResult

from .batches import Batches


class DeadLetters(Batches):
    def dlq_key(self, part: str = "") -> str:
        return f"{self.prefix}:dlq" + (f":{part}" if part else "")

    def dead_letter(
        self, envelope: Any, result: JobResult, attempts: int, record: bool = True
    ) -> None:
        """Park the job and (``record``) its failed result, so the batch still finishes. The
        entry expires with the batch's results."""
        task_id = f"{result.batch}:{result.id}"
        entry = {
            "task_id": task_id,
            "batch": result.batch,
            "id": result.id,
            "type": result.type,
            "attempts": attempts,
            "error": result.error.model_dump() if result.error else None,
            "worker": result.worker,
            "dead_at": time.time(),
            "envelope": envelope,
        }
        pipe = self.r.pipeline()
        pipe.set(self.dlq_key(f"entry:{task_id}"), json.dumps(entry), ex=self.ttl_s)
        pipe.zadd(self.dlq_key("index"), {task_id: entry["dead_at"]})
        pipe.zremrangebyscore(self.dlq_key("index"), 0, time.time() - self.ttl_s)
        pipe.execute()
        if record:
            self.record(result)

    def dead_letters(self, batch: str | None = None, limit: int = 1000) -> list[dict[str, Any]]:
        self.r.zremrangebyscore(self.dlq_key("index"), 0, time.time() - self.ttl_s)
        ids = self.r.zrange(self.dlq_key("index"), 0, -1)
        if batch:
            ids = [i for i in ids if i.startswith(f"{batch}:")]
        ids = ids[:limit]
        raw = self.r.mget([self.dlq_key(f"entry:{i}") for i in ids]) if ids else []
        return [json.loads(v) for v in raw if v]

    def dead_letter_entry(self, task_id: str) -> dict[str, Any] | None:
        raw = self.r.get(self.dlq_key(f"entry:{task_id}"))
        return json.loads(raw) if raw else None

    def drop_dead_letter(self, task_id: str) -> None:
        pipe = self.r.pipeline()
        pipe.delete(self.dlq_key(f"entry:{task_id}"))
        pipe.zrem(self.dlq_key("index"), task_id)
        pipe.execute()
