"""How many jobs a second stock Celery takes off Redis on this host when the task does nothing:
the ceiling under vqueue's queue path while each job is one message, and what it becomes when
one message carries many jobs (issue 39's target: 10,000 jobs/s on 2 cores).

No vqueue worker runs here: a plain Celery app (stock kombu, none of vqueue's patches, task
events off, the threads pool) consumes the messages ``protocol.wire`` writes, as producers
write them, with a task that returns at once. ``--per-message K`` puts K envelopes in each
message's arguments (the task loops over them, doing nothing), so a row shows what Celery's own
per-message cost leaves per job; vqueue's own per-job work (start check, ``run_job``, record)
comes on top (``benchmarks/queue_cpu.py``'s "a job past Celery").

    .venv/bin/python -m benchmarks.investigations.celery_ceiling [--jobs 20000] \
        [--per-message 1,4,16,64]

Prints a table and writes JSON (benchmarks/results/celery-ceiling-<date>.json by default).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from celery import Celery

ROOT = Path(__file__).resolve().parents[2]
QUEUE = "ceiling"

app = Celery("ceiling", broker=os.environ.get("CEILING_BROKER", "redis://127.0.0.1:6379/0"))
app.conf.update(
    # the priority lists producers write (protocol.wire): configuration, not a patch
    broker_transport_options={
        "sep": ":",
        "priority_steps": list(range(10)),
        "queue_order_strategy": "priority",
    },
    task_acks_late=True,
    worker_prefetch_multiplier=8,
    worker_send_task_events=False,
    task_ignore_result=True,
)


@app.task(name="vqueue.summarize", bind=True, ignore_result=True)  # the jobs' task name
def _noop(self: Any, payload: Any) -> None:
    for _ in payload if isinstance(payload, list) else (payload,):
        pass


def messages(n_jobs: int, per_message: int) -> list[tuple[str, str]]:
    """(Redis list, message JSON) pairs holding ``n_jobs`` envelopes, ``per_message`` each."""
    from protocol.wire import task_message
    from schemas import Envelope

    envs = [
        Envelope.model_validate(
            {
                "job": {"id": f"j{i}", "type": "summarize", "text": f"Ticket {i}: the invoice "
                        "total is wrong; the customer asks for a corrected copy."},
                "batch": "ceiling",
                "enqueued_at": time.time(),
            }
        )
        for i in range(n_jobs)
    ]  # fmt: skip
    out = []
    for start in range(0, n_jobs, per_message):
        chunk = envs[start : start + per_message]
        key, raw = task_message(chunk[0], QUEUE)
        if per_message > 1:  # one argument: the list of envelopes
            msg = json.loads(raw)
            wires = ",".join(e.wire() for e in chunk)
            msg["body"] = msg["body"].replace(f"[[{chunk[0].wire()}]", f"[[[{wires}]]", 1)
            raw = json.dumps(msg, separators=(",", ":"))
        out.append((key, raw))
    return out


def run(url: str, n_jobs: int, per_message: int, concurrency: int) -> dict[str, Any]:
    import redis

    from benchmarks.gpu_suite import CpuTree

    r = redis.Redis.from_url(url)
    r.flushdb()
    msgs = messages(n_jobs, per_message)
    pipe = r.pipeline(transaction=False)
    for key, raw in msgs:
        pipe.lpush(key, raw)
    pipe.execute()
    env = dict(os.environ, CEILING_BROKER=url, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "benchmarks.investigations.celery_ceiling",
         "worker", "--pool", "threads", "--concurrency", str(concurrency), "-Q", QUEUE,
         "--without-mingle", "--without-gossip", "--without-heartbeat", "-l", "WARNING"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    keys = [QUEUE] + [f"{QUEUE}:{s}" for s in range(1, 10)]

    def left() -> int:
        p = r.pipeline(transaction=False)
        for k in keys:
            p.llen(k)
        p.hlen("unacked")
        return int(sum(p.execute()))

    try:
        tree = CpuTree(proc.pid)
        while left() == len(msgs):  # the clock starts at the first message taken
            if proc.poll() is not None:
                raise RuntimeError("the Celery worker exited")
            time.sleep(0.005)
        before, t = tree.snapshot(), time.perf_counter()
        while left():
            time.sleep(0.01)
        wall = time.perf_counter() - t
        used = tree.between(before, tree.snapshot(), None)
    finally:
        proc.terminate()
        proc.wait(30)
        r.flushdb()
    cpu = used["cpu_s_engine_core"] + used["cpu_s_other"]
    return {
        "jobs": n_jobs,
        "per_message": per_message,
        "messages": len(msgs),
        "concurrency": concurrency,
        "wall_s": wall,
        "jobs_per_s": n_jobs / wall,
        "messages_per_s": len(msgs) / wall,
        "worker_cpu_us_per_job": 1e6 * cpu / n_jobs,
        "worker_cpu_us_per_message": 1e6 * cpu / len(msgs),
        "host_cores_busy": used["host_cores_busy"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=20000)
    ap.add_argument("--per-message", default="1,4,16,64")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from benchmarks import own_redis

    server, url = own_redis()
    try:
        rows = [run(url, a.jobs, int(k), a.concurrency) for k in a.per_message.split(",")]
    finally:
        server.terminate()
    print("| jobs per message | jobs/s | messages/s | worker CPU per job | host cores busy |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['per_message']} | {row['jobs_per_s']:,.0f} | {row['messages_per_s']:,.0f} | "
            f"{row['worker_cpu_us_per_job']:.0f} µs | {row['host_cores_busy']:.1f} |"
        )
    res = {
        "code": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip(),
        "device": f"this host, {os.cpu_count()} cores, Redis of the run's own on loopback",
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "host": platform.node(),
        "command": "python -m benchmarks.investigations.celery_ceiling " + " ".join(sys.argv[1:]),
        "rows": rows,
        "note": "stock Celery and kombu, a task that does nothing per job: Celery's own ceiling, "
        "before any of vqueue's per-job work",
    }  # fmt: skip
    out = Path(
        a.out
        or ROOT / "benchmarks" / "results" / f"celery-ceiling-{time.strftime('%Y-%m-%d')}.json"
    )
    out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
