"""Interactive jobs beside a saturating bulk batch on one worker, by scheduling policy.

    python -m benchmarks.gpu_priority --model /tmp/models/qwen05 --out $OUT/priority

Per policy one worker: ``priority`` (the defaults: urgent jobs through the urgent queue and
urgent process, vLLM's priority scheduling, an urgent request preempting a running bulk one when
no slot is free), ``priority-wait`` (the same without preemption: an urgent request waits for a
slot) or ``fcfs`` (no job urgent, vLLM first come first served: a job's priority orders the
Redis lists alone). On it, the bulk batch
alone (priority 0), then the same batch again with a stream of interactive jobs (priority 9, a
fixed rate) submitted one by one while it runs. Reports bulk jobs/s both ways and the
interactive jobs' TTFT and latency from submission (p50/p99). Writes priority.json after each
run; also runs on a CPU host at a small ``--bulk``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from . import workloads as wl
from .gpu_suite import own_worker, pct, stop


def slowest(us: list[Any], t0_perf: float, n: int = 5) -> list[dict[str, Any]]:
    """The ``n`` interactive jobs with the longest TTFT, stage by stage (seconds): when each came
    (from the bulk batch's start), in Redis, building its prompt until vLLM's frontend took it,
    in the engine's waiting line, prefill; and which process took it. The p99 is one or
    two jobs: these say where they waited."""
    start = time.time() - (time.perf_counter() - t0_perf)  # the batch's start, wall clock

    def gap(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else round(b - a, 4)

    rows = []
    for u in us:
        t = u.timings
        if t.first_token_at is None:
            continue
        rows.append({
            "id": u.id, "ttft_s": round(t.first_token_at - t.enqueued_at, 4),
            "came_s": round(t.enqueued_at - start, 3),
            "in_redis_s": gap(t.enqueued_at, t.started_at),
            "prompt_s": gap(t.started_at, t.sent_at),
            "into_vllm_s": gap(t.sent_at, t.submitted_at),
            "engine_wait_s": gap(t.submitted_at, t.scheduled_at),
            "prefill_s": gap(t.scheduled_at, t.first_token_at), "worker": u.worker,
        })  # fmt: skip
    return sorted(rows, key=lambda r: -r["ttft_s"])[:n]


def run(a: argparse.Namespace, policy: str, t: wl.TextMaker) -> list[dict[str, Any]]:
    env = dict(VQUEUE_MAX_MODEL_LEN="4096", VQUEUE_SCHEDULING_POLICY=policy.split("-")[0])
    if policy == "priority-wait":
        env["VQUEUE_URGENT_PREEMPT"] = "false"
    if policy == "fcfs":
        env.update(VQUEUE_URGENT_PRIORITY="10", VQUEUE_URGENT_CONCURRENCY="0")
    if a.kv_cache_bytes:
        env["VQUEUE_KV_CACHE_MEMORY_BYTES"] = str(a.kv_cache_bytes)
    log = Path(a.out) / f"worker-{policy}.log"
    proc, fh, start_s, client, _ = own_worker("prio", a.model, a.redis, log, "-l", "WARNING", **env)
    if policy == "fcfs":  # the producer sends nothing to the urgent queue either
        client = type(client)(client.settings.model_copy(update={"urgent_priority": 10}))
    out_tokens = {"max_tokens": 128, "min_tokens": 128, "ignore_eos": True}

    def bulk() -> list[dict[str, Any]]:  # fresh texts each run: nothing cached by the last
        return [
            {"id": f"b{i}", "type": "summarize", "priority": 0, "text": t.tokens(500), **out_tokens}
            for i in range(a.bulk)
        ]

    rows = []
    try:
        deadline = time.monotonic() + 180  # the urgent process joins once the engine is up
        while policy != "fcfs" and time.monotonic() < deadline:
            if any(w.get("urgent") for w in client.store.workers()):
                break
            time.sleep(1)
        list(client.submit_many(bulk()[: min(64, a.bulk)]).results(timeout=600))  # warm
        # what the engine runs with (urgent_order: None when urgent jobs never preempt)
        plan = next((w["engine"] for w in client.store.workers() if w.get("engine")), {})
        for rnd, stream in [(r, x) for r in range(1, a.rounds + 1) for x in (False, True)]:
            done = threading.Event()
            urgent: list[Any] = []

            def interactive(done: threading.Event, urgent: list[Any]) -> None:
                k = 0
                while not done.is_set():
                    job = {
                        "id": f"u{k}",
                        "type": "summarize",
                        "priority": 9,
                        "text": t.tokens(200),
                        "max_tokens": 64,
                        "min_tokens": 64,
                        "ignore_eos": True,
                    }
                    urgent.append((job["id"], client.submit(job)))
                    k += 1
                    done.wait(1 / a.rate)

            th = threading.Thread(target=interactive, args=(done, urgent), daemon=True)
            jobs = bulk()  # built before the clock starts
            t0 = time.perf_counter()
            batch = client.submit_many(jobs)
            if stream:
                th.start()
            res = list(batch.results(timeout=a.timeout))
            wall = time.perf_counter() - t0
            done.set()
            if stream:
                th.join()
            us = [b.result(i, timeout=a.timeout) for i, b in urgent]
            ttft = [
                u.timings.first_token_at - u.timings.enqueued_at
                for u in us
                if u.timings.first_token_at
            ]
            lat = [(u.timings.finished_at or 0) - u.timings.enqueued_at for u in us]
            # where an interactive job's time to first token goes: in Redis until a task thread
            # takes it, then in the worker (prompt, engine) until its first token
            fetched = [
                (u.timings.started_at or u.timings.enqueued_at) - u.timings.enqueued_at for u in us
            ]
            inside = [
                u.timings.first_token_at - (u.timings.started_at or u.timings.enqueued_at)
                for u in us
                if u.timings.first_token_at
            ]
            row = {
                "policy": policy,
                "round": rnd,
                "interactive_stream": stream,
                "bulk_jobs": len(res),
                "bulk_failed": sum(r.status != "completed" for r in res),
                "bulk_wall_s": wall,
                "bulk_jobs_per_s": len(res) / wall,
                "interactive_jobs": len(us),
                "interactive_rate_per_s": a.rate if stream else 0,
                "ttft_p50_s": pct(ttft, 50),
                "ttft_p99_s": pct(ttft, 99),
                "latency_p50_s": pct(lat, 50),
                "latency_p99_s": pct(lat, 99),
                "in_redis_p50_s": pct(fetched, 50),
                "in_redis_p99_s": pct(fetched, 99),
                "taken_to_first_token_p50_s": pct(inside, 50),
                "taken_to_first_token_p99_s": pct(inside, 99),
                "taken_by_urgent_process": sum("-urgent@" in (u.worker or "") for u in us),
                "slowest": slowest(us, t0),
                "worker_start_s": start_s,
                "urgent_order": plan.get("urgent_order"),
                "engine_missing": plan.get("missing"),
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
    finally:
        stop(proc, fh, 120)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--bulk", type=int, default=2000)
    ap.add_argument("--rate", type=float, default=2.0, help="interactive jobs per second")
    ap.add_argument("--policies", default="priority,priority-wait,fcfs")
    ap.add_argument(
        "--rounds", type=int, default=1, help="bulk alone, then with the stream, this many times"
    )
    ap.add_argument("--kv-cache-bytes", type=int, default=0)
    ap.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--timeout", type=float, default=600)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t = wl.TextMaker.of_model(a.model)
    rows: list[dict[str, Any]] = []
    for policy in a.policies.split(","):
        rows += run(a, policy, t)
        (out / "priority.json").write_text(json.dumps(rows, indent=2))
    print(
        "| policy | interactive stream | bulk jobs/s | interactive jobs | TTFT p50 / p99 s | "
        "latency p50 / p99 s |\n|---|---|---|---|---|---|"
    )
    for r in rows:

        def f(x: float | None) -> str:
            return "-" if x is None else f"{x:.2f}"

        print(
            f"| {r['policy']} | {r['interactive_rate_per_s']:g}/s | {r['bulk_jobs_per_s']:.1f} | "
            f"{r['interactive_jobs']} | {f(r['ttft_p50_s'])} / {f(r['ttft_p99_s'])} | "
            f"{f(r['latency_p50_s'])} / {f(r['latency_p99_s'])} |"
        )
    # bulk with the stream against bulk alone, round by round (each pair back to back)
    for policy in a.policies.split(","):
        pairs = [
            (x["bulk_jobs_per_s"], y["bulk_jobs_per_s"])
            for x in rows
            for y in rows
            if x["policy"] == y["policy"] == policy
            and x["round"] == y["round"]
            and not x["interactive_stream"]
            and y["interactive_stream"]
        ]
        if pairs:
            kept = statistics.median(b / a_ for a_, b in pairs)
            print(f"{policy}: bulk kept {kept:.1%} of its throughput with the stream "
                  f"(median of {len(pairs)} paired rounds)")  # fmt: skip


if __name__ == "__main__":
    main()
