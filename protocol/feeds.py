"""A batch's feed: how far its input was sent, who sends it, and its canary's verdict.

Fields of the batch hash ``{p}:batch:{b}`` (``protocol.batches``): ``fed`` (jobs of the input
sent), ``fed_at`` (when the feed last showed it was alive), ``fed_by`` (host:pid), ``source``
(the input file), ``canary`` (its report), ``paused`` and ``feed_options`` (a failed canary's:
the submit options a resume sends the rest with), ``error`` (why submission stopped early).
"""

from __future__ import annotations

import json
import time
from typing import Any

from redis.commands.core import Script

from schemas import CanaryReport

from .scripts import ALLOW_OOM, StoreBase, source


class Feeds(StoreBase):
    _stopped: Script | None = None  # stopped.lua as this Redis takes it (with flags from 7)

    def fed_position(self, batch: str) -> int:
        """How many of the batch's input jobs a feed sent (``claim_send``'s ``fed``): a feed
        that resumes after its process died starts there, so no job is sent twice."""
        return int(self.r.hget(self.key(batch), "fed") or 0)

    def feed_state(self, batch: str) -> tuple[int | None, float | None, str, str]:
        """(jobs sent, when the feed last showed it was alive, the input it reads, the process
        feeding it as host:pid) of a feed that has not finished; (None, None, source, by)
        when none is unfinished."""
        fed, at, source, by = self.r.hmget(self.key(batch), "fed", "fed_at", "source", "fed_by")
        return (
            None if fed is None else int(fed),
            None if at is None else float(at),
            source or "",
            by or "",
        )

    def feed_start(self, batch: str, by: str) -> None:
        """A feed of the batch's input starts in process ``by`` (host:pid)."""
        self.r.hset(self.key(batch), mapping={"fed_by": by, "fed_at": time.time()})

    def feed_alive(self, batch: str) -> None:
        """A feed waiting on its window says it is alive (``fed_at``), as each chunk does."""
        self.r.hset(self.key(batch), "fed_at", time.time())

    def unfinished(self, batch: str) -> int:
        """The batch's jobs enqueued and not finished: queued, reserved or running, which is
        what of it Redis holds as messages, the quantity a feed's window bounds."""
        total, completed, failed = self.r.hmget(self.key(batch), "total", "completed", "failed")
        return int(total or 0) - int(completed or 0) - int(failed or 0)

    def stop_submission(self, batch: str, reason: str, rejected: int = 0) -> None:
        """Seal a batch whose submission stopped early, saying why (``BatchStatus.error``):
        what was enqueued still runs and the batch ends when it has. Works when Redis 7 or
        later is out of memory, the usual reason; Redis 6 refuses it then
        (``refused_for_memory``)."""
        if self._stopped is None:
            version = str(self.r.info("server").get("redis_version", "7"))
            flags = ALLOW_OOM if int(version.split(".")[0]) >= 7 else ""
            self._stopped = self.r.register_script(flags + source("stopped"))
        self._stopped(keys=[self.key(batch)], args=[reason[:2000], rejected])

    def canary_ended(
        self, batch: str, report: CanaryReport, feed: dict[str, Any] | None = None
    ) -> None:
        """Keep the canary's report; one that failed pauses the batch, keeping how its feed
        was made (``feed``: the submit options a resume sends the rest of the input with)."""
        mapping: dict[str, Any] = {"canary": report.model_dump_json()}
        if not report.passed:
            mapping.update(paused=1, feed_options=json.dumps(feed or {}))
        self.r.hset(self.key(batch), mapping=mapping)

    def canary_judged(self, batch: str) -> bool:
        return bool(self.r.hexists(self.key(batch), "canary"))

    def is_paused(self, batch: str) -> bool:
        return self.r.hget(self.key(batch), "paused") == "1"

    def unpause(self, batch: str) -> dict[str, Any] | None:
        """End the batch's pause; the submit options its feed was made with, or None when it
        was not paused."""
        pipe = self.r.pipeline()
        pipe.hget(self.key(batch), "paused")
        pipe.hget(self.key(batch), "feed_options")
        pipe.hdel(self.key(batch), "paused", "feed_options")
        paused, options, _ = pipe.execute()
        return json.loads(options or "{}") if paused == "1" else None
