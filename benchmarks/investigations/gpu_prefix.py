"""Prefix gating and grouping on a prefix-heavy workload, through the real queue, one GPU.

    python -m benchmarks.investigations.gpu_prefix --model /tmp/models/qwen05 --out $OUT

50 code contexts of ~1,000 tokens, 40 codegen jobs on each with ~200-token instructions, 128
output tokens, shuffled. Run twice on a fresh worker each time: with prefix gating (worker) and
prefix grouping (producer) on, then both off. Reports jobs/s and the prefix-cache hit rate as a
share of the *shareable* prefix tokens (every job of a group but its first could reuse the
group's prefix). Writes prefix.json and prefix.md under --out.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

from benchmarks import plugin_env
from schemas import CodegenJob, Settings

from ..gpu_suite import launch_worker, stop
from ..workloads import WORDS

ROOT = Path(__file__).resolve().parent.parent


def code(rng: random.Random, lines: int) -> str:
    out = []
    for i in range(lines):
        a, b = rng.choice(WORDS), rng.choice(WORDS)
        out.append(f"def {a}_{b}_{i}(x):\n    return x.{a}({b!r}, {i})\n")
    return "\n".join(out)


def shared_prefix_tokens(tokenizer: Any, jobs: list[dict[str, Any]]) -> int:
    """Tokens two jobs of one group have in common at the start of their rendered prompts."""
    from worker.prompts import build_messages, render

    s = Settings(_env_file=None)
    a, b = (render(tokenizer, build_messages(CodegenJob.model_validate(j), s)) for j in jobs[:2])
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def run_once(a: argparse.Namespace, label: str, on: bool, jobs: list[dict[str, Any]]) -> dict:
    import redis

    from producer import Client

    r = redis.Redis.from_url(a.redis)
    r.flushdb()
    env = dict(
        plugin_env(),
        VQUEUE_BROKER_URL=a.redis,
        VQUEUE_QUEUE="prefix",
        VQUEUE_MODEL=a.model,
        VQUEUE_MAX_MODEL_LEN="4096",
        VQUEUE_HEARTBEAT_S="1",
        VQUEUE_PREFIX_GATING="true" if on else "false",
    )
    log_path = Path(a.out) / f"prefix-worker-{'on' if on else 'off'}.log"
    proc, log, _ = launch_worker("prefix@gpu", env, log_path, a.redis, "-l", "WARNING")
    try:
        s = Settings(_env_file=None, broker_url=a.redis, queue="prefix", prefix_routing=on)
        client = Client(s)
        warm = [{"type": "summarize", "text": "warm up", "max_tokens": 16} for _ in range(64)]
        client.submit_many(warm).wait(timeout=600)
        t = time.perf_counter()
        batch = client.submit_many(jobs)
        res = list(batch.results(timeout=1200))
        wall = time.perf_counter() - t
        st = batch.status()
    finally:
        stop(proc, log, 120)
    return {
        "run": label,
        "jobs": len(res),
        "failed": sum(1 for x in res if x.status != "completed"),
        "wall_s": round(wall, 2),
        "jobs_per_s": round(len(res) / wall, 2),
        "prompt_tokens": st.prompt_tokens,
        "cached_tokens": st.cached_tokens,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--groups", type=int, default=50)
    ap.add_argument("--per-group", type=int, default=40)
    ap.add_argument("--context-lines", type=int, default=45, help="~22 tokens a line")
    ap.add_argument("--instruction-words", type=int, default=150)
    ap.add_argument("--out-tokens", type=int, default=128)
    ap.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    from transformers import AutoTokenizer

    from worker.models import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(a.model))
    rows = []
    for label, on in (("gating + grouping on", True), ("gating + grouping off", False)):
        rng = random.Random(1 if on else 2)
        fixed = {"max_tokens": a.out_tokens, "min_tokens": a.out_tokens, "ignore_eos": True}
        groups = [code(rng, a.context_lines) for _ in range(a.groups)]
        jobs = [
            {"type": "codegen", "context": ctx,
             "instruction": " ".join(rng.choice(WORDS) for _ in range(a.instruction_words)),
             **fixed}
            for ctx in groups
            for _ in range(a.per_group)
        ]  # fmt: skip
        rng.shuffle(jobs)
        prefix = shared_prefix_tokens(tokenizer, [j for j in jobs if j["context"] == groups[0]])
        row = run_once(a, label, on, jobs)
        shareable = (len(jobs) - a.groups) * prefix
        row.update(
            shared_prefix_tokens=prefix,
            shareable_tokens=shareable,
            hit_rate_of_shareable=round(row["cached_tokens"] / shareable, 4),
            hit_rate_of_prompt=round(row["cached_tokens"] / max(row["prompt_tokens"], 1), 4),
        )
        rows.append(row)
        print(json.dumps(row), flush=True)
    (out / "prefix.json").write_text(json.dumps(rows, indent=2))
    lines = ["| run | jobs | jobs/s | prefix tokens | cached / shareable | cached / prompt |"]
    lines.append("|---|---|---|---|---|---|")
    for x in rows:
        lines.append(
            f"| {x['run']} | {x['jobs']} | {x['jobs_per_s']} | {x['shared_prefix_tokens']} | "
            f"{x['hit_rate_of_shareable']:.1%} | {x['hit_rate_of_prompt']:.1%} |"
        )
    (out / "prefix.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
