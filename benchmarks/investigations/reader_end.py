"""How long after a batch's last job finishes its reader has every result and stops.

A real Celery worker on the instant STUB engine (``benchmarks/stub_engine.py``) and a Redis of
the run's own: small batches, each submitted and read to its end with ``Batch.results``; for
each, the wall clock from the last job's ``finished_at`` (the worker's stamp) to the reader's
return. On the GPU suite's short rounds this gap is part of vqueue's wall and not of raw vLLM's.

    .venv/bin/python -m benchmarks.investigations.reader_end [--sizes 20,200,2000] [--reps 8]

Prints a table and writes JSON (benchmarks/results/reader-end-<date>.json by default);
``--label`` names the run inside it, and runs with other labels already in the file stay.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from benchmarks import own_redis
from benchmarks.queue_cpu import job, settings, stub_worker
from producer import Client

ROOT = Path(__file__).resolve().parents[2]


def measure(url: str, sizes: list[int], reps: int) -> list[dict]:
    rows = []
    with stub_worker(url, "bench-end"):
        client = Client(settings(url, "bench-end"))
        for n in sizes:
            gaps = []
            for _ in range(reps):
                batch = client.submit_many(job(i) for i in range(n))
                res = list(batch.results(timeout=120))
                end = time.time()
                assert len(res) == n
                gaps.append(end - max(x.timings.finished_at or 0 for x in res))
                del res  # freeing a batch's results takes milliseconds: not in the next clock
            rows.append({
                "jobs": n,
                "reps": reps,
                "end_after_last_ms_p50": 1e3 * statistics.median(gaps),
                "end_after_last_ms_max": 1e3 * max(gaps),
            })  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="20,200,2000")
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--label", default="main")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/reader-end-{date}.json"))
    a = ap.parse_args()
    out = Path(a.out.format(date=time.strftime("%Y-%m-%d")))
    server, url = own_redis()
    try:
        rows = measure(url, [int(x) for x in a.sizes.split(",")], a.reps)
    finally:
        server.kill()
        server.wait()
    doc = json.loads(out.read_text()) if out.exists() else {"runs": {}}
    doc["runs"][a.label] = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "cpus": os.cpu_count(),
        "command": " ".join(["python -m benchmarks.investigations.reader_end", *sys.argv[1:]]),
        "rows": rows,
    }
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print("| run | jobs | reader done after the last job, p50 | max |")
    print("|---|---|---|---|")
    for label, run in doc["runs"].items():
        for x in run["rows"]:
            print(f"| {label} | {x['jobs']} | {x['end_after_last_ms_p50']:.1f} ms "
                  f"| {x['end_after_last_ms_max']:.1f} ms |")  # fmt: skip
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
