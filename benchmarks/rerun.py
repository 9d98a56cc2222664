"""A dataset run again after a few lines changed: what the result cache saves (worker/cache.py).

    python -m benchmarks.rerun --model /tmp/models/qwen05 --out $OUT/rerun --jobs 10000

One worker with the result cache on runs the suite's mixed workload (summarize, extract,
codegen; greedy, output lengths fixed where a length can be) as a batch, then the same file with
``--edit`` of its lines changed (a sentence appended to the document), as a new batch. Reported
per run: wall time, jobs answered from the cache, and the tokens the engine processed (prompt
and generated tokens of the jobs it ran; a cached job's usage is the first run's, so it is not
counted again). The check: every unchanged line's ``text`` and ``data`` in the second run equal
the first run's, byte for byte, and every edited line ran in the engine; the script exits 1
otherwise. The target (issue 41): the second run's wall time and engine tokens at most 10% of
the first's with 5% of the lines edited.

On a CPU host use the embedded model and a few hundred jobs (``--model smollm2-135m-instruct
--jobs 300``). Writes rerun.json and rerun.md under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

from . import workloads as wl
from .gpu_suite import own_worker, stop


def run(client: Any, jobs: list[dict[str, Any]], timeout: float) -> dict[str, Any]:
    t0 = time.perf_counter()
    batch = client.submit_many(jobs)
    results = {r.id: r for r in batch.results(timeout=timeout)}
    wall = time.perf_counter() - t0
    ran = [r for r in results.values() if not r.cached]
    return {
        "batch": batch.id,
        "wall_s": wall,
        "jobs": len(results),
        "failed": sum(r.status != "completed" for r in results.values()),
        "cached": len(results) - len(ran),
        "engine_prompt_tokens": sum(r.usage.prompt_tokens for r in ran),
        "engine_generated_tokens": sum(r.usage.completion_tokens for r in ran),
        "results": results,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--jobs", type=int, default=10_000)
    ap.add_argument("--edit", type=float, default=0.05, help="share of lines changed")
    ap.add_argument("--out-tokens", type=int, default=128)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--timeout", type=float, default=3600)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    from worker.models import resolve_model

    texts = wl.TextMaker.of_model(resolve_model(a.model))
    first = wl.mixed(texts, a.jobs, out=a.out_tokens)
    edited = set(random.Random(7).sample(range(len(first)), round(len(first) * a.edit)))
    second = []
    for i, job in enumerate(first):
        job = dict(job)
        if i in edited:  # the document (or a codegen job's instruction) gains a sentence
            field = "text" if "text" in job else "instruction"
            job[field] = job[field] + " This line was edited."
        second.append(job)

    w = own_worker("rerun", a.model, a.redis, out / "worker.log", VQUEUE_RESULT_CACHE="true",
                   VQUEUE_LOAD_FORMAT=a.load_format)  # fmt: skip
    try:
        one = run(w.client, first, a.timeout)
        two = run(w.client, second, a.timeout)
    finally:
        stop(w.proc, w.log, 60)

    problems = []
    for i, job in enumerate(second):
        before, after = one["results"][job["id"]], two["results"][job["id"]]
        if i in edited:
            if after.cached:
                problems.append(f"{job['id']}: edited, answered from the cache")
        elif (after.text, json.dumps(after.data)) != (before.text, json.dumps(before.data)):
            problems.append(f"{job['id']}: unchanged line, a different answer")
        elif before.status == "completed" and not after.cached:
            problems.append(f"{job['id']}: unchanged line, ran again")

    def share(key: str) -> float:
        return float(two[key]) / max(float(one[key]), 1e-9)

    engine = ("engine_prompt_tokens", "engine_generated_tokens")
    ratio = {
        "wall": share("wall_s"),
        "engine_tokens": sum(two[k] for k in engine) / max(sum(one[k] for k in engine), 1),
    }
    rows = [{k: v for k, v in r.items() if k != "results"} for r in (one, two)]
    report = {
        "command": " ".join(["python -m benchmarks.rerun", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "worker_start_s": w.start_s,
        "edited": len(edited),
        "runs": rows,
        "second_vs_first": ratio,
        "problems": problems[:50],
        "problem_count": len(problems),
    }
    (out / "rerun.json").write_text(json.dumps(report, indent=1))
    lines = [
        "| run | jobs | failed | from cache | wall s | engine prompt tokens | engine generated |",
        "|---|---|---|---|---|---|---|",
        *(f"| {n} | {r['jobs']} | {r['failed']} | {r['cached']} | {r['wall_s']:.1f} | "
          f"{r['engine_prompt_tokens']:,} | {r['engine_generated_tokens']:,} |"
          for n, r in zip(("first", f"second ({len(edited)} lines edited)"), rows, strict=True)),
        "",
        f"second / first: wall {ratio['wall']:.1%}, engine tokens {ratio['engine_tokens']:.1%}; "
        f"{len(problems)} problem(s)",
    ]  # fmt: skip
    (out / "rerun.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    for p in problems[:10]:
        print("  " + p, file=sys.stderr)
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
