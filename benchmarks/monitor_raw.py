"""The confidence monitor's own cost in raw vLLM (no queue): an engine without it, then one with it
loaded, running the same prompts idle (no request watched) and watching every request (a threshold
no token reaches), alternated.

    python -m benchmarks.monitor_raw --model /tmp/models/qwen05 --out $OUT
    python -m benchmarks.monitor_raw --model /tmp/models/qwen05 --out $OUT --timers

With ``--timers`` the engines run in-process and every row carries the mean time per call of the
step's parts, the monitor's ``apply`` and ``update_state`` among them: host time only, so a part
whose cost is on the device shows as a difference in the step, not in its own line.

Both engines are built from the worker's own engine arguments, each in its own process. Figures
are appended to monitor-raw.jsonl as they come, so a cut-short run keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import plugin_env


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--jobs", type=int, default=1000)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--timers",
        action="store_true",
        help="in-process engines with the step's parts timed (benchmarks/profiling/step_timers.py)",
    )
    ap.add_argument("--child", choices=["off", "on"], help=argparse.SUPPRESS)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "monitor-raw.jsonl"
    if a.child:
        child(a, log)
        return
    log.unlink(missing_ok=True)
    for c in ("off", "on"):
        env = plugin_env() | {"VQUEUE_CONFIDENCE_MONITOR": "true" if c == "on" else "false"}
        if a.timers:
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "benchmarks.monitor_raw",
                "--child",
                c,
                "--model",
                a.model,
                "--out",
                a.out,
                "--jobs",
                str(a.jobs),
                "--tokens",
                str(a.tokens),
                "--rounds",
                str(a.rounds),
                *(["--timers"] if a.timers else []),
            ],
            env=env,
            check=False,
        )
    rows = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
    runs: dict[str, list[float]] = {}
    for r in rows:
        if "run" in r:
            runs.setdefault(r["run"], []).append(r["jobs_per_s"])
    base = statistics.median(runs.get("no monitor", [0])) or None
    print("| run | jobs/s per round | median | vs no monitor |\n|---|---|---|---|")
    summary = []
    for run, vals in runs.items():
        med = statistics.median(vals)
        share = round(med / base, 3) if base else None
        summary.append({"run": run, "jobs_per_s": vals, "median": med, "vs_no_monitor": share})
        print(f"| {run} | {' / '.join(f'{v:.1f}' for v in vals)} | {med:.1f} | {share} |")
    # the steadier figure: each round's watching run against the idle run beside it
    watching, idle = runs.get("monitor watching", []), runs.get("monitor idle", [])
    pairs = [w / i for w, i in zip(watching, idle, strict=False)]
    paired = round(statistics.median(pairs), 3) if pairs else None
    print(f"watching / idle per round: {' / '.join(f'{p:.2f}' for p in pairs)}; median {paired}")
    (out / "monitor-raw.json").write_text(
        json.dumps({"summary": summary, "watching_vs_idle": paired, "rows": rows}, indent=2)
    )


def child(a: argparse.Namespace, log: Path) -> None:
    from vllm import LLM, SamplingParams

    from schemas import Settings
    from worker.confidence import ConfidenceBoard, Monitor, request_args

    from . import engine_setup

    def emit(row: dict[str, Any]) -> None:
        print(json.dumps(row), flush=True)
        with log.open("a") as f:
            f.write(json.dumps(row) + "\n")

    t0 = time.perf_counter()
    kwargs, _env, plan = engine_setup(Settings(_env_file=None), a.model)  # built in this process
    llm = LLM(**kwargs)
    emit({
        "engine": a.child,
        "engine_start_s": round(time.perf_counter() - t0, 1),
        "model_runner": "V2" if llm.llm_engine.vllm_config.use_v2_model_runner else "V1",
        "plan": plan.as_dict(),
    })  # fmt: skip
    timers = None
    if a.timers:
        from .profiling.step_timers import install_timers

        timers = install_timers()
    tok = llm.get_tokenizer()
    board = ConfidenceBoard() if a.child == "on" else None
    marker = len(tok) - 1
    prompts = [
        {"prompt_token_ids": tok.encode(f"Report {i}: " + "word " * 150)} for i in range(a.jobs)
    ]
    base = dict(max_tokens=a.tokens, min_tokens=a.tokens, ignore_eos=True, temperature=0.0)

    def run(watch: bool) -> float:
        params, slots = [], []
        for _ in prompts:
            extra = None
            if watch and board is not None:
                slots.append(board.slot())
                extra = request_args(board, slots[-1], Monitor(-1000.0, 2, 4, True), marker)
            params.append(SamplingParams(**base, extra_args=extra, stop_token_ids=[marker]))
        if timers is not None:
            timers.clear()
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        rate = a.jobs / (time.perf_counter() - t)
        if slots and board is not None:  # the monitor saw every token of every request
            seen = sum(board.read(s, a.tokens, wait_s=0.05).tokens == a.tokens for s in slots)
            emit({"check": "every token seen", "requests": len(slots), "ok": seen})
        return rate

    run(board is not None)  # warm-up
    modes = (
        [("no monitor", False)]
        if board is None
        else [("monitor idle", False), ("monitor watching", True)]
    )
    for r in range(a.rounds):
        # idle and watching swap places every round, so a device that drifts during the run
        # does not always favour the same one
        for name, watch in modes if r % 2 == 0 else modes[::-1]:
            row: dict[str, Any] = {"round": r + 1, "run": name, "jobs_per_s": round(run(watch), 2)}
            if timers is not None:
                row["engine_ms"] = timers.report()
            emit(row)
    if board is not None:
        # and it fires: a threshold every token misses aborts each request once past the
        # grace period and the window (4 + 2 tokens), through the marker
        slots = [board.slot() for _ in prompts[:64]]
        rule = Monitor(1000.0, 2, 4, True)
        free = dict(max_tokens=a.tokens, ignore_eos=True, temperature=0.0)  # min_tokens would
        params = [  # hold the marker back, as it holds back every stop token
            SamplingParams(**free, stop_token_ids=[marker],
                           extra_args=request_args(board, s, rule, marker))
            for s in slots
        ]  # fmt: skip
        outs = llm.generate(prompts[:64], params, use_tqdm=False)
        emit({
            "check": "aborts at the window",
            "requests": len(outs),
            "stopped_by_marker": sum(o.outputs[0].stop_reason == marker for o in outs),
            "tokens": sorted({len(o.outputs[0].token_ids) for o in outs}),
            "fired": sum(board.read(s, 0, wait_s=0.05).fired for s in slots),
        })  # fmt: skip
        board.close()


if __name__ == "__main__":
    main()
