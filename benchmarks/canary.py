"""Canary-gated batches (``vqueue submit --canary``): what a canary saves on a bad batch, and
that good batches pass it (producer/canary.py).

    python -m benchmarks.canary --model /tmp/models/qwen05 --out $OUT/canary --jobs 2000

One worker. Two seeded bad batches, each run twice through the real ``vqueue submit``: whole,
without a canary, then as a new batch behind ``--canary 2%``, which pauses it (exit 12).
Reported for each: wall time and generated tokens of both runs, and what the canary saved.

- ``long answers``: summaries under a system prompt that asks for an essay (``max_tokens``
  ``--out-tokens``): what a template that leaves the answer no end does;
- ``unfinishable schema``: extraction into a schema that wants more items than
  ``max_tokens`` can hold: every answer ends ``schema_incomplete``.

Then good batches behind the same canary, none of which may pause: the suite's mixed and JSON
workloads (benchmarks/workloads.py) and the quality set's extraction, summary and codegen cases
(benchmarks/quality.py). The script exits 1 when a bad batch passes or a good one pauses.

On a CPU host use the embedded model and fewer, shorter jobs (``--model
smollm2-135m-instruct --jobs 60 --text-tokens 100 --out-tokens 48``). Writes canary.json and
canary.md under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from . import quality
from . import workloads as wl
from .gpu_suite import own_worker, stop

ESSAY = "Answer with a long, detailed essay of many paragraphs, and never stop early."
TOO_MANY = {"type": "object", "required": ["names"], "properties": {"names": {
    "type": "array", "minItems": 64, "items": {"type": "string", "minLength": 4}}}}  # fmt: skip


def bad_batches(texts: wl.TextMaker, n: int, size: int, out: int) -> dict[str, list[Any]]:
    return {
        "long answers": [{"id": f"l{i}", "type": "summarize", "text": texts.tokens(size),
                          "system": ESSAY, "max_tokens": out} for i in range(n)],
        "unfinishable schema": [{"id": f"u{i}", "type": "extract", "text": texts.tokens(size),
                                 "json_schema": TOO_MANY, "max_tokens": out} for i in range(n)],
    }  # fmt: skip


def good_batches(texts: wl.TextMaker, n: int) -> dict[str, list[dict[str, Any]]]:
    cases = [quality.extract_job(c) for c in quality.EXTRACT]
    cases += [quality.summary_job(c) for c in quality.SUMMARIES]
    cases += [quality.code_job(c) for c in quality.CODE]
    return {
        "suite: mixed": wl.mixed(texts, n, out=64),
        "suite: json": wl.json_heavy(texts, n, out=128),
        "quality set": cases,
    }


class Cli:
    """The real ``vqueue`` command on the worker's queue and key prefix."""

    def __init__(self, w: Any, redis_url: str, out: Path) -> None:
        s = w.client.settings
        self.env = {**os.environ, "VQUEUE_BROKER_URL": redis_url, "VQUEUE_QUEUE": s.queue,
                    "VQUEUE_KEY_PREFIX": s.key_prefix}  # fmt: skip
        self.client, self.out = w.client, out

    def run(self, name: str, jobs: list[dict[str, Any]], *args: str) -> dict[str, Any]:
        path = self.out / (name.replace(" ", "-").replace(":", "") + ".jsonl")
        path.write_text("".join(json.dumps(j) + "\n" for j in jobs))
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "producer.cli", "submit", str(path), "--wait", "-q", "--json",
             *args], env=self.env, capture_output=True, timeout=7200,
        )  # fmt: skip
        wall = time.perf_counter() - t0
        lines = proc.stdout.decode().splitlines()
        batch = json.loads(lines[-1])["batch"] if lines else None
        st = self.client.store.status(batch) if batch else None
        results = list(self.client.store.iter_all(batch)) if batch else []
        row: dict[str, Any] = {
            "batch": name,
            "args": " ".join(args),
            "exit": proc.returncode,
            "lines": len(jobs),
            "ran": len(results),
            "wall_s": round(wall, 2),
            "generated_tokens": sum(r.usage.completion_tokens for r in results),
            "paused": bool(st and st.paused),
            "canary": st.canary.model_dump() if st and st.canary else None,
        }
        if proc.returncode not in (0, 12):
            row["stderr"] = proc.stderr.decode()[-2000:]
        if batch and row["paused"]:
            row["batch_id"] = batch
        return row

    def whole(self, row: dict[str, Any], jobs: list[dict[str, Any]]) -> dict[str, Any]:
        """A paused batch resumed and run to its end: the shares of the whole batch, which
        say whether the canary judged it right."""
        from producer.canary import judge
        from schemas import Envelope

        batch = row["batch_id"]
        subprocess.run([sys.executable, "-m", "producer.cli", "resume", batch, "-q"],
                       env=self.env, capture_output=True, timeout=600, check=True)  # fmt: skip
        self.client.batch(batch).wait(timeout=7200)
        envs = [Envelope.model_validate({"job": j, "batch": batch, "enqueued_at": 0.0})
                for j in jobs]  # fmt: skip
        report = judge(envs, self.client.store.iter_all(batch), self.client.settings)
        return report.model_dump()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--jobs", type=int, default=2000, help="lines per generated batch")
    ap.add_argument("--canary", default="2%")
    ap.add_argument("--text-tokens", type=int, default=300, help="bad batches' input length")
    ap.add_argument("--out-tokens", type=int, default=128, help="bad batches' max_tokens")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    from worker.models import resolve_model

    texts = wl.TextMaker.of_model(resolve_model(a.model))
    w = own_worker("canary", a.model, a.redis, out / "worker.log", VQUEUE_RESULT_CACHE="false",
                   VQUEUE_LOAD_FORMAT=a.load_format)  # fmt: skip
    cli = Cli(w, a.redis, out)
    bad, good, problems = [], [], []
    try:
        for name, jobs in bad_batches(texts, a.jobs, a.text_tokens, a.out_tokens).items():
            whole = cli.run(name, jobs)
            gated = cli.run(name, jobs, "--canary", a.canary)
            tokens = "generated_tokens"
            saved = {
                "wall": 1 - gated["wall_s"] / max(whole["wall_s"], 1e-9),
                tokens: 1 - gated[tokens] / max(whole[tokens], 1),
            }
            bad.append({"batch": name, "whole": whole, "canary": gated, "saved": saved})
            if not gated["paused"]:
                problems.append(f"{name}: its canary passed")
        for name, jobs in good_batches(texts, a.jobs).items():
            row = cli.run(name, jobs, "--canary", a.canary)
            good.append(row)
            if row["paused"] or row["exit"] != 0:
                problems.append(f"{name}: paused or failed (exit {row['exit']})")
            if row["paused"]:
                row["whole_batch"] = cli.whole(row, jobs)
    finally:
        stop(w.proc, w.log, 60)

    report = {
        "command": " ".join(["python -m benchmarks.canary", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "worker_start_s": w.start_s,
        "bad": bad,
        "good": good,
        "problems": problems,
    }
    (out / "canary.json").write_text(json.dumps(report, indent=1))
    lines = [
        "| bad batch | lines | whole: wall s, tokens | behind the canary: jobs run, wall s, "
        "tokens | saved (wall, tokens) | canary said |",
        "|---|---|---|---|---|---|",
        *(f"| {b['batch']} | {b['whole']['lines']} | {b['whole']['wall_s']:.1f}, "
          f"{b['whole']['generated_tokens']:,} | {b['canary']['ran']}, "
          f"{b['canary']['wall_s']:.1f}, {b['canary']['generated_tokens']:,} | "
          f"{b['saved']['wall']:.0%}, "
          f"{b['saved']['generated_tokens']:.0%} | "
          f"{'; '.join((b['canary']['canary'] or {}).get('reasons', [])) or 'passed'} |"
          for b in bad),
        "",
        "| good batch | lines | exit | paused | wall s | canary | the whole batch, if paused |",
        "|---|---|---|---|---|---|---|",
        *(f"| {g['batch']} | {g['lines']} | {g['exit']} | {g['paused']} | {g['wall_s']:.1f} | "
          f"{_summary(g['canary'])} | {_summary(g.get('whole_batch'))} |" for g in good),
        "",
        f"{len(problems)} problem(s)" + "".join(f"\n- {p}" for p in problems),
    ]  # fmt: skip
    (out / "canary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    sys.exit(1 if problems else 0)


def _summary(report: dict[str, Any] | None) -> str:
    if not report:
        return "-"
    from schemas import CanaryReport

    return CanaryReport.model_validate(report).summary()


if __name__ == "__main__":
    main()
