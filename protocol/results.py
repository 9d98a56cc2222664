"""Reading a batch: its counts, its results as a stream a reader follows, one job's result;
taking results out of Redis once their reader has them safe, and undoing one so it runs again.

A stream lets any number of readers follow a batch as it completes, resume after a disconnect
from the last entry id they saw, and read the whole batch again later, without polling.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import redis

from schemas import BatchStatus, CanaryReport, JobResult

from .batches import Batches, _place


class Results(Batches):
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
            prompt_tokens=int(h.get("prompt_tokens", 0)),
            cached_tokens=int(h.get("cached_tokens", 0)),
            completion_tokens=int(h.get("completion_tokens", 0)),
            model=h.get("model") or None,
            error=h.get("error") or None,
            sealed=h.get("sealed") == "1",
            fed=int(h["fed"]) if h.get("fed") else None,
            fed_at=float(h["fed_at"]) if h.get("fed_at") else None,
            fed_by=h.get("fed_by") or None,
            canary=CanaryReport.model_validate_json(h["canary"]) if h.get("canary") else None,
            paused=h.get("paused") == "1",
        )

    def is_sealed(self, batch: str) -> bool:
        return self.r.hget(self.key(batch), "sealed") == "1"

    def queue_of(self, batch: str) -> str | None:
        """The queue the batch's jobs were sent to (None for batches made before it was kept)."""
        return self.r.hget(self.key(batch), "queue") or None

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

    def take(self, batch: str, upto: str, written: dict[str, Any] | None = None) -> int:
        """The results up to stream entry ``upto`` leave Redis: their reader has them safe
        (``vqueue results --take``, the HTTP API's output files). The batch's counts and each
        job's done mark stay, so no job runs again; how many entries went. ``written``: where
        the reader put them and how far its files reach (``taken``), recorded in the same
        transaction, so a reader started again knows what of its files to keep."""
        ms, seq = upto.split("-")
        pipe = self.r.pipeline()
        if written:
            pipe.hset(self.key(batch), "taken", json.dumps(written))
        pipe.xtrim(self.key(batch, "results"), minid=f"{ms}-{int(seq) + 1}", approximate=False)
        return int(pipe.execute()[-1])

    def taken(self, batch: str) -> dict[str, Any]:
        """What ``take`` last recorded of its reader's files (empty: nothing)."""
        raw = self.r.hget(self.key(batch), "taken")
        return dict(json.loads(raw)) if raw else {}

    def iter_all(self, batch: str) -> Iterator[JobResult]:
        after = "0-0"
        while True:
            page = self.read(batch, after)
            if not page:
                return
            after = page[-1][0]
            for _, res in page:
                yield res

    def result(self, batch: str, job_id: str) -> JobResult | None:
        """The job's result while it is in Redis (``find``)."""
        return self.find(batch, job_id)[0]

    def find(
        self, batch: str, job_id: str, after: str = "-", page: int = 1000
    ) -> tuple[JobResult | None, str]:
        """The job's result while it is in Redis, and how far the batch's results were read
        for it: by its mark; a job known by its input line has none naming its result (a fed
        batch keeps no index by id), so the results after stream entry ``after`` are read for
        it, and a caller that asks again passes the second value to read only what came since
        (``Batch.result``)."""
        entry = self.marks(batch, [(job_id, None)])[0]
        stream = self.key(batch, "results")
        if entry:
            got = self.r.xrange(stream, min=entry, max=entry)
            return (JobResult.model_validate_json(got[0][1]["result"]) if got else None), after
        if not self.r.exists(self.key(batch, "done:lines")):
            return None, after
        for eid, fields in self._results_after(batch, after, page):
            if fields.get("id") == job_id:
                return JobResult.model_validate_json(fields["result"]), after
            after = eid
        return None, after

    def _entries(self, batch: str, job_ids: set[str]) -> dict[str, str]:
        """The stream entries of ``job_ids``' results, the stream read once, up to the last."""
        found: dict[str, str] = {}
        for eid, fields in self._results_after(batch):
            if fields.get("id") in job_ids:
                found[fields["id"]] = eid
                if len(found) == len(job_ids):
                    break
        return found

    def _results_after(
        self, batch: str, after: str = "-", page: int = 1000
    ) -> Iterator[tuple[str, dict[str, str]]]:
        """The batch's stream entries after entry ``after`` ("-": all), a page a round trip."""
        stream = self.key(batch, "results")
        while True:
            got = self.r.xrange(stream, min=after if after == "-" else f"({after}", count=page)
            yield from got
            if len(got) < page:
                return
            after = got[-1][0]

    def forget(self, batch: str, job_id: str, line: int | None = None) -> bool:
        """Remove a job's result and delivery count so it can run again (a dead letter sent
        again); ``line``: its input line, for a job known by it."""
        return self.forget_many(batch, [(job_id, line)])[0]

    def forget_many(self, batch: str, jobs: list[tuple[str, int | None]]) -> list[bool]:
        """``forget`` for each (id, input line or None) of ``jobs`` (a forced re-run's chunk):
        whether each had a result. The results of jobs known by their line are found by
        reading the batch's results once for them all."""
        keys = [self.key(batch), self.key(batch, "done"), self.key(batch, "results")]
        keys.append(self.key(batch, "attempts"))
        placed = [(i, line) for i, line in jobs if line is not None]
        entries: dict[str, str] = {}
        if placed:
            pipe = self.r.pipeline(transaction=False)
            for _, line in placed:
                pipe.getbit(self.key(batch, "done:lines"), line)
            done = {i for (i, _), bit in zip(placed, pipe.execute(), strict=True) if bit}
            entries = self._entries(batch, done) if done else {}
        calls = [
            (self.lua["forget"], keys, [i, _place(line), entries.get(i, "")]) for i, line in jobs
        ]
        answers = self.run_scripts(calls)
        for a in answers:
            if isinstance(a, redis.RedisError):
                raise a
        return [bool(a) for a in answers]
