"""What one job costs in CPU at least, step by step, on the steps no queue design of vqueue's can
skip: the floor under a target of 10,000 jobs/s on 2 cores, where the producer, Redis and the
worker share 0.2 ms of CPU a job.

Each step runs N times in this one thread, on the jobs ``benchmarks/queue_cpu.py`` sends, and
the best of three repeats counts:

- producer: a JSONL line read and checked (``producer.inputs.parse_line``), its envelope made
  and serialized for the wire (``Envelope.wire``, ``protocol.wire.envelope_piece``);
- worker: the envelope of a message checked (anyone may write one to the queue), vLLM's own
  ``SamplingParams`` for the job (``worker.sampling.sampling_params``), the result built, the
  record script's call built (the result serialized) and packed by redis-py for a pipeline;
  and, for scale, all of ``run_job`` on the STUB engine.

Celery's own share at K jobs a message is not measured here: see
``benchmarks/investigations/celery_ceiling.py`` (docs/benchmarks.md has its figures).
Redis's own CPU for the scripts is in ``benchmarks/queue_cpu.py``'s rows.

    .venv/bin/python -m benchmarks.investigations.job_floor [--jobs 20000] [--out FILE]

Prints a table and writes JSON (benchmarks/results/job-floor-<date>.json by default).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
import timeit
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from benchmarks.queue_cpu import job
from benchmarks.stub_engine import StubEngine
from producer.inputs import parse_line
from protocol.store import BatchStore
from protocol.wire import envelope_piece
from schemas import Envelope, JobResult, Settings, Timings, Usage
from schemas.jobs import CHECKED
from worker.runner import run_job
from worker.sampling import sampling_params

ROOT = Path(__file__).resolve().parents[2]


def best_us(step: Callable[[Any], Any], items: list[Any]) -> float:
    """Microseconds a call of ``step`` over ``items``, the best of three passes."""
    runs = timeit.repeat(lambda: [step(x) for x in items], number=1, repeat=3)
    return 1e6 * min(runs) / len(items)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=20_000)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "job-floor-{date}.json"))
    a = ap.parse_args()
    s = Settings(_env_file=None, result_cache=False)
    engine = StubEngine(s)
    lines = [json.dumps(job(i)).encode() for i in range(a.jobs)]
    jobs = [parse_line(n, raw).job for n, raw in enumerate(lines, start=1)]

    def envelope(j: Any) -> str:
        env = Envelope(job=j, batch="floor", enqueued_at=time.time(), line=1)
        return envelope_piece(env)

    envs = [Envelope(job=j, batch="floor", enqueued_at=time.time(), line=1) for j in jobs]
    payloads = [json.loads(e.wire()) for e in envs]
    checked = [Envelope.model_validate(p, context=CHECKED) for p in payloads]
    # never connected: the record's call is built and packed, not sent
    store, conn = BatchStore(redis.Redis(), "floor"), redis.Connection()
    now = time.time()

    def result(env: Envelope) -> JobResult:
        return JobResult(
            id=env.job.id, batch=env.batch, type=env.job.type, status="completed", line=env.line,
            text="stub output", finish_reason="stop", worker="floor@host", model="stub",
            usage=Usage(prompt_tokens=40, completion_tokens=2),
            timings=Timings(enqueued_at=now, started_at=now, first_token_at=now, finished_at=now),
        )  # fmt: skip

    results = [result(e) for e in checked]

    def packed(r: JobResult) -> Any:
        keys, args = store._record_call(r)
        return conn.pack_commands([("EVALSHA", "0" * 40, len(keys), *keys, *args)])

    steps = {
        "producer: line read and checked": best_us(lambda raw: parse_line(1, raw), lines),
        "producer: envelope made and serialized": best_us(envelope, jobs),
        "worker: envelope checked": best_us(
            lambda p: Envelope.model_validate(p, context=CHECKED), payloads
        ),
        "worker: vLLM SamplingParams": best_us(
            lambda e: sampling_params(e.job, e.job.max_tokens or 64), checked
        ),
        "worker: result built": best_us(result, checked),
        "worker: record call built (the result serialized) and packed by redis-py": best_us(
            packed, results
        ),
        "worker: run_job on the STUB engine, whole": best_us(
            lambda e: run_job(e, engine, s, "floor@host"), checked
        ),
    }
    floor = sum(v for k, v in steps.items() if k.startswith("worker:") and "whole" not in k)
    print("| step | µs a job |\n|---|---|")
    for k, v in steps.items():
        print(f"| {k} | {v:.1f} |")
    print(f"| worker's floor, the four steps above run_job | {floor:.1f} |")
    out = Path(a.out.format(date=time.strftime("%Y-%m-%d")))
    out.write_text(
        json.dumps(
            {
                "command": f"python -m benchmarks.investigations.job_floor --jobs {a.jobs}",
                "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "host": {"machine": platform.machine(), "python": platform.python_version()},
                "jobs": a.jobs,
                "us_per_job": steps,
                "worker_floor_us": floor,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
