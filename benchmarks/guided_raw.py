"""Guided JSON against the same prompts unconstrained, in raw vLLM (no queue): with vLLM's own
guided-decoding step (``stock``), with vqueue's plugin batching it and reusing compiled grammars
(``parallel``, see worker/vllm_ext/guided.py), the plugin batching only (``parallel-noreuse``), the
plugin with vLLM's asynchronous scheduling off (``parallel-sync``), and the plugin in an
in-process engine that times the engine step's parts (``inproc``, attribution only; with
``--py-spy``, where the time goes). ``VARIANT@N`` runs a variant with ``VQUEUE_GRAMMAR_THREADS=N``.

    python -m benchmarks.guided_raw --model /tmp/models/qwen05 --out $OUT

Each variant runs in its own process with a fresh engine built from the worker's own engine
arguments. Every round runs the extract jobs guided, then the same rendered prompts unconstrained,
each forced to emit exactly as many tokens as its guided twin did, so both sides generate the same
tokens. Results go to guided-raw.json as they come, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import plugin_env

VARIANTS = ("stock", "parallel", "parallel-noreuse", "parallel-sync", "inproc")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--jobs", type=int, default=768)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument(
        "--dummy-weights",
        action="store_true",
        help="random weights from the model folder's config.json alone (vLLM's load_format "
        "dummy): a large model's shape without its weights on disk",
    )
    ap.add_argument(
        "--threads-sweep",
        default="",
        help="inproc only: comma-separated mask thread counts, each run guided and unconstrained "
        "in every round on the one engine (a fresh llguidance executor for each)",
    )
    ap.add_argument(
        "--py-spy",
        metavar="PATH",
        help="run each variant under this py-spy binary: wall-clock stacks of every Python "
        "thread at 100 Hz without pausing the process, idle ones included, to "
        "py-spy-VARIANT.txt (collapsed, one stack a line; benchmarks/profiling/stacks.py reads it)",
    )
    ap.add_argument(
        "--tokens-only",
        action="store_true",
        help="one guided run per variant, with no warm-up and no unconstrained run: the tokens "
        "and grammar check (what tests/test_engine_plugin.py compares), no speed figure",
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.child:
        child(a, out / f"guided-{a.child.replace('@', '-t')}.jsonl")
        return
    env = plugin_env()
    results: dict[str, list[dict[str, Any]]] = {}
    for v in a.variants.split(","):
        kind, _, threads = v.partition("@")
        if kind not in VARIANTS:
            ap.error(f"unknown variant {v!r}: one of {', '.join(VARIANTS)}, optionally @THREADS")
        spy = []
        if a.py_spy:
            spy = [a.py_spy, "record", "-r", "100", "--nonblocking", "--idle", "-f", "raw", "-o"]
            spy += [str(out / f"py-spy-{v.replace('@', '-t')}.txt"), "--"]
        cmd = [
            *spy,
            sys.executable,
            "-m",
            "benchmarks.guided_raw",
            "--child",
            v,
            "--model",
            a.model,
            "--out",
            a.out,
            "--jobs",
            str(a.jobs),
            "--max-tokens",
            str(a.max_tokens),
            "--rounds",
            str(a.rounds),
            *(["--dummy-weights"] if a.dummy_weights else []),
            *(["--tokens-only"] if a.tokens_only else []),
            *(["--threads-sweep", a.threads_sweep] if a.threads_sweep else []),
        ]
        venv = dict(
            env,
            VQUEUE_PARALLEL_GRAMMAR_MASKS="false" if kind == "stock" else "true",
            VQUEUE_GRAMMAR_REUSE="false" if kind in ("stock", "parallel-noreuse") else "true",
        )
        if threads:
            venv["VQUEUE_GRAMMAR_THREADS"] = threads
        if kind == "inproc":
            venv["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        print(f"-- {v}", file=sys.stderr, flush=True)
        subprocess.run(cmd, env=venv, check=False)
        f = out / f"guided-{v.replace('@', '-t')}.jsonl"
        results[v] = [json.loads(x) for x in f.read_text().splitlines()] if f.exists() else []
        report(results, out)


def child(a: argparse.Namespace, path: Path) -> None:
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    from schemas import ExtractJob, Settings
    from worker.prompts import build_messages, render
    from worker.structured import generation_schema
    from worker.vllm_ext.guided import _Batched

    from . import engine_setup
    from .profiling.step_timers import install_timers
    from .workloads import SCHEMAS, WORDS

    path.unlink(missing_ok=True)

    def emit(row: dict[str, Any]) -> None:
        print(json.dumps(row), flush=True)
        with path.open("a") as f:
            f.write(json.dumps(row) + "\n")

    settings = Settings(_env_file=None)
    t0 = time.perf_counter()
    kwargs, _env, plan = engine_setup(settings, a.model)  # this process builds the engine
    if a.child.startswith("parallel-sync"):
        kwargs["async_scheduling"] = False
    if a.dummy_weights:
        kwargs["load_format"] = "dummy"
    llm = LLM(**kwargs)
    # after the engine exists, so the timers wrap whatever the plugin put in place
    timers = install_timers() if a.child.startswith("inproc") else None
    emit(
        {
            "variant": a.child,
            "engine_start_s": round(time.perf_counter() - t0, 1),
            "confidence_monitor": settings.confidence_monitor,
            "model_runner": "V2" if llm.llm_engine.vllm_config.use_v2_model_runner else "V1",
            "plan": plan.as_dict(),
        }
    )
    tok = llm.get_tokenizer()
    rng = random.Random(7)
    prompts, guided = [], []
    for i in range(a.jobs):
        schema = SCHEMAS[i % len(SCHEMAS)]
        words = " ".join(rng.choice(WORDS) for _ in range(300))
        job = ExtractJob.model_validate(
            {"id": f"x{i}", "type": "extract", "text": words, "json_schema": schema}
        )
        prompts.append({"prompt_token_ids": render(tok, build_messages(job, settings))})
        guided.append(
            SamplingParams(
                max_tokens=a.max_tokens,
                temperature=0.0,
                structured_outputs=StructuredOutputsParams(json=generation_schema(schema)),
            )
        )

    outputs: list[list[int]] = []

    gc_seen: dict[int, list[float]] = {}
    gc_started = [0.0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        # collections in this process: the engine's when it runs in-process (inproc)
        if phase == "start":
            gc_started[0] = time.perf_counter()
        else:
            n_ms = gc_seen.setdefault(info["generation"], [0, 0.0])
            n_ms[0] += 1
            n_ms[1] += (time.perf_counter() - gc_started[0]) * 1e3

    gc.callbacks.append(on_gc)

    def timed(params: list[Any]) -> tuple[float, list[int]]:
        if timers is not None:
            timers.clear()
        gc_seen.clear()
        t = time.perf_counter()
        res = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t
        outputs[:] = [list(r.outputs[0].token_ids) for r in res]
        return wall, [len(o) for o in outputs]

    # separate names, so a sampling profiler's stacks tell the two runs apart
    def guided_run(params: list[Any]) -> tuple[float, list[int]]:
        return timed(params)

    def unconstrained_run(params: list[Any]) -> tuple[float, list[int]]:
        return timed(params)

    import llguidance
    import llguidance.hf

    lltok = llguidance.hf.from_tokenizer(tok, llm.llm_engine.model_config.get_vocab_size())
    grammars = [
        llguidance.LLMatcher.grammar_from_json_schema(
            generation_schema(s), defaults={"whitespace_flexible": False}
        )
        for s in SCHEMAS
    ]

    def violations() -> int:
        """Guided outputs that the job's grammar does not accept token for token (must be 0)."""
        bad = 0
        for i, ids in enumerate(outputs):
            ids = [t for t in ids if t != lltok.eos_token]
            m = llguidance.LLMatcher(lltok, grammars[i % len(grammars)])
            bad += m.validate_tokens(ids) != len(ids)
        return bad

    if not a.tokens_only:
        llm.generate(prompts[:64], guided[:64], use_tqdm=False)  # warm-up: grammars, masks
        # every prompt prefilled once, so the prefix cache serves both sides alike: otherwise
        # the first run measured pays for all the prefills (on a 7B model, a third of its time)
        llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)

    def measure(r: int, run: str, params: list[Any], more: Any = None) -> list[int]:
        wall, lengths = (guided_run if run == "guided" else unconstrained_run)(params)
        row = {
            "variant": a.child,
            "round": r + 1,
            "run": run,
            # mask threads where the engine shares this process (elsewhere VARIANT@N says)
            "threads": _Batched.threads if a.child.startswith("inproc") else None,
            "gc": {f"gen{g}": [n, round(ms, 1)] for g, (n, ms) in sorted(gc_seen.items())},
            "wall_s": round(wall, 3),
            "jobs_per_s": round(a.jobs / wall, 2),
            "output_tokens": sum(lengths),
            "output_tok_per_s": round(sum(lengths) / wall),
            **(more(lengths) if more else {}),
        }
        if timers is not None:
            row["engine_ms"] = timers.report()
        emit(row)
        return lengths

    def checked(lengths: list[int]) -> dict[str, Any]:
        return {
            "at_max_tokens": sum(1 for n in lengths if n >= a.max_tokens),
            "grammar_violations": violations(),
            "digest": hashlib.sha256(json.dumps(outputs).encode()).hexdigest()[:12],
        }

    def unconstrained(lengths: list[int]) -> list[Any]:
        return [
            SamplingParams(
                max_tokens=max(1, n), min_tokens=max(1, n), ignore_eos=True, temperature=0.0
            )
            for n in lengths
        ]

    if a.tokens_only:
        measure(0, "guided", guided, checked)
        return
    sweep = [int(t) for t in a.threads_sweep.split(",") if t] if a.child == "inproc" else []
    lengths: list[int] = []
    for r in range(a.rounds):
        for threads in sweep or [0]:
            if threads:  # the engine shares this process: the next mask fill makes the executor
                _Batched.threads = threads
                _Batched._executors.clear()
            # guided and unconstrained swap places every round, so a device that drifts during
            # the run does not always favour the same one; an unconstrained run that goes first
            # takes the lengths of the last guided run
            if r % 2 == 0 or not lengths:
                lengths = measure(r, "guided", guided, checked)
                measure(r, "unconstrained, same lengths", unconstrained(lengths))
            else:
                measure(r, "unconstrained, same lengths", unconstrained(lengths))
                lengths = measure(r, "guided", guided, checked)


