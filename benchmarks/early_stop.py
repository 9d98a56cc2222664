"""Logprob early stop through the real queue: what the monitor costs, and what it saves.

    python -m benchmarks.early_stop --model /tmp/models/qwen05 --out $OUT          # GPU
    python -m benchmarks.early_stop --scale 0.02 --workloads nonsense --out /tmp/es  # CPU

1. Cost. The same summary jobs (fixed 128 output tokens) on a worker without the monitor
   (``VQUEUE_CONFIDENCE_MONITOR=false``), then on one with it: jobs with early stop off, and
   jobs watched with a threshold no token reaches (the monitor computes everything, never fires).
2. Savings, "simulated": a share of jobs is bad. A random-weights model has no good or bad jobs
   (every top-1 logprob is about -12), so badness is set per job: good jobs are watched with a
   threshold they never cross, bad ones with -3, which fires after the grace period; their one
   retry is the final attempt and runs in full. The baseline runs every job to max_tokens
   unwatched, then runs the bad ones again: the bad output found after the fact, and the retry.
3. Savings, "nonsense" (a real model only): jobs on nonsense text at temperature 2 beside normal
   greedy summaries, the type's default policy against early stop off.

Prints a table, writes early-stop.json under --out.
"""

from __future__ import annotations

import argparse
import atexit
import json
import random
import time
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks import own_redis, plugin_env
from schemas import JobResult, Settings

from .gpu_suite import launch_worker, stop
from .workloads import WORDS

NONSENSE = "zq vlorp 93 ;; ~~ ekk bramf ### 0x1f quux ]]{{ plint zorbl fnarg"
NEVER = {"threshold": -1000.0}  # watched, never fires


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def engine_tokens(port: int) -> float:
    page = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for line in page.splitlines():
        if line.startswith("vqueue_engine_generation_tokens_total "):
            return float(line.split()[1])
    return 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=Settings(_env_file=None).model)
    ap.add_argument("--out", required=True)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument(
        "--redis", default="", help="a Redis to use and flush (default: one of the run's own)"
    )
    ap.add_argument("--workloads", default="cost,simulated")
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    todo = set(a.workloads.split(","))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    import redis

    from producer import Client

    if a.redis:
        redis.Redis.from_url(a.redis).flushdb()
    else:
        own, a.redis = own_redis()
        atexit.register(own.kill)
    n = lambda x: max(4, int(x * a.scale))  # noqa: E731
    rng = random.Random(11)
    rows: list[dict[str, Any]] = []
    port = 9810

    def run(
        client: Client, name: str, jobs: list[dict[str, Any]], passes: int = 1
    ) -> list[JobResult]:
        t = time.perf_counter()
        gen0 = engine_tokens(port)
        res = list(client.submit_many(jobs).results(timeout=3600))
        if passes == 2:  # the baseline's second pass: the bad jobs again
            again = [dict(j, id=j["id"] + "-again") for j in jobs if j["id"].startswith("bad")]
            res += list(client.submit_many(again).results(timeout=3600))
        wall = time.perf_counter() - t
        time.sleep(1.5)  # the stat logger's last step
        row = {
            "run": name,
            "jobs": len(jobs),
            "wall_s": round(wall, 2),
            "jobs_per_s": round(len(jobs) / wall, 2),
            "generated_tokens": int(engine_tokens(port) - gen0),
            "aborted_attempts": sum(x.reason == "low_confidence" for r in res for x in r.attempts),
            "wasted_tokens": sum(r.usage.wasted_tokens for r in res),
            "low_confidence": sum(r.low_confidence for r in res),
            "failed": sum(r.status != "completed" for r in res),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
        return res

    fixed = {"max_tokens": 128, "min_tokens": 128, "ignore_eos": True}
    cost_jobs = [
        {"type": "summarize", "text": f"Report {i}. {text(rng, 150)}", **fixed}
        for i in range(n(2000))
    ]
    for monitor in (False, True):
        if not monitor and "cost" not in todo:
            continue
        env = dict(
            plugin_env(),
            VQUEUE_BROKER_URL=a.redis,
            VQUEUE_QUEUE="es",
            VQUEUE_RESULT_CACHE="false",  # each variant runs the same prompts
            VQUEUE_MODEL=a.model,
            VQUEUE_HEARTBEAT_S="1",
            VQUEUE_CONFIDENCE_MONITOR=str(monitor).lower(),
        )
        name = f"es-{'on' if monitor else 'off'}@bench"
        proc, log, start_s = launch_worker(
            name, env, out / f"early-stop-{name.split('@')[0]}.log", a.redis,
            "-l", "INFO", "--metrics-port", str(port),
        )  # fmt: skip
        try:
            client = Client(Settings(_env_file=None, broker_url=a.redis, queue="es"))
            run(client, "warmup", cost_jobs[: n(400)])
            rows.pop()
            if "cost" in todo:
                for rep in range(a.repeats):
                    if monitor:
                        jobs = [dict(j, early_stop=False) for j in cost_jobs]
                        run(client, f"monitor loaded, early stop off #{rep + 1}", jobs)
                        jobs = [dict(j, early_stop=NEVER) for j in cost_jobs]
                        run(client, f"monitor watching, never firing #{rep + 1}", jobs)
                    else:
                        run(client, f"no monitor #{rep + 1}", cost_jobs)
            if monitor and "simulated" in todo:
                bad_share, long = 0.2, {"max_tokens": 512, "ignore_eos": True}
                jobs = []
                for i in range(n(1000)):
                    bad = i % round(1 / bad_share) == 0
                    jobs.append({
                        "id": f"{'bad' if bad else 'good'}-{i}", "type": "summarize",
                        "text": f"Memo {i}. {text(rng, 150)}", **long,
                        "early_stop": {"threshold": -3.0, "max_retries": 1} if bad else NEVER,
                    })  # fmt: skip
                run(client, "20% bad, early stop (abort, 1 retry)", jobs)
                base = [dict(j, id=j["id"] + "-b", early_stop=False) for j in jobs]
                run(client, "20% bad, run to max_tokens, bad ones again", base, passes=2)
            if monitor and "nonsense" in todo:
                jobs = []
                for i in range(n(200)):
                    bad = i % 5 == 0
                    body = NONSENSE if bad else f"Memo {i}. {text(rng, 60)}"
                    jobs.append({"id": f"{'bad' if bad else 'good'}-{i}", "type": "summarize",
                                 "text": body, "max_tokens": 256, "seed": i,
                                 "temperature": 2.0 if bad else 0.0})  # fmt: skip
                run(client, "20% nonsense at T=2, early stop (summarize default)", jobs)
                base = [dict(j, id=j["id"] + "-b", early_stop=False) for j in jobs]
                run(client, "20% nonsense at T=2, early stop off", base)
        finally:
            stop(proc, log, 60)
    (out / "early-stop.json").write_text(json.dumps({"model": a.model, "rows": rows}, indent=2))
    print("\n| run | jobs | wall s | jobs/s | tokens generated | aborted | wasted | flagged |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['run']} | {r['jobs']} | {r['wall_s']} | {r['jobs_per_s']} | "
              f"{r['generated_tokens']} | {r['aborted_attempts']} | {r['wasted_tokens']} | "
              f"{r['low_confidence']} |")  # fmt: skip


if __name__ == "__main__":
    main()
