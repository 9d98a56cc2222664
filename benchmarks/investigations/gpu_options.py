"""The seed notes' options, measured through the real queue: one worker, one GPU.

    python -m benchmarks.investigations.gpu_options --model /tmp/models/qwen05 --out $OUT

1. System prompt: the same summary jobs with no system turn, vqueue's default (one sentence) and
   a verbose ~300-character one. Time to first token (engine: first token - job start) one job
   at a time, where the prompt's length is all there is, and jobs/s under a full batch.
2. Context limits: long documents (~24K tokens) summarized under per-job input limits of 2K, 8K,
   16K and none, truncated head_tail: jobs/s and prompt tokens.
3. Guided JSON: extract jobs, then the same prompts as unconstrained chat jobs forced to the same
   output lengths, job by job: the wall-time ratio is guided decoding's cost.

Output length is fixed (ignore_eos, min_tokens = max_tokens) since the model may be random
weights. Prints a table, writes options.json and options.md under --out. Runs on a CPU host
at --scale 0.02 with small documents, which is how the script itself is checked.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path
from typing import Any

from benchmarks import plugin_env
from schemas import Settings

from ..gpu_suite import launch_worker, pct, stop
from ..workloads import WORDS

ROOT = Path(__file__).resolve().parent.parent
VERBOSE = (
    "You are a highly capable, thoughtful and precise assistant. You always read the whole "
    "text carefully, identify its main points, its supporting details and its conclusions, and "
    "you write summaries that are accurate, neutral, well organised and easy to read for a "
    "busy professional audience, without adding facts."
)
SHORT_DOC = (
    "The regional transport office published its quarterly report on Monday. Ridership grew on "
    "every line, and the new night buses carried twice the expected passengers."
)


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--doc-words", type=int, default=18000, help="~1.3 tokens a word")
    ap.add_argument("--max-model-len", type=int, default=32768)
    ap.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--kv-cache-bytes", type=int, default=0)
    ap.add_argument("--sections", default="system,long,json")
    a = ap.parse_args()
    sections = set(a.sections.split(","))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    import redis

    from producer import Client

    r = redis.Redis.from_url(a.redis)
    r.flushdb()
    env = dict(
        plugin_env(),
        VQUEUE_BROKER_URL=a.redis,
        VQUEUE_QUEUE="opts",
        VQUEUE_MODEL=a.model,
        VQUEUE_MAX_MODEL_LEN=str(a.max_model_len),
        VQUEUE_HEARTBEAT_S="1",
        VQUEUE_METRICS_PORT="9808",
    )
    if a.kv_cache_bytes:
        env["VQUEUE_KV_CACHE_MEMORY_BYTES"] = str(a.kv_cache_bytes)
    proc, log, start_s = launch_worker(
        "opts@gpu", env, out / "options-worker.log", a.redis, "-l", "INFO", "--metrics-port", "9808"
    )
    rows: list[dict[str, Any]] = []
    n = lambda x: max(2, int(x * a.scale))  # noqa: E731
    try:
        client = Client(Settings(_env_file=None, broker_url=a.redis, queue="opts"))

        def run(name: str, jobs: list[dict[str, Any]], one_at_a_time: bool = False) -> None:
            t = time.perf_counter()
            res = []
            if one_at_a_time:
                for j in jobs:
                    res += list(client.submit_many([j]).results(timeout=600))
            else:
                res = list(client.submit_many(jobs).results(timeout=1200))
            wall = time.perf_counter() - t
            ok = [x for x in res if x.status == "completed"]
            ttft = [
                x.timings.first_token_at - x.timings.started_at
                for x in ok
                if x.timings.first_token_at and x.timings.started_at
            ]
            row = {
                "run": name,
                "jobs": len(res),
                "failed": len(res) - len(ok),
                "wall_s": round(wall, 2),
                "jobs_per_s": round(len(res) / wall, 2),
                "prompt_tokens_mean": round(sum(x.usage.prompt_tokens for x in ok) / len(ok), 1)
                if ok
                else None,
                "truncated_tokens_mean": round(
                    sum(x.input_tokens_truncated for x in ok) / len(ok), 1
                )
                if ok
                else None,
                "ttft_p50_ms": round(pct(ttft, 50) * 1000, 1) if ttft else None,
                "ttft_p90_ms": round(pct(ttft, 90) * 1000, 1) if ttft else None,
                "errors": sorted({x.error.type for x in res if x.error}),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)

        rng = random.Random(7)
        fixed = {"max_tokens": 128, "min_tokens": 128, "ignore_eos": True}
        warm = [{"type": "summarize", "text": SHORT_DOC, **fixed} for _ in range(n(64))]
        run("warmup", warm)
        rows.pop()
        systems = {"none": "", "default": None, "verbose": VERBOSE}
        for label, system in systems.items() if "system" in sections else ():
            extra = {} if system is None else {"system": system}
            docs = [f"Report {i}. {SHORT_DOC}" for i in range(n(40))]
            jobs = [{"type": "summarize", "text": d, **fixed, **extra} for d in docs]
            run(f"system={label}, one at a time", jobs, one_at_a_time=True)
        for label, system in systems.items() if "system" in sections else ():
            extra = {} if system is None else {"system": system}
            docs = [f"Report {i}. {text(rng, 120)}" for i in range(n(2000))]
            jobs = [{"type": "summarize", "text": d, **fixed, **extra} for d in docs]
            run(f"system={label}, batch", jobs)
        docs = [text(rng, a.doc_words) for i in range(n(200))]
        for limit in (2048, 8192, 16384, None) if "long" in sections else ():
            extra: dict[str, Any] = {"truncation": "head_tail"}
            if limit:
                extra["max_input_tokens"] = limit
            # a different first line per run: no run reuses another's cached prefixes
            jobs = [
                {"type": "summarize", "text": f"Run {limit}, document {i}. {d}", **fixed, **extra}
                for i, d in enumerate(docs)
            ]
            run(f"long docs, max_input_tokens={limit or 'none'}", jobs)
        if "json" in sections:
            # 3. guided JSON vs the same prompts unconstrained, with the same output lengths: each
            # unconstrained job is forced to emit exactly as many tokens as its constrained twin
            from schemas import ExtractJob
            from worker.prompts import build_messages

            from ..workloads import SCHEMAS

            settings = Settings(_env_file=None)
            backend = os.environ.get("VQUEUE_STRUCTURED_OUTPUTS_BACKEND", "guidance")
            extract = [
                {"id": f"x{i}", "type": "extract", "text": text(rng, 300), "max_tokens": 256,
                 "json_schema": SCHEMAS[i % len(SCHEMAS)]}
                for i in range(n(1000))
            ]  # fmt: skip
            t = time.perf_counter()
            got = {x.id: x for x in client.submit_many(extract).results(timeout=1200)}
            json_wall = time.perf_counter() - t
            tokens = sum(x.usage.completion_tokens for x in got.values())
            rows.append(
                {"run": f"json, guided ({backend})", "jobs": len(got),
                 "wall_s": round(json_wall, 2), "jobs_per_s": round(len(got) / json_wall, 2),
                 "output_tok_per_s": round(tokens / json_wall), "output_tokens": tokens,
                 "failed": sum(1 for x in got.values() if x.status != "completed"),
                 "errors": sorted({x.error.type for x in got.values() if x.error})}
            )  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
            free = []
            for j in extract:
                k = max(1, got[j["id"]].usage.completion_tokens)
                msgs = build_messages(ExtractJob.model_validate(j), settings)
                free.append({"id": j["id"], "type": "chat", "messages": msgs, "max_tokens": k,
                             "min_tokens": k, "ignore_eos": True})  # fmt: skip
            t = time.perf_counter()
            res = list(client.submit_many(free).results(timeout=1200))
            free_wall = time.perf_counter() - t
            free_tokens = sum(x.usage.completion_tokens for x in res)
            rows.append(
                {"run": "json, same prompts and lengths unconstrained", "jobs": len(res),
                 "wall_s": round(free_wall, 2), "jobs_per_s": round(len(res) / free_wall, 2),
                 "output_tok_per_s": round(free_tokens / free_wall), "output_tokens": free_tokens,
                 "failed": sum(1 for x in res if x.status != "completed"),
                 "guided_vs_unconstrained": round(free_wall / json_wall, 3)}
            )  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
        try:
            import urllib.request

            page = urllib.request.urlopen("http://127.0.0.1:9808/metrics", timeout=5).read()
            (out / "options-metrics.txt").write_bytes(page)
        except OSError as exc:
            print(f"metrics endpoint: {exc}", flush=True)
    finally:
        stop(proc, log, 120)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "engine_start_s": start_s}
    try:
        import vllm

        meta["vllm"] = vllm.__version__
    except Exception:
        pass
    (out / "options.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    head = "| run | jobs | failed | jobs/s | prompt tok (mean) | cut tok (mean) | TTFT p50 ms"
    head += " | TTFT p90 ms |"
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for x in rows:
        lines.append(
            f"| {x['run']} | {x['jobs']} | {x['failed']} | {x['jobs_per_s']} | "
            f"{x.get('prompt_tokens_mean', '')} | {x.get('truncated_tokens_mean', '')} | "
            f"{x.get('ttft_p50_ms', '')} | {x.get('ttft_p90_ms', '')} |"
        )
    table = "\n".join(lines)
    (out / "options.md").write_text(f"{json.dumps(meta)}\n\n{table}\n")
    print(table)


if __name__ == "__main__":
    main()
