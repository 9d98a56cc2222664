"""What vLLM's frontend loop spends per request with and without detokenizing, and what the
worker then spends making the same text itself.

    python -m benchmarks.investigations.frontend_cpu \
        --model ~/.cache/vqueue/models/smollm2-135m-instruct

A worker's frontend process (``worker/frontend.py``) runs vLLM's ``AsyncLLM`` loop alone: it takes
every request in and turns every engine step into outputs, one loop for the whole worker. Unless
a request says ``detokenize=False``, that loop also primes a decode stream with the request's
whole prompt as it arrives and detokenizes each of its tokens at every step. ``EngineHost`` sends
requests without stop strings with ``detokenize=False`` and makes their text in the intake
process that waits for them (``PromptTokenizer.output_text``). This measures both sides on equal
work: the same prompts, as token ids, all submitted at once, outputs fixed in length
(``ignore_eos``), greedy; the frontend's CPU time is this process's (vLLM's engine core is a
process of its own), in alternating rounds. It also checks that the worker's text equals vLLM's
for every request whose tokens came out the same in both runs.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import resource
import statistics
import time
from pathlib import Path
from typing import Any


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def _run(engine: Any, prompts: list[list[int]], tokens: int, detok: bool, tag: str) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(max_tokens=tokens, min_tokens=tokens, ignore_eos=True, temperature=0,
                            detokenize=detok, output_kind=RequestOutputKind.FINAL_ONLY)  # fmt: skip

    async def one(i: int, ids: list[int]) -> Any:
        final = None
        async for out in engine.generate({"prompt_token_ids": ids}, params, f"{tag}-{i}"):
            final = out
        return final

    c, t = _cpu(), time.perf_counter()
    outs = await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompts)))
    return _cpu() - c, time.perf_counter() - t, outs


async def _main(a: argparse.Namespace) -> dict[str, Any]:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from worker.prompts import PromptTokenizer

    engine = AsyncLLM.from_engine_args(
        AsyncEngineArgs(
            model=a.model,
            max_model_len=a.prompt_tokens + a.max_tokens + 16,
            kv_cache_memory_bytes=a.kv_cache_bytes,
            max_num_seqs=a.jobs,
            enable_prefix_caching=False,
        )  # fmt: skip
    )
    tok = PromptTokenizer(engine.tokenizer)
    words = "The council met on Tuesday to discuss bus routes and the budget for spring. "
    base = tok.encode(words * (a.prompt_tokens // 12 + 1))[: a.prompt_tokens]
    rows: list[dict[str, Any]] = []
    mismatched = compared = 0
    try:
        for rnd in range(a.rounds + 1):  # round 0 warms the engine up, unmeasured
            rng = random.Random(rnd)
            prompts = [rng.sample(base, len(base)) for _ in range(a.jobs)]
            outs: dict[bool, list[Any]] = {}
            made: list[str] = []
            for detok in (True, False) if rnd % 2 else (False, True):
                cpu, wall, outs[detok] = await _run(engine, prompts, a.max_tokens, detok,
                                                    f"{rnd}{detok}")  # fmt: skip
                decode_s = 0.0
                if not detok:  # what the worker then does for each request
                    t = time.perf_counter()
                    made = [
                        tok.output_text(prompts[i], list(c.token_ids), c.finish_reason == "stop")
                        for i, c in enumerate(o.outputs[0] for o in outs[detok])
                    ]
                    decode_s = time.perf_counter() - t
                if rnd:
                    rows.append({"round": rnd, "detokenize": detok, "jobs": a.jobs,
                                 "frontend_cpu_s": cpu, "wall_s": wall,
                                 "frontend_cpu_ms_per_job": 1000 * cpu / a.jobs,
                                 "worker_decode_ms_per_job": None if detok
                                 else 1000 * decode_s / a.jobs})  # fmt: skip
            for on, off, text in zip(outs[True], outs[False], made, strict=True):
                if list(off.outputs[0].token_ids) != list(on.outputs[0].token_ids):
                    continue  # greedy on a CPU can still differ by batch: nothing to compare
                compared += 1
                mismatched += text != on.outputs[0].text
    finally:
        engine.shutdown()
    return {"rows": rows, "texts_compared": compared, "texts_mismatched": mismatched}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--jobs", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=700)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--kv-cache-bytes", type=int, default=1024**3)
    ap.add_argument("--out", default="benchmarks/results/frontend-cpu.json")
    a = ap.parse_args()
    res = _run_all(a)
    by = {d: [r for r in res["rows"] if r["detokenize"] is d] for d in (True, False)}

    med = statistics.median
    on = med([r["frontend_cpu_ms_per_job"] for r in by[True]])
    off = med([r["frontend_cpu_ms_per_job"] for r in by[False]])
    dec = med([r["worker_decode_ms_per_job"] for r in by[False]])
    res.update(summary={"frontend_ms_per_job_detokenizing": on, "frontend_ms_per_job_not": off,
                        "worker_decode_ms_per_job": dec, "frontend_saved": 1 - off / on},
               meta={"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                     "args": vars(a)})  # fmt: skip
    print(f"{a.jobs} requests of {a.prompt_tokens} prompt tokens and {a.max_tokens} output "
          f"tokens, medians of {a.rounds} rounds")  # fmt: skip
    print("| vLLM detokenizes | frontend CPU ms/request | worker decode ms/request |")
    print("|---|---|---|")
    print(f"| yes | {on:.3f} | - |")
    print(f"| no | {off:.3f} | {dec:.3f} |")
    print(
        f"frontend CPU saved: {1 - off / on:.1%}; texts equal to vLLM's: "
        f"{res['texts_compared'] - res['texts_mismatched']} of {res['texts_compared']}"
    )
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=2))


def _run_all(a: argparse.Namespace) -> dict[str, Any]:
    res = asyncio.run(_main(a))
    gc.collect()  # the engine's finalizer, while the interpreter can still run it
    return res


if __name__ == "__main__":
    main()
