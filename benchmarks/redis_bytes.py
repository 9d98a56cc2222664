"""What a queued job and a stored result cost in Redis memory, beyond their own text.

Starts a private ``redis-server``, submits N summarize jobs (the producer's real path: the
batch hash, the job's mark, Celery's message in its list), reads ``used_memory``, then takes
the messages off their list as a worker would, starts each job (``BatchStore.start``: its
delivery count) and records one result per job through ``BatchStore.record`` (the worker's real
script: the results stream, the done marks, the counters), and reads it again; last, a taking
reader removes every result from the stream (``BatchStore.take``), and what stays is the
residue a finished job leaves until the TTL. It does so three times, each on a fresh Redis: a
file fed by ``vqueue submit FILE`` (its jobs known by their lines, as ``vqueue serve``'s uploads
are: a bit each once done), and ``Client.submit_many`` batches known by id, made with their
size known (done marks in compact parts) and without (one hash). Nothing else runs against
that Redis.

    python -m benchmarks.redis_bytes [--jobs 20000] [--text-chars 200] [--out FILE]

Prints a table and writes JSON (benchmarks/results/redis-bytes-<date>.json by default).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

from producer import Client
from schemas import JobResult, Settings, Timings, Usage

from . import own_redis


def _used(r: redis.Redis) -> int:
    return int(r.info("memory")["used_memory"])


MODES = ("fed", "sized", "unsized")
KEYS = (
    "queued_job_bytes",
    "queued_job_bytes_beyond_text",
    "left_after_taking_bytes_per_job",
    "result_bytes",
    "result_bytes_beyond_text",
    "residue_after_results_taken_bytes_per_job",
)


def _fed(url: str, jobs: int, text: str, workdir: Path) -> str:
    """A batch fed from its own file by ``vqueue submit FILE`` (its jobs known by their lines);
    its id."""
    path = workdir / "jobs.jsonl"
    with path.open("w") as fh:
        for i in range(jobs):
            fh.write(json.dumps({"id": f"j{i:07d}", "type": "summarize", "text": text}) + "\n")
    env = dict(os.environ, VQUEUE_BROKER_URL=url, VQUEUE_QUEUE="bytes",
               VQUEUE_PREFIX_ROUTING="false", VQUEUE_FEED_WINDOW=str(jobs))  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-m", "producer.cli", "submit", str(path), "--json", "-q"],
        env=env, capture_output=True, text=True, check=True, cwd=Path(__file__).parent.parent,
    )  # fmt: skip
    return str(json.loads(out.stdout)["batch"])


def _measure(
    client: Client, r: redis.Redis, jobs: int, text: str, mode: str, workdir: Path
) -> dict[str, int]:
    """One batch through the four stages. ``mode``: ``fed``, a file fed by ``vqueue submit
    FILE`` (each job known by its line: a bit once done); ``sized``, a ``Client`` batch made
    with its size known (``expected``: compact done marks by id); ``unsized``, one without."""
    before = _used(r)
    if mode == "fed":
        batch_id = _fed(str(client.settings.broker_url), jobs, text, workdir)
    else:
        batch_id = client.submit_many(
            ({"id": f"j{i:07d}", "type": "summarize", "text": text} for i in range(jobs)),
            expected=jobs if mode == "sized" else None,
        ).id
    line = (lambda i: i + 1) if mode == "fed" else (lambda i: None)
    queued = _used(r)
    while r.rpop("bytes:9") is not None:  # taken by workers
        pass
    taken = _used(r)
    for i in range(jobs):
        client.store.start(batch_id, f"j{i:07d}", line(i))
        client.store.record(
            JobResult(
                id=f"j{i:07d}", batch=batch_id, type="summarize", status="completed",
                text=text, timings=Timings(enqueued_at=time.time(), finished_at=time.time()),
                usage=Usage(prompt_tokens=60, completion_tokens=50), worker="w@host",
                finish_reason="stop", line=line(i),
            )
        )  # fmt: skip
    recorded = _used(r)
    last = r.xrevrange(client.store.key(batch_id, "results"), count=1)[0][0].decode()
    client.store.take(batch_id, last)
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
    client.store.delete(batch_id)
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=20_000)
    ap.add_argument("--text-chars", type=int, default=200)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    got: dict[str, dict[str, int]] = {}
    for mode in MODES:  # each on a fresh Redis: freed memory would blur the next
        workdir = Path(tempfile.mkdtemp(prefix="vq-redis-bytes-"))
        server, url = own_redis(workdir)
        try:
            r = redis.Redis.from_url(url)
            s = Settings(
                _env_file=None, broker_url=url, queue="bytes", prefix_routing=False,
                feed_window=a.jobs,  # no worker drains it: the whole batch is queued at once
            )  # fmt: skip
            version = str(r.info("server")["redis_version"])
            got[mode] = _measure(Client(s), r, a.jobs, a.text_chars * "x", mode, workdir)
        finally:
            server.kill()
            server.wait()
            shutil.rmtree(workdir, ignore_errors=True)
    rows = {
        "jobs": a.jobs,
        "text_chars": a.text_chars,
        **got["sized"],
        "size_unknown": got["unsized"],
        "fed_from_its_file": got["fed"],
        "redis_version": version,
        "command": f"python -m benchmarks.redis_bytes --jobs {a.jobs} --text-chars {a.text_chars}",
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    print(f"{'bytes per job':<44} {'fed file':>9} {'size known':>11} {'unknown':>8}")
    for k in KEYS:
        print(f"{k:<44} {got['fed'][k]:>9} {got['sized'][k]:>11} {got['unsized'][k]:>8}")
    out = a.out or Path(__file__).parent / "results" / time.strftime("redis-bytes-%Y-%m-%d.json")
    out.write_text(json.dumps(rows, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
