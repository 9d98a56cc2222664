"""Prefix routing against one shared queue, on two engines: many distinct long prefixes.

    python -m benchmarks.gpu_routing --model /tmp/models/qwen05 --out $OUT/routing

Two workers on one queue (two engines on one GPU, each with part of its memory, where the host
has one GPU). Each round builds a fresh workload of ``--prefixes`` preambles of
``--prefix-tokens`` tokens and ``--jobs`` short questions spread over them, shuffled, every
answer exactly ``--out-tokens`` long, and runs it twice: routed (producers send a job to the
worker its prefix key hashes to, the default) and shared (every job on the shared queue, taken
by whichever worker asks first), in alternating order. Both runs of a round have the same
lengths but different texts, so neither finds the other's prefixes cached. Reports per run
jobs/s, the share of prompt tokens served from the prefix cache (results' ``cached_tokens``)
and the jobs each worker took; the ratio routed/shared is taken per round and its median is the
figure. ``--kv-cache-bytes`` sizes each engine's KV cache, so a run can set a cache that holds
half the preambles but not all of them. Writes routing.json after each run.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from schemas import Settings

from . import workloads as wl
from .gpu_suite import launch_worker, stop, worker_env


def workload(t: wl.TextMaker, a: argparse.Namespace, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    preambles = [t.tokens(a.prefix_tokens) for _ in range(a.prefixes)]
    jobs = [
        {
            "id": f"j{i}",
            "type": "chat",
            "messages": [
                {"role": "system", "content": preambles[i % a.prefixes]},
                {"role": "user", "content": t.tokens(a.question_tokens)},
            ],
            **wl.fixed(a.out_tokens),
        }
        for i in range(a.jobs)
    ]
    rng.shuffle(jobs)
    return jobs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--prefixes", type=int, default=64)
    ap.add_argument("--prefix-tokens", type=int, default=2000)
    ap.add_argument("--question-tokens", type=int, default=50)
    ap.add_argument("--jobs", type=int, default=4000)
    ap.add_argument("--out-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.45)
    ap.add_argument("--kv-cache-bytes", type=int, default=0)
    ap.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--timeout", type=float, default=600)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t = wl.TextMaker.of_model(a.model)
    tag = f"routing-{uuid.uuid4().hex[:8]}"
    env = worker_env(
        tag,
        a.model,
        a.redis,
        VQUEUE_MAX_MODEL_LEN=str(a.prefix_tokens + a.question_tokens + a.out_tokens + 256),
        VQUEUE_GPU_MEMORY_UTILIZATION=str(a.gpu_memory_utilization),
    )
    if a.kv_cache_bytes:
        env["VQUEUE_KV_CACHE_MEMORY_BYTES"] = str(a.kv_cache_bytes)
    # started together: each engine's KV cache is sized by the settings, not by what the other
    # left free (set --kv-cache-bytes for a fixed size)
    workers: list[Any] = [None] * a.workers

    def start(k: int) -> None:
        log = out / f"worker-{k}.log"
        workers[k] = launch_worker(f"{tag}-w{k}@gpu", env, log, a.redis, "-l", "WARNING")

    threads = [threading.Thread(target=start, args=(k,)) for k in range(a.workers)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    rows: list[dict[str, Any]] = []
    try:
        if any(w is None for w in workers):
            raise RuntimeError(f"a worker did not start; see {out}/worker-*.log")
        from producer import Client

        base = Settings(_env_file=None, broker_url=a.redis, queue=tag, key_prefix=tag)
        clients = {
            "routed": Client(base.model_copy(update={"prefix_routing": True})),
            "shared": Client(base.model_copy(update={"prefix_routing": False})),
        }
        warm = workload(t, argparse.Namespace(**{**vars(a), "jobs": 64, "prefixes": 8}), 0)
        list(clients["shared"].submit_many(warm).results(timeout=a.timeout))
        for rnd in range(1, a.rounds + 1):
            order = ["routed", "shared"] if rnd % 2 else ["shared", "routed"]
            for k, mode in enumerate(order):
                jobs = workload(t, a, seed=rnd * 10 + k)  # fresh texts, the same lengths
                t0 = time.perf_counter()
                res = list(clients[mode].submit_many(jobs).results(timeout=a.timeout))
                wall = time.perf_counter() - t0
                prompt = sum(r.usage.prompt_tokens for r in res)
                cached = sum(r.usage.cached_tokens for r in res)
                by_worker: dict[str, int] = {}
                for r in res:
                    by_worker[r.worker or "?"] = by_worker.get(r.worker or "?", 0) + 1
                row = {
                    "round": rnd,
                    "mode": mode,
                    "jobs": len(res),
                    "failed": sum(r.status != "completed" for r in res),
                    "wall_s": wall,
                    "jobs_per_s": len(res) / wall,
                    "prompt_tokens": prompt,
                    "output_tokens": sum(r.usage.completion_tokens for r in res),
                    "cached_tokens": cached,
                    "prefix_hit_rate": cached / prompt if prompt else None,
                    "jobs_by_worker": by_worker,
                    "worker_start_s": [w[2] for w in workers],
                }
                print(json.dumps(row), flush=True)
                rows.append(row)
                (out / "routing.json").write_text(
                    json.dumps({"args": vars(a), "rows": rows}, indent=2)
                )
    finally:
        for w in workers:
            if w is not None:
                stop(w[0], w[1], 120)
    print("| round | mode | jobs/s | prefix hit rate | output tokens | jobs per worker |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['round']} | {r['mode']} | {r['jobs_per_s']:.1f} | "
            f"{r['prefix_hit_rate']:.1%} | {r['output_tokens']} | "
            f"{sorted(r['jobs_by_worker'].values())} |"
        )
    ratios = [
        x["jobs_per_s"] / y["jobs_per_s"]
        for x in rows
        for y in rows
        if x["round"] == y["round"] and x["mode"] == "routed" and y["mode"] == "shared"
    ]
    if ratios:
        print(
            f"routed/shared: {statistics.median(ratios):.2f}x "
            f"(median of {len(ratios)} paired rounds: {', '.join(f'{r:.2f}' for r in ratios)})"
        )


if __name__ == "__main__":
    main()
