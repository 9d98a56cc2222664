"""What vLLM's loop check (``SamplingParams.repetition_detection``, as the worker sets it) costs
the engine, in raw vLLM: the same prompts with and without it, in alternating rounds.

    python -m benchmarks.loop_cost --model /tmp/models/qwen05 --out $OUT/loop-cost [--cycles 32,128]

Equal work on both sides: every request samples (temperature 1, fixed seeds) to exactly
``--out-tokens`` with ``ignore_eos``, and the check's ``min_tokens`` is 0 so it runs every step
from the first token; sampled text almost never repeats a cycle three times, and the script
exits 1 if the output-token totals differ by more than 1%. Prints a table and writes
loop-cost.json after every round.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--jobs", type=int, default=2000)
    ap.add_argument("--in-tokens", type=int, default=300)
    ap.add_argument("--out-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-num-seqs", type=int, default=0)
    ap.add_argument("--cycles", default="",
                    help="longest cycles to check, comma-separated (VQUEUE_LOOP_MAX_CYCLE_TOKENS "
                    "each); default: the setting as it stands")  # fmt: skip
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    from vllm import LLM, SamplingParams

    from schemas import Settings
    from worker.runner import loop_detection
    from worker.vllm_ext.configure import has_cuda

    from . import workloads as wl

    kwargs: dict[str, Any] = {"model": a.model, "max_model_len": 4096}
    if not has_cuda():  # a smoke run on the CPU
        kwargs.update(dtype="float32", enforce_eager=True, kv_cache_memory_bytes=512 * 1024**2)
    if a.max_num_seqs:
        kwargs["max_num_seqs"] = a.max_num_seqs
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    start_s = time.perf_counter() - t0
    tok = llm.get_tokenizer()
    texts = wl.TextMaker(lambda s: len(tok.encode(s, add_special_tokens=False)))
    prompts = [{"prompt_token_ids": tok.encode(texts.tokens(a.in_tokens))} for _ in range(a.jobs)]

    class _Job:  # what loop_detection reads of a job
        ignore_eos = False
        json_schema = None

    base = Settings(_env_file=None)
    sizes = [int(c) for c in a.cycles.split(",") if c] or [base.loop_max_cycle_tokens]
    checks = {
        c: loop_detection(_Job(), base.model_copy(update={"loop_max_cycle_tokens": c}))
        for c in sizes
    }

    def params(cycle: int, i: int) -> Any:
        return SamplingParams(
            max_tokens=a.out_tokens,
            ignore_eos=True,
            temperature=1.0,
            seed=i,
            **({"repetition_detection": checks[cycle]} if cycle else {}),
        )

    warm = min(64, a.jobs)
    for c in sizes:
        llm.generate(prompts[:warm], [params(c, i) for i in range(warm)], use_tqdm=False)
    rows: list[dict[str, Any]] = []
    sides = [0, *sizes]  # 0: no check
    for r in range(a.rounds):
        for cycle in sides if r % 2 == 0 else sides[::-1]:
            on = bool(cycle)
            ps = [params(cycle, i) for i in range(a.jobs)]
            t = time.perf_counter()
            res = llm.generate(prompts, ps, use_tqdm=False)
            wall = time.perf_counter() - t
            tokens = sum(len(o.outputs[0].token_ids) for o in res)
            rows.append(
                {
                    "round": r,
                    "loop_check": on,
                    "max_cycle_tokens": cycle or None,
                    "jobs": a.jobs,
                    "wall_s": wall,
                    "jobs_per_s": a.jobs / wall,
                    "output_tokens": tokens,
                    "output_tok_per_s": tokens / wall,
                    "ended_by_the_check": sum(
                        o.outputs[0].finish_reason == "repetition" for o in res
                    ),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
            meta = {"model": a.model, "engine_start_s": start_s,
                    "checks": {c: str(k) for c, k in checks.items()}}  # fmt: skip
            (out / "loop-cost.json").write_text(json.dumps({**meta, "rows": rows}, indent=2))
    print("| round | longest cycle checked | jobs/s | output tok/s | ended by the check |")
    print("|---|---|---|---|---|")
    for x in rows:
        print(
            f"| {x['round']} | {x['max_cycle_tokens'] or 'off'} | {x['jobs_per_s']:.1f} | "
            f"{x['output_tok_per_s']:,.0f} | {x['ended_by_the_check']} |"
        )
    off = [x for x in rows if not x["loop_check"]]
    off_t, off_s = sum(x["output_tokens"] for x in off), sum(x["wall_s"] for x in off)
    unequal = False
    for c in sizes:
        on = [x for x in rows if x["max_cycle_tokens"] == c]
        on_t, on_s = sum(x["output_tokens"] for x in on), sum(x["wall_s"] for x in on)
        print(f"throughput with cycles up to {c} tokens checked: {off_s / on_s:.1%} of without")
        if abs(on_t - off_t) > 0.01 * max(off_t, 1):
            print(f"not equal work: {on_t} vs {off_t} output tokens ({c})", file=sys.stderr)
            unequal = True
    if unequal:
        sys.exit(1)


if __name__ == "__main__":
    main()
