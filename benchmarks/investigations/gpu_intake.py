"""How fast a worker takes jobs in, by intake processes, and where an intake process's time goes.

    python -m benchmarks.investigations.gpu_intake --model /tmp/models/qwen05 --out $OUT/intake \
        [--runs "4;8,VQUEUE_PREFIX_GATING=false"] [--prefix-rounds 3] [--tiny 12000] \
        [--profile tiny|prefix]

Per run (an intake count, ``VQUEUE_INTAKE_PROCESSES``, with any other settings after it) one
worker, and on it:

- the suite's prefix batch (800 jobs, 25 shared documents, 128 output tokens), ``--prefix-rounds``
  times (fresh texts each round): wall, and when its last job reached the engine (the ramp a raw
  caller does not have);
- ``--tiny`` jobs of ~50 prompt tokens and one output token: the engine finishes them as fast as
  they come, so their jobs/s is the queue path's own ceiling (consumer, task threads, results).

With ``--profile tiny`` or ``prefix`` (py-spy on PATH), py-spy samples the first run's: GIL holders
over the worker and all its processes (``gil-<n>.txt``), then, over the same jobs again, one
intake process's threads, waiting included (``wall-<n>.txt``); ``python3 -m
benchmarks.profiling.gil_profile`` sums them (on the device kit: copy the py-spy binary from its
manylinux wheel, ``py_spy-*.data/scripts/py-spy``, into ``.gpu/b/bin``). Prints a table and writes
intake.json after each worker.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from .. import workloads as wl
from ..gpu_suite import Stamps, own_worker, phases, stop


def timed(client: Any, jobs: list[dict[str, Any]], timeout: float) -> dict[str, Any]:
    t, t_wall0 = time.perf_counter(), time.time()
    res = list(client.submit_many(jobs).results(timeout=timeout))
    wall = time.perf_counter() - t
    return {
        "jobs": len(res),
        "failed": sum(r.status != "completed" for r in res),
        "wall_s": wall,
        "jobs_per_s": len(res) / wall,
        **phases([Stamps.of(r.timings) for r in res], t_wall0),
    }


def spy(pid: int, args: list[str], out: Path, seconds: float) -> subprocess.Popen:
    return subprocess.Popen(
        ["py-spy", "record", "--pid", str(pid), "--nonblocking", "--rate", "50",
         "--duration", str(int(seconds)), "--format", "raw", "-o", str(out), *args],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
    )  # fmt: skip


def parse_run(spec: str) -> tuple[int, dict[str, str]]:
    """``"8,VQUEUE_PREFIX_GATING=false"``: 8 intake processes, that setting added."""
    n, *env = spec.split(",")
    return int(n), dict(e.split("=", 1) for e in env if e)


def run(a: argparse.Namespace, spec: str, t: wl.TextMaker, profile: str | None) -> dict[str, Any]:
    out = Path(a.out)
    intakes, env = parse_run(spec)
    tag = spec.replace(",", "-").replace("=", "-")
    env = {"VQUEUE_MAX_MODEL_LEN": "4096", "VQUEUE_INTAKE_PROCESSES": str(intakes), **env}
    w = own_worker("intake", a.model, a.redis, out / f"worker-{tag}.log", **env)
    proc, fh, start_s, client, name = w
    row: dict[str, Any] = {
        "run": spec, "intake_processes": intakes, "env": env, "worker_start_s": start_s
    }  # fmt: skip
    try:
        warm = wl.mixed(t, max(3, round(64 * a.scale)))  # CUDA graphs, allocators
        timed(client, warm, a.timeout)
        k = a.scale
        prefix = [
            wl.prefix_heavy(t, max(2, round(25 * k)), max(2, round(32 * k)), seed=r)
            for r in range(1, a.prefix_rounds + 1)
        ]  # each round its own texts: none finds the last one's documents cached
        one = {"max_tokens": 1, "min_tokens": 1, "ignore_eos": True}
        tiny = [
            {"id": f"t{i}", "type": "summarize", "text": t.tokens(50), **one} for i in range(a.tiny)
        ]
        for rnd, jobs in enumerate(prefix[1:], 2):
            row[f"prefix_{rnd}"] = timed(client, jobs, a.timeout)
        for what, jobs in (("prefix", prefix[0] if prefix else []), ("tiny", tiny)):
            if not jobs:
                continue
            if what != profile or not shutil.which("py-spy"):
                row[what] = timed(client, jobs, a.timeout)
                continue
            # GIL holders over every process; then, over the same jobs again, one intake
            # process's threads, idle included (where its consumer's wall clock goes)
            s = spy(proc.pid, ["--subprocesses", "--gil"], out / f"gil-{intakes}.txt", a.profile_s)
            row[what] = timed(client, jobs, a.timeout)
            s.wait()
            intake = subprocess.run(
                ["pgrep", "-n", "-f", f"hostname {name.split('@')[0]}-intake1@"],
                capture_output=True, text=True,
            ).stdout.split()  # fmt: skip
            pid = int(intake[0]) if intake else proc.pid  # one process: the worker's own
            s = spy(pid, ["--idle", "--threads"], out / f"wall-{intakes}.txt", a.profile_s)
            row[f"{what}_again"] = timed(client, jobs, a.timeout)
            s.wait()
    finally:
        stop(proc, fh, 120)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--runs",
        default="4",
        help="one worker per run, ';' between: intake processes, then KEY=VALUE settings",
    )
    ap.add_argument("--prefix-rounds", type=int, default=1)
    ap.add_argument("--tiny", type=int, default=12000)
    ap.add_argument("--scale", type=float, default=1.0, help="the prefix batch's size (CPU: 0.1)")
    ap.add_argument(
        "--profile", choices=["prefix", "tiny"], help="sample this run with py-spy (on PATH)"
    )
    ap.add_argument("--profile-s", type=float, default=12, help="each py-spy recording's length")
    ap.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--timeout", type=float, default=600)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t = wl.TextMaker.of_model(a.model)
    rows: list[dict[str, Any]] = []
    for k, spec in enumerate(x for x in a.runs.split(";") if x):
        rows.append(run(a, spec, t, a.profile if k == 0 else None))
        print(json.dumps(rows[-1]), flush=True)
        (out / "intake.json").write_text(json.dumps(rows, indent=2))

    def f(x: Any, fmt: str = ".2f") -> str:
        return "-" if x is None else format(x, fmt)

    def med(r: dict[str, Any], key: str) -> float | None:
        """Over the prefix rounds; not ``prefix_again``, which finds round 1's documents cached."""
        rounds = [
            v
            for k, v in r.items()
            if k == "prefix" or k.startswith("prefix_") and k != "prefix_again"
        ]
        xs = [v[key] for v in rounds if v.get(key) is not None]
        return statistics.median(xs) if xs else None

    print("| run | prefix jobs/s | last job out of Redis / prompt sent / in the engine s | queue "
          "wait p50 s | prompt build p50 s | into vLLM p50 s | tiny jobs/s | tiny again jobs/s |"
          "\n|---|---|---|---|---|---|---|---|")  # fmt: skip
    for r in rows:  # prefix: medians over its rounds
        ti, again = r.get("tiny", {}), r.get("tiny_again", {})
        print(
            f"| {r['run']} | {f(med(r, 'jobs_per_s'), '.1f')} | {f(med(r, 'last_started_s'))} / "
            f"{f(med(r, 'last_sent_s'))} / {f(med(r, 'last_submitted_s'))} "
            f"| {f(med(r, 'queue_wait_p50_s'))} | {f(med(r, 'prompt_build_p50_s'), '.3f')} | "
            f"{f(med(r, 'into_vllm_p50_s'), '.3f')} | "
            f"{f(ti.get('jobs_per_s'), '.0f')} | {f(again.get('jobs_per_s'), '.0f')} |"
        )


if __name__ == "__main__":
    main()
