"""The queue's own speed on a CPU host, no GPU and no model.

1. Submit rate: jobs/s from the producer into Redis (pipelined), through the Python client and
   through ``vqueue submit`` on a JSONL file (parsing and validation included); no worker runs.
2. Queue overhead: a real Celery worker process whose engine is an instant STUB
   (``benchmarks/stub_engine.py``), so the time per job is the queue path alone: publish,
   delivery, task dispatch, prompt building, result recording, result streaming; and the CPU
   it took per job, by process (the worker's, the producer's, Redis's).
3. A job past Celery: the worker's own per-job work (envelope, start check, ``run_job``,
   record) in one thread on the same STUB engine, by part: what a worker would still pay per
   job if Celery cost nothing.

    .venv/bin/python -m benchmarks.queue_cpu [--jobs 50000] [--stub-jobs 5000] \
        [--per-message 1,16]   # its own Redis

``--per-message`` runs the queue path once per value of ``VQUEUE_JOBS_PER_MESSAGE`` (producer
and worker alike): the same jobs, as one message each or packed.

Prints a table and writes JSON (benchmarks/results/queue-cpu-<date>.json by default).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import redis

from benchmarks import own_redis
from producer import Client
from protocol.wire import queue_keys
from schemas import Settings

ROOT = Path(__file__).resolve().parent.parent


def job(i: int) -> dict:
    return {
        "id": f"j{i}",
        "type": "summarize",
        "max_tokens": 64,
        "text": f"Ticket {i}: the customer reports that the invoice total is wrong and asks "
        f"for a corrected copy before Friday. Order number {i * 7}.",
    }


def settings(url: str, queue: str) -> Settings:
    return Settings(_env_file=None, broker_url=url, queue=queue, key_prefix="vqbench")


def submit_rate(url: str, n: int) -> dict:
    r = redis.Redis.from_url(url)
    r.flushdb()
    # no worker drains this queue: a feed window of the whole batch, or submit waits for room
    client = Client(settings(url, "bench-submit").model_copy(update={"feed_window": n}))
    jobs = [job(i) for i in range(n)]
    t = time.perf_counter()
    batch = client.submit_many(jobs)
    py_s = time.perf_counter() - t
    # exact to DEPTH_READ messages a list, estimated past it: the batch's own count is exact
    assert client.batch(batch.id).status().total == n, n
    r.delete(*queue_keys("bench-submit"))
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as fh:
        for j in jobs:
            fh.write(json.dumps(j) + "\n")
    env = dict(
        os.environ,
        VQUEUE_BROKER_URL=url,
        VQUEUE_QUEUE="bench-submit",
        VQUEUE_KEY_PREFIX="vqbench",
        VQUEUE_FEED_WINDOW=str(n),
    )
    t = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "producer.cli", "submit", fh.name, "-q"],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    cli_s = time.perf_counter() - t
    assert client.batch(done.stdout.strip()).status().total == n, n
    r.flushdb()
    os.unlink(fh.name)
    return {
        "jobs": n,
        "batch": batch.id,
        "python_client_s": py_s,
        "python_client_jobs_per_s": n / py_s,
        "cli_s": cli_s,
        "cli_jobs_per_s": n / cli_s,
    }


@contextlib.contextmanager
def stub_worker(
    url: str, queue: str, concurrency: int = 64, per_message: int = 1
) -> Iterator[subprocess.Popen]:
    """A real ``vqueue worker`` process on the STUB engine consuming ``queue``, once it has
    registered; stopped on leaving. Its log: benchmarks/results/stub-worker.log.tmp."""
    env = dict(
        os.environ,
        VQUEUE_BROKER_URL=url,
        VQUEUE_QUEUE=queue,
        VQUEUE_RESULT_CACHE="false",
        VQUEUE_KEY_PREFIX="vqbench",
        VQUEUE_ENGINE_CLASS="benchmarks.stub_engine:StubEngine",
        VQUEUE_CONCURRENCY=str(concurrency),
        VQUEUE_HEARTBEAT_S="1",
        VQUEUE_JOBS_PER_MESSAGE=str(per_message),
    )
    log = open(ROOT / "benchmarks" / "results" / "stub-worker.log.tmp", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "producer.cli", "worker", "-n", "stub@bench", "-l", "WARNING"],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    r = redis.Redis.from_url(url)
    try:
        deadline = time.time() + 120
        while not r.exists("vqbench:worker:stub@bench"):
            if time.time() > deadline or proc.poll() is not None:
                raise RuntimeError(
                    "stub worker did not start; see benchmarks/results/stub-worker.log.tmp"
                )
            time.sleep(0.2)
        yield proc
    finally:
        proc.terminate()
        proc.wait(60)
        log.close()


def stub_overhead(
    url: str, n: int, concurrency: int, redis_pid: int | None = None, per_message: int = 1
) -> dict:
    """The queue path end to end, and where its CPU went per job from the first submit to the
    last result read: the worker's processes, this producer, and Redis (``redis_pid``)."""
    from .gpu_suite import CpuTree

    r = redis.Redis.from_url(url)
    r.flushdb()
    try:
        with stub_worker(url, "bench-stub", concurrency, per_message) as proc:
            s = settings(url, "bench-stub").model_copy(update={"jobs_per_message": per_message})
            client = Client(s)
            trees = {"worker": CpuTree(proc.pid)}
            if redis_pid:
                trees["redis"] = CpuTree(redis_pid)
            before = {k: v.snapshot() for k, v in trees.items()}
            mine = time.process_time()
            t = time.perf_counter()
            batch = client.submit_many(job(i) for i in range(n))
            submitted = time.perf_counter() - t
            results = list(batch.results(timeout=600))
            wall = time.perf_counter() - t
            cpu = {"producer": time.process_time() - mine}
            for k, tree in trees.items():
                used = tree.between(before[k], tree.snapshot(), None)
                cpu[k] = used["cpu_s_engine_core"] + used["cpu_s_other"]
                host = used["host_cores_busy"]
    finally:
        r.flushdb()
    assert len(results) == n and all(x.status == "completed" for x in results)
    queue_wait = sorted((x.timings.started_at or 0) - x.timings.enqueued_at for x in results)
    return {
        "jobs": n,
        "concurrency": concurrency,
        "jobs_per_message": per_message,
        "wall_s": wall,
        "submit_s": submitted,
        "jobs_per_s": n / wall,
        "overhead_ms_per_job": 1000 * wall / n,
        "queue_wait_p50_s": queue_wait[n // 2],
        "cpu_ms_per_job": {k: 1e3 * v / n for k, v in cpu.items()},
        "host_cores_busy": host,
    }


def task_path(url: str, n: int) -> dict:
    """What one job costs a worker past Celery, in one thread on the same STUB engine: the
    envelope parsed, the start check, ``run_job``, the record. Celery's own share of the queue
    path is the rest (message pop, unacknowledged record, dispatch to a thread, ack)."""
    from protocol.store import BatchStore
    from schemas.jobs import CHECKED, Envelope
    from worker.runner import run_job

    from .stub_engine import StubEngine

    r = redis.Redis.from_url(url, decode_responses=True)  # as the worker's store reads it
    r.flushdb()
    s = settings(url, "bench-task").model_copy(update={"result_cache": False})
    store, engine = BatchStore(r, s.key_prefix), StubEngine(s)
    payloads = [{"job": job(i), "batch": "task-path", "enqueued_at": time.time()} for i in range(n)]
    store.claim("task-path", [(p["job"]["id"], None) for p in payloads])
    parts = dict.fromkeys(("parse", "start", "run_job", "record"), 0.0)
    cpu, t = time.process_time(), time.perf_counter()
    for p in payloads:
        t0 = time.perf_counter()
        env = Envelope.model_validate(p, context=CHECKED)
        t1 = time.perf_counter()
        _, attempts, _ = store.start(env.batch, env.job.id)
        t2 = time.perf_counter()
        result = run_job(env, engine, s, "task-path", None, None)
        result.deliveries = attempts
        t3 = time.perf_counter()
        store.record(result)
        t4 = time.perf_counter()
        for k, dt in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            parts[k] += dt
    wall, cpu = time.perf_counter() - t, time.process_time() - cpu
    st = store.status("task-path")
    assert st is not None and st.completed == n, st
    r.flushdb()
    return {
        "jobs": n,
        "jobs_per_s": n / wall,
        "us_per_job": 1e6 * wall / n,
        "cpu_us_per_job": 1e6 * cpu / n,
        "us_per_job_by_part": {k: 1e6 * v / n for k, v in parts.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=50_000)
    ap.add_argument("--stub-jobs", type=int, default=5_000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--per-message", default="1", help="VQUEUE_JOBS_PER_MESSAGE values, a row each")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "queue-cpu-{date}.json"))
    a = ap.parse_args()
    a.out = a.out.format(date=time.strftime("%Y-%m-%d"))
    server, url = own_redis()
    try:
        res = measure(a, url, server.pid)
    finally:
        server.kill()
        server.wait()
    Path(a.out).write_text(json.dumps(res, indent=2))
    report(res, a.out)


def measure(a: argparse.Namespace, url: str, redis_pid: int | None = None) -> dict:
    return {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "command": " ".join(["python -m benchmarks.queue_cpu", *sys.argv[1:]]),
        "submit": submit_rate(url, a.jobs),
        "stub_workers": [
            stub_overhead(url, a.stub_jobs, a.concurrency, redis_pid, int(k))
            for k in str(a.per_message).split(",")
        ],
        "task_path": task_path(url, a.stub_jobs),
    }


def report(res: dict, out: str) -> None:
    s, tp = res["submit"], res["task_path"]
    by_part = ", ".join(f"{k} {v:.0f}" for k, v in tp["us_per_job_by_part"].items())
    rows = [
        (
            "submit, Python client",
            f"{s['jobs']} jobs",
            f"{s['python_client_jobs_per_s']:,.0f} jobs/s",
        ),
        (
            "submit, `vqueue submit` JSONL",
            f"{s['jobs']} lines",
            f"{s['cli_jobs_per_s']:,.0f} jobs/s",
        ),
    ]
    for w in res["stub_workers"]:
        rows += [
            (
                "queue path, STUB engine",
                f"{w['jobs']} jobs, {w['concurrency']} threads, {w['jobs_per_message']} a message",
                f"{w['jobs_per_s']:,.0f} jobs/s = {w['overhead_ms_per_job']:.2f} ms/job",
            ),
            (
                "queue path, CPU by process",
                f"{w['host_cores_busy']:.1f} of {res['cpus']} cores busy",
                ", ".join(f"{k} {v:.2f}" for k, v in w["cpu_ms_per_job"].items()) + " ms/job",
            ),
        ]
    rows += [
        (
            "a job past Celery, one thread, STUB engine",
            f"{tp['jobs']} jobs",
            f"{tp['jobs_per_s']:,.0f} jobs/s = {tp['us_per_job']:.0f} µs/job "
            f"({tp['cpu_us_per_job']:.0f} µs CPU; µs: {by_part})",
        ),
    ]
    print("| measure | size | result |\n|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
