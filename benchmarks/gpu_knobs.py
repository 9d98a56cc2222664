"""The seed notes' engine knobs through vqueue end to end, on equal work: weights in bf16
against FP8, GPTQ int4 and AWQ int4; the KV cache in fp8 against the model's dtype; CUDA graphs
against eager; vLLM's attention backends.

    python -m benchmarks.gpu_knobs --model /tmp/models/qwen05 --out $OUT/knobs-05b \\
        --knobs bf16,fp8,gptq,awq,kv-fp8,eager --workloads chat,long --rounds 2

Every knob is one ``vqueue worker`` with its own engine; all of them are resident on the GPU at
once, each with the same KV cache in bytes (``--kv-cache-bytes``), and each round runs every
workload on every worker back to back, the order rotating from round to round (paired rounds).
Round 0, smaller, is not measured. The int4 checkpoints are the model's folder with a GPTQ or
AWQ ``quantization_config`` and no weight files, loaded with ``load_format=dummy``: vLLM makes
the packed int4 weights, zeros and scales itself, with the shapes and kernels (Marlin on
Hopper) a real checkpoint gets, so speed and memory are a real checkpoint's; the text is noise.

Equal work: every job's output length is fixed (``ignore_eos``, ``min_tokens``), so every knob
generates the same tokens from the same prompts; the script exits 1 when a row's generated
tokens differ by more than 1% from the bf16 row of its round. ``chat`` is the suite's mixed
workload without its extraction jobs (guided JSON cannot be held to a length, and a quantized
model's JSON is not the same length as bf16's). ``s1`` is the seed notes' summary setting behind
their S1 row (GPTQ int4 at 32K context): 40 documents of 32K tokens at scale 1, 256 tokens out
(``--max-model-len`` 40960 and a KV cache that holds a few such documents). Per row: jobs/s,
output tok/s, TTFT p50/p99; per knob: its engine's start time (all start at once, so each is
slower than alone), the weights' memory and the KV cache's size in tokens (its bytes are
``--kv-cache-bytes``), read from vLLM's log.

Writes knobs.json and knobs.md under ``--out`` after every round.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from . import workloads as wl
from .gpu_suite import GpuWatch, OwnWorker, build, own_worker, stop, vqueue_row

INT4 = {
    # as GPTQModel writes it: 4 bits, groups of 128, no act-order, symmetric, and the layers it
    # quantized (without them vLLM reads that list off the weight files, and there are none)
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False,
             "sym": True, "lm_head": False, "modules_in_block_to_quantize": [
                 ["self_attn.k_proj", "self_attn.v_proj", "self_attn.q_proj"],
                 ["self_attn.o_proj"], ["mlp.up_proj", "mlp.gate_proj"], ["mlp.down_proj"]]},
    # as AutoAWQ writes it (GEMM kernels' layout)
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
            "version": "gemm"},
}  # fmt: skip

# each knob: the worker's settings beside the shared ones
KNOBS: dict[str, dict[str, str]] = {
    "bf16": {},
    "fp8": {"VQUEUE_QUANTIZATION": "fp8"},  # vLLM quantizes the bf16 weights as it loads them
    "gptq": {"VQUEUE_LOAD_FORMAT": "dummy", "VQUEUE_DTYPE": "float16"},
    "awq": {"VQUEUE_LOAD_FORMAT": "dummy", "VQUEUE_DTYPE": "float16"},
    "kv-fp8": {"VQUEUE_KV_CACHE_DTYPE": "fp8"},
    "eager": {"VQUEUE_ENFORCE_EAGER": "true"},
    "triton-attn": {"VQUEUE_ATTENTION_BACKEND": "TRITON_ATTN"},
    "flex-attn": {"VQUEUE_ATTENTION_BACKEND": "FLEX_ATTENTION"},
    # not an engine knob: the logprob early stop's in-engine monitor, off (what watching costs)
    "no-monitor": {"VQUEUE_CONFIDENCE_MONITOR": "false"},
}

# what vLLM logs of an engine's memory (0.26 and 0.32 word these lines alike)
_LOG = {
    "weights_gib": re.compile(r"Model loading took ([\d.]+) GiB"),
    "kv_cache_tokens": re.compile(r"[GC]PU KV cache size: ([\d,]+) tokens"),
    "graphs_gib": re.compile(r"Graph capturing finished in \d+ secs, took ([\d.]+) GiB"),
}


def int4_dir(src: Path, method: str, dst: Path) -> Path:
    """``src``'s config and tokenizer, no weights, its config saying ``method``'s int4."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix not in (".safetensors", ".bin", ".pt"):
            shutil.copy(f, dst / f.name)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = INT4[method]
    config["torch_dtype"] = "float16"  # the int4 kernels' activations
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def chat(t: wl.TextMaker, n: int) -> list[dict[str, Any]]:
    """The suite's mixed workload less its extraction jobs: every output 128 tokens."""
    return [j for j in wl.mixed(t, n + n // 2) if j["type"] != "extract"][:n]


def s1(t: wl.TextMaker, n: int, in_tokens: int = 32000) -> list[dict[str, Any]]:
    """The seed notes' summary setting, which their S1 row (GPTQ int4 at 32K context) measured:
    documents of 32K tokens, 256 output tokens each."""
    return wl.long_context(t, n, in_tokens=in_tokens, out=256)


def memory_of(log: Path) -> dict[str, Any]:
    text = log.read_text(errors="replace") if log.exists() else ""
    got: dict[str, Any] = {}
    for key, pattern in _LOG.items():
        m = pattern.search(text)
        if m:
            v = m.group(1).replace(",", "")
            got[key] = int(v) if key == "kv_cache_tokens" else float(v)
    return got


def summarize(rows: list[dict[str, Any]], knobs: list[str]) -> list[dict[str, Any]]:
    """Per workload and knob: medians over the rounds, and the median of the per-round ratio
    to bf16 (paired: each round's bf16 row ran beside it)."""
    out = []
    for w in dict.fromkeys(r["workload"] for r in rows):
        for k in knobs:
            mine = [r for r in rows if r["workload"] == w and r["system"] == k]
            if not mine:
                continue
            ratios = []
            for r in mine:
                base = [b for b in rows if b["workload"] == w and b["system"] == "bf16"
                        and b["round"] == r["round"]]  # fmt: skip
                if base:
                    ratios.append(r["jobs_per_s"] / base[0]["jobs_per_s"])

            def med(key: str, xs: list[dict[str, Any]] = mine) -> float | None:
                vals = [x[key] for x in xs if x.get(key) is not None]
                return statistics.median(vals) if vals else None

            out.append({
                "workload": w, "knob": k, "rounds": len(mine),
                "jobs_per_s": med("jobs_per_s"), "out_tok_per_s": med("out_tok_per_s"),
                "ttft_p50_s": med("ttft_p50_s"), "ttft_p99_s": med("ttft_p99_s"),
                "vs_bf16": statistics.median(ratios) if ratios else None,
                "ratios": ratios, "failed": sum(x["failed"] for x in mine),
            })  # fmt: skip
    return out


def table(summary: list[dict[str, Any]], engines: dict[str, dict[str, Any]]) -> str:
    def f(x: Any, fmt: str = ".2f") -> str:
        return "-" if x is None else format(x, fmt)

    lines = [
        "| workload | knob | jobs/s | out tok/s | TTFT p50 s | TTFT p99 s | vs bf16 | failed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in summary:
        lines.append(
            f"| {s['workload']} | {s['knob']} | {f(s['jobs_per_s'])} | "
            f"{f(s['out_tok_per_s'], '.0f')} | {f(s['ttft_p50_s'])} | {f(s['ttft_p99_s'])} | "
            f"{f(s['vs_bf16'], '.1%')} | {s['failed']} |"
        )
    lines += ["", "| knob | start s | weights GiB | KV tokens | graphs GiB |",
              "|---|---|---|---|---|"]  # fmt: skip
    for k, e in engines.items():
        lines.append(
            f"| {k} | {f(e.get('start_s'), '.0f')} | {f(e.get('weights_gib'))} | "
            f"{f(e.get('kv_cache_tokens'), ',')} | "
            f"{f(e.get('graphs_gib'))} | " + (f"failed: {e['error']}" if e.get("error") else "")
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--load-format", default="auto", help="dummy: the model has no weights")
    ap.add_argument("--out", required=True)
    ap.add_argument("--knobs", default="bf16,fp8,gptq,awq,kv-fp8,eager")
    ap.add_argument(
        "--workloads",
        default="chat,long",
        help="chat; s1 (32K-token documents, 256 tokens out); the suite's: prefix, long, "
        "long32k, json",
    )
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--scale", type=float, default=0.6, help="1.0: chat 1,000, long 200, ...")
    ap.add_argument("--warm-scale", type=float, default=0.1)
    ap.add_argument("--kv-cache-bytes", type=int, default=6 * 1024**3)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.12)
    ap.add_argument("--max-model-len", type=int, default=10240)
    ap.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--budget-s", type=float, default=0, help="start no round past this (0: none)")
    a = ap.parse_args()
    began = time.perf_counter()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    knobs = [k.strip() for k in a.knobs.split(",")]
    if unknown := set(knobs) - set(KNOBS):
        ap.error(f"unknown knobs: {sorted(unknown)}")
    if "bf16" not in knobs:
        ap.error("bf16 is the baseline every ratio is taken against: keep it in --knobs")
    names = [w.strip() for w in a.workloads.split(",")]
    texts = wl.TextMaker.of_model(a.model)

    def loads(scale: float, seed: int) -> dict[str, list[dict[str, Any]]]:
        small = scale < 0.1 and a.scale < 0.1
        suite = [w for w in names if w not in ("chat", "s1")]
        got = build(texts, scale, suite, seed=seed, small=small)
        if "chat" in names:
            texts.rng.seed(seed)
            got = {"chat": chat(texts, max(3, round(1000 * scale))), **got}
        if "s1" in names:
            texts.rng.seed(seed)
            got["s1"] = s1(texts, max(2, round(40 * scale)), 3000 if small else 32000)
        return got

    shared = {
        "VQUEUE_MAX_MODEL_LEN": str(a.max_model_len),
        "VQUEUE_GPU_MEMORY_UTILIZATION": str(a.gpu_memory_utilization),
        "VQUEUE_KV_CACHE_MEMORY_BYTES": str(a.kv_cache_bytes),
        "VQUEUE_LOAD_FORMAT": a.load_format,
        "VQUEUE_LOOP_DETECTION": "off",  # random weights loop; equal work needs no retries
        "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1",
    }
    workers: dict[str, OwnWorker] = {}
    engines: dict[str, dict[str, Any]] = {}
    meta = {"command": " ".join(sys.argv), "model": a.model, "kv_cache_bytes": a.kv_cache_bytes,
            "started": time.strftime("%Y-%m-%d %H:%M:%S")}  # fmt: skip
    rows: list[dict[str, Any]] = []

    def save() -> None:
        summary = summarize(rows, knobs)
        doc = {"meta": meta, "engines": engines, "summary": summary, "rows": rows}
        (out / "knobs.json").write_text(json.dumps(doc, indent=1))
        (out / "knobs.md").write_text(table(summary, engines))

    import threading

    def start(k: str) -> None:
        env = {**shared, **KNOBS[k]}
        model = a.model
        if k in INT4:
            model = str(int4_dir(Path(a.model), k, out / f"model-{k}"))
        log = out / f"worker-{k}.log"
        try:
            workers[k] = own_worker(k, model, a.redis, log, "-l", "INFO", **env)
            engines[k] = {"start_s": workers[k].start_s, **memory_of(log)}
        except Exception as exc:  # noqa: BLE001  # a knob this vLLM or card refuses: say so
            engines[k] = {"error": f"{type(exc).__name__}: {exc}", **memory_of(log)}

    threads = []
    for k in knobs:  # all at once: each waits minutes for torch.compile and CUDA graphs
        threads.append(threading.Thread(target=start, args=(k,)))
        threads[-1].start()
        time.sleep(5)  # not all measuring free memory in the same instant
    for t in threads:
        t.join()
    save()
    live = [k for k in knobs if k in workers]
    print(f"engines up after {time.perf_counter() - began:.0f}s: {live}", flush=True)
    watch = GpuWatch()
    try:
        for rnd in range(a.rounds + 1):
            work = loads(a.warm_scale * a.scale if rnd == 0 else a.scale, rnd)
            took = 0.0
            for w, jobs in work.items():
                order = live[rnd % len(live) :] + live[: rnd % len(live)]
                t0 = time.perf_counter()
                for k in order:
                    t1 = time.time()
                    r = vqueue_row(workers[k].client, w, jobs, rnd, a.timeout, system=k)
                    r.update(watch.during(t1, time.time()))
                    if rnd:
                        rows.append(r)
                    print(f"round {rnd} {w:<8} {k:<12} {r['jobs_per_s']:8.2f} jobs/s "
                          f"{r['generated_tokens']} tokens", flush=True)  # fmt: skip
                took += time.perf_counter() - t0
            save()
            if a.budget_s and time.perf_counter() - began + took > a.budget_s:
                print(f"stopping: another round would pass --budget-s {a.budget_s:g}")
                break
    finally:
        for k, wk in workers.items():
            engines[k].update({key: v for key, v in memory_of(out / f"worker-{k}.log").items()
                               if key not in engines[k]})  # fmt: skip
            stop(wk.proc, wk.log, 60)
        save()
    print(table(summarize(rows, knobs), engines))
    unequal = [
        (r["workload"], r["system"], r["round"]) for r in rows
        for b in rows if b["system"] == "bf16" and (b["workload"], b["round"]) ==
        (r["workload"], r["round"]) and abs(r["generated_tokens"] - b["generated_tokens"])
        > 0.01 * b["generated_tokens"]
    ]  # fmt: skip
    if unequal:
        print(f"UNEQUAL WORK (generated tokens differ from bf16 by >1%): {unequal}")
        sys.exit(1)


if __name__ == "__main__":
    main()
