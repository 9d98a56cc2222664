"""What a queued job and a stored result cost in Redis memory, beyond their own text.

Starts a private ``redis-server``, submits N summarize jobs through ``Client.submit_many`` (the
producer's real path: the batch hash, the done map, Celery's message in its list), reads
``used_memory``, then takes the messages off their list as a worker would, starts each job
(``BatchStore.start``: its delivery count) and records one result per job through
``BatchStore.record`` (the worker's real script: the results stream, the done map, the
counters), and reads it again; last, a taking reader removes every result from the stream
(``BatchStore.take``), and what stays is the residue a finished job leaves until the TTL.
It does so twice: for a batch made with its size known, as ``vqueue submit FILE`` and ``vqueue
serve`` make theirs (its done marks in compact parts), and for one without (a ``Client`` call
that does not say). Nothing else runs against that Redis.

    python -m benchmarks.redis_bytes [--jobs 20000] [--text-chars 200] [--out FILE]

Prints a table and writes JSON (benchmarks/results/redis-bytes-<date>.json by default).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import redis

from producer import Client
from schemas import JobResult, Settings, Timings, Usage

from . import own_redis


def _used(r: redis.Redis) -> int:
    return int(r.info("memory")["used_memory"])


KEYS = (
    "queued_job_bytes",
    "queued_job_bytes_beyond_text",
    "left_after_taking_bytes_per_job",
    "result_bytes",
    "result_bytes_beyond_text",
    "residue_after_results_taken_bytes_per_job",
)


def _measure(client: Client, r: redis.Redis, jobs: int, text: str, sized: bool) -> dict[str, int]:
    """One batch through the four stages; ``sized``: made with its size known (``expected``,
    as ``vqueue submit FILE`` and ``vqueue serve`` make theirs: compact done marks)."""
    before = _used(r)
    batch = client.submit_many(
        ({"id": f"j{i:07d}", "type": "summarize", "text": text} for i in range(jobs)),
        expected=jobs if sized else None,
    )
    queued = _used(r)
    while r.rpop("bytes:9") is not None:  # taken by workers
        pass
    taken = _used(r)
    for i in range(jobs):
        client.store.start(batch.id, f"j{i:07d}")
        client.store.record(
            JobResult(
                id=f"j{i:07d}", batch=batch.id, type="summarize", status="completed",
                text=text, timings=Timings(enqueued_at=time.time(), finished_at=time.time()),
                usage=Usage(prompt_tokens=60, completion_tokens=50), worker="w@host",
                finish_reason="stop",
            )
        )  # fmt: skip
    recorded = _used(r)
    last = r.xrevrange(client.store.key(batch.id, "results"), count=1)[0][0].decode()
    client.store.take(batch.id, last)
    residue = _used(r)
    per_job, per_result = (queued - before) / jobs, (recorded - taken) / jobs
    got = {
        "queued_job_bytes": round(per_job),
        "queued_job_bytes_beyond_text": round(per_job - len(text)),
        "result_bytes": round(per_result),
        "result_bytes_beyond_text": round(per_result - len(text)),
        "left_after_taking_bytes_per_job": round((taken - before) / jobs),
        "residue_after_results_taken_bytes_per_job": round((residue - before) / jobs),
    }
    client.store.delete(batch.id)
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=20_000)
    ap.add_argument("--text-chars", type=int, default=200)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    text = "x" * a.text_chars
    got: dict[bool, dict[str, int]] = {}
    for sized in (True, False):  # each on a fresh Redis: freed memory would blur the second
        workdir = Path(tempfile.mkdtemp(prefix="vq-redis-bytes-"))
        server, url = own_redis(workdir)
        try:
            r = redis.Redis.from_url(url)
            s = Settings(
                _env_file=None, broker_url=url, queue="bytes", prefix_routing=False,
                feed_window=a.jobs,  # no worker drains it: the whole batch is queued at once
            )  # fmt: skip
            version = str(r.info("server")["redis_version"])
            got[sized] = _measure(Client(s), r, a.jobs, text, sized)
        finally:
            server.kill()
            server.wait()
            shutil.rmtree(workdir, ignore_errors=True)
    sized, unsized = got[True], got[False]
    rows = {
        "jobs": a.jobs,
        "text_chars": a.text_chars,
        **sized,
        "size_unknown": unsized,
        "redis_version": version,
        "command": f"python -m benchmarks.redis_bytes --jobs {a.jobs} --text-chars {a.text_chars}",
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    print(f"{'bytes per job':<44} {'size known':>11} {'unknown':>8}")
    for k in KEYS:
        print(f"{k:<44} {sized[k]:>11} {unsized[k]:>8}")
    out = a.out or Path(__file__).parent / "results" / time.strftime("redis-bytes-%Y-%m-%d.json")
    out.write_text(json.dumps(rows, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
