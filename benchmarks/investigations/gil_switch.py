"""Worker intake beside a busy engine loop, by the GIL's switch interval (``VQUEUE_GIL_SWITCH_MS``).

    .venv/bin/python -m benchmarks.investigations.gil_switch [--jobs 1000] [--intervals 5,1,0.25]

A real Celery worker process whose engine is an instant STUB that also runs one CPU-bound Python
thread, standing in for vLLM's frontend loop (input and output processing, in the worker's own
interpreter), so the jobs/s it takes in is the queue path under GIL contention, nothing else.
Python's default interval is 5 ms. Prints a table and writes
benchmarks/results/gil-switch-<date>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from benchmarks.stub_engine import StubEngine
from schemas import Settings

ROOT = Path(__file__).resolve().parent.parent


class BusyStubEngine(StubEngine):
    """STUB engine plus a thread that computes in Python without pause, as vLLM's frontend loop
    does under load."""

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        threading.Thread(target=self._spin, name="busy-loop", daemon=True).start()

    @staticmethod
    def _spin() -> None:
        x = 0
        while True:
            for i in range(10_000):
                x += i


def run(url: str, interval_ms: float, n: int) -> dict[str, Any]:
    from producer import Client
    from protocol.store import BatchStore

    tag = uuid.uuid4().hex[:8]
    s = Settings(_env_file=None, broker_url=url, queue=f"gil-{tag}", key_prefix=f"gil-{tag}")
    env = dict(
        os.environ,
        VQUEUE_BROKER_URL=url,
        VQUEUE_QUEUE=s.queue,
        VQUEUE_KEY_PREFIX=s.key_prefix,
        VQUEUE_ENGINE_CLASS="benchmarks.investigations.gil_switch:BusyStubEngine",
        VQUEUE_CONCURRENCY="256",
        VQUEUE_HEARTBEAT_S="1",
        VQUEUE_METRICS_PORT="0",
        VQUEUE_GIL_SWITCH_MS=str(interval_ms),
    )
    store = BatchStore.from_settings(s)
    argv = [sys.executable, "-m", "producer.cli", "worker", "-n", f"gil-{tag}@bench", "-l", "ERROR"]
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while not store.workers():
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError("the stub worker did not start")
            time.sleep(0.2)
        jobs = [
            {"id": f"j{i}", "type": "summarize", "max_tokens": 64, "text": "word " * 400}
            for i in range(n)
        ]
        t = time.perf_counter()
        res = list(Client(s).submit_many(jobs).results(timeout=900))
        wall = time.perf_counter() - t
        waits = sorted((r.timings.started_at or 0) - r.timings.enqueued_at for r in res)
        return {
            "switch_interval_ms": interval_ms,
            "jobs": n,
            "wall_s": wall,
            "jobs_per_s": n / wall,
            "queue_wait_p50_s": waits[n // 2],
        }
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=1000)
    ap.add_argument("--intervals", default="5,1,0.25")
    ap.add_argument(
        "--redis", default=os.environ.get("VQUEUE_BENCH_REDIS", "redis://127.0.0.1:6379/14")
    )
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    rows = [run(a.redis, float(x), a.jobs) for x in a.intervals.split(",")]
    print("| switch interval | jobs | jobs/s | queue wait p50 s |\n|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['switch_interval_ms']:g} ms | {r['jobs']} | {r['jobs_per_s']:.0f} | "
            f"{r['queue_wait_p50_s']:.2f} |"
        )
    date = time.strftime("%Y-%m-%d")
    out = Path(a.out or ROOT / "benchmarks" / "results" / f"gil-switch-{date}.json")
    doc = {
        "date": date,
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "command": " ".join(["python -m benchmarks.investigations.gil_switch", *sys.argv[1:]]),
        "rows": rows,
    }
    out.write_text(json.dumps(doc, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