def report(results: dict[str, list[dict[str, Any]]], out: Path) -> None:
    rows: list[dict[str, Any]] = []
    groups: dict[str, list[dict[str, Any]]] = {}
    for v, got in results.items():
        swept = len({r.get("threads") for r in got if "run" in r}) > 1
        for r in got:
            if "run" in r:
                groups.setdefault(f"{v}@{r['threads']}" if swept else v, []).append(r)
    for v, got in groups.items():
        runs: dict[str, list[float]] = {}
        for r in got:
            runs.setdefault(r["run"], []).append(r["output_tok_per_s"])
        free = statistics.median(runs.get("unconstrained, same lengths", [0])) or None
        # the steadier figure: each round's guided run against the unconstrained run beside it
        guided, free_runs = runs.get("guided", []), runs.get("unconstrained, same lengths", [])
        pairs = [g / u for g, u in zip(guided, free_runs, strict=False)]
        for run, vals in runs.items():
            med = statistics.median(vals)
            rows.append(
                {
                    "variant": v,
                    "run": run,
                    "output_tok_per_s": vals,
                    "median": med,
                    "vs_unconstrained": round(med / free, 3) if free else None,
                    "paired": [round(x, 3) for x in pairs] if run == "guided" else None,
                }
            )
    (out / "guided-raw.json").write_text(json.dumps({"rows": rows, "raw": results}, indent=2))
    print(
        "| variant | run | output tok/s per round | median | vs unconstrained | per round |\n"
        "|---|---|---|---|---|---|"
    )
    for r in rows:
        paired = " / ".join(f"{x:.2f}" for x in r["paired"] or [])
        print(
            f"| {r['variant']} | {r['run']} | "
            f"{' / '.join(f'{x:,.0f}' for x in r['output_tok_per_s'])} | {r['median']:,.0f} | "
            f"{r['vs_unconstrained']} | {paired} |"
        )


if __name__ == "__main__":
    main()
