"""The confidence monitor's own cost in raw vLLM (no queue): one engine, the same prompts with
the monitor idle and with it watching every request (a threshold no token reaches), alternated.

    python -m benchmarks.monitor_raw --model /tmp/models/qwen05 --out $OUT

Each round's figures are appended to monitor-raw.json as they come, so a cut-short run keeps
what it measured.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from worker.confidence import ConfidenceBoard, Monitor, request_args


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--jobs", type=int, default=1000)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    from vllm import LLM, SamplingParams

    Path(a.out).mkdir(parents=True, exist_ok=True)
    out = Path(a.out) / "monitor-raw.json"
    t0 = time.perf_counter()
    import torch

    cpu = {} if torch.cuda.is_available() else dict(
        dtype="float32", enforce_eager=True, kv_cache_memory_bytes=1 << 30, max_model_len=2048
    )
    llm = LLM(model=a.model, logits_processors=["worker.confidence:ConfidenceMonitor"], **cpu)
    rows: list[dict[str, object]] = [{"engine_start_s": round(time.perf_counter() - t0, 1)}]
    tok = llm.get_tokenizer()
    board = ConfidenceBoard()
    marker = len(tok) - 1
    prompts = [{"prompt_token_ids": tok.encode(f"Report {i}: " + "word " * 150)} for i in range(a.jobs)]
    base = dict(max_tokens=a.tokens, min_tokens=a.tokens, ignore_eos=True, temperature=0.0)

    def run(watch: bool) -> float:
        params = []
        for _ in prompts:
            extra = None
            if watch:
                extra = request_args(board, board.slot(), Monitor(-1000.0, 2, 4, True), marker)
            params.append(SamplingParams(**base, extra_args=extra, stop_token_ids=[marker]))
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return a.jobs / (time.perf_counter() - t)

    run(False)  # warm-up
    for r in range(a.rounds):
        for watch in (False, True):
            rows.append({"round": r + 1, "monitor": "watching" if watch else "idle",
                         "jobs_per_s": round(run(watch), 2)})  # fmt: skip
            out.write_text(json.dumps(rows, indent=2))
            print(json.dumps(rows[-1]), flush=True)
    board.close()


if __name__ == "__main__":
    main()
