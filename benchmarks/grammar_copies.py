"""Mask fill and token consumption for a batch of llguidance matchers, by how the matchers were
made: each compiled on its own (vLLM's way), all copied from one compiled matcher per schema, or
copied round-robin from K per schema (``worker/vllm_ext/guided.py: install_grammar_reuse``).

    python -m benchmarks.grammar_copies --tokenizer /tmp/models/qwen05 --out $OUT

Copies share their original's lexer and its lock, so how the batch's matchers were made decides
how far the mask fill spreads over llguidance's threads. Each configuration walks the batch
through the same steps, every matcher taking a token its mask allows (seeded), and the table
gives milliseconds per step for the fill and the consume.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", required=True, help="a model folder or tokenizer id")
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--threads", default="1,4,8")
    ap.add_argument("--groups", default="1,4,8", help="K values for the round-robin copies")
    a = ap.parse_args()

    import llguidance
    import llguidance.hf
    import llguidance.torch
    import numpy as np
    from transformers import AutoTokenizer

    from worker.structured import generation_schema

    from .workloads import SCHEMAS

    ll = llguidance.hf.from_tokenizer(AutoTokenizer.from_pretrained(a.tokenizer))
    grammars = [
        llguidance.LLMatcher.grammar_from_json_schema(
            generation_schema(s), defaults={"whitespace_flexible": False}
        )
        for s in SCHEMAS
    ]

    def made(how: str, k: int) -> list[Any]:
        n = len(grammars)
        if how == "compiled each":
            return [llguidance.LLMatcher(ll, grammars[i % n]) for i in range(a.batch)]
        kept = [[llguidance.LLMatcher(ll, g) for _ in range(k)] for g in grammars]
        return [kept[i % n][(i // n) % k].deep_copy() for i in range(a.batch)]

    def walk(matchers: list[Any], threads: int) -> tuple[float, float]:
        ex = llguidance.LLExecutor(threads)
        mask = llguidance.torch.allocate_token_bitmask(a.batch, ll.vocab_size)
        rng = random.Random(7)
        fill = consume = 0.0
        for _ in range(a.steps):
            t = time.perf_counter()
            llguidance.torch.fill_next_token_bitmask_par(
                ex, [(m, i) for i, m in enumerate(matchers)], mask
            )
            fill += time.perf_counter() - t
            bits = np.unpackbits(mask.numpy().view(np.uint8), bitorder="little")
            bits = bits.reshape(a.batch, -1)
            picks = []
            for i, m in enumerate(matchers):
                if m.is_stopped():
                    continue
                allowed = np.flatnonzero(bits[i, : ll.vocab_size])
                allowed = allowed[allowed != ll.eos_token] if len(allowed) > 1 else allowed
                picks.append((m, int(allowed[rng.randrange(len(allowed))])))
            t = time.perf_counter()
            ex.consume_token_par(picks)
            consume += time.perf_counter() - t
        return fill / a.steps * 1e3, consume / a.steps * 1e3

    rows = []
    configs = [("compiled each", 0)] + [("copies", int(k)) for k in a.groups.split(",")]
    for threads in map(int, a.threads.split(",")):
        for how, k in configs:
            fill, consume = walk(made(how, k), threads)
            rows.append(
                {"threads": threads, "matchers": how if not k else f"copies of {k} per schema",
                 "fill_ms": round(fill, 3), "consume_ms": round(consume, 3)}
            )  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "grammar-copies.json").write_text(
        json.dumps({"batch": a.batch, "steps": a.steps, "rows": rows}, indent=1)
    )
    print("| threads | matchers | mask fill ms/step | consume ms/step |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['threads']} | {r['matchers']} | {r['fill_ms']:.2f} | {r['consume_ms']:.2f} |")


if __name__ == "__main__":
    main()
