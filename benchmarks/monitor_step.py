"""The confidence monitor's step on its own, without an engine: host and device time per step of
``V1Monitor.apply`` (``worker/vllm_ext/monitor.py``) on a full batch of logits, steady (no
request joins or leaves) and with churn (some rows replaced every step), every row watched.

    python -m benchmarks.monitor_step --out $OUT            # on the GPU; --vocab 151936 default
    python -m benchmarks.monitor_step --out /tmp/m --vocab 4096 --steps 20   # a CPU smoke run

``host ms`` is what the engine's step loses on the host per call (the step is host-bound on a
small model); ``device ms`` is the wall time per step with the host waiting for the device at
the end, which is the device's share when that is the larger. ``--compare MODULE`` adds another
monitor class (for example an earlier version kept outside the package) as a second row.
"""

from __future__ import annotations

import argparse
import importlib
import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--churn", type=int, default=8, help="rows replaced per step in 'churn'")
    ap.add_argument("--compare", action="append", default=[], help="module:Class, more rows")
    a = ap.parse_args()
    import torch

    from worker.confidence import ConfidenceBoard

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_seqs=a.rows),
        model_config=SimpleNamespace(get_vocab_size=lambda: a.vocab),
    )
    board = ConfidenceBoard()
    logits = torch.randn((a.rows, a.vocab), device=device, dtype=torch.float32)
    classes = [("vqueue", "worker.vllm_ext.monitor:V1Monitor"), *[(c, c) for c in a.compare]]
    rows: list[dict[str, Any]] = []
    for label, path in [("no monitor", None), *classes]:
        for scenario in ("steady", "churn"):
            mon = None
            if path is not None:
                mod, cls = path.split(":")
                mon = getattr(importlib.import_module(mod), cls)(config, device, True)
                mon.update_state(_update(board, added=range(a.rows)))
            host, wall = _run(torch, mon, logits, board, a, churn=scenario == "churn")
            row = {"monitor": label, "scenario": scenario, "host_ms": host, "device_ms": wall}
            rows.append(row)
            print(json.dumps(row), flush=True)
    board.close()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "monitor-step.json").write_text(
        json.dumps({"device": str(device), "args": vars(a), "rows": rows}, indent=2)
    )
    print("| monitor | scenario | host ms/step | device ms/step |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['monitor']} | {r['scenario']} | {r['host_ms']:.3f} | {r['device_ms']:.3f} |")


def _update(board: Any, added: Any = (), removed: Any = ()) -> Any:
    from worker.confidence import Monitor, request_args

    def params() -> Any:
        args = request_args(board, board.slot(), Monitor(-1000.0, 2, 4, True), 0)
        return SimpleNamespace(extra_args=args)

    return SimpleNamespace(
        removed=list(removed), added=[(i, params(), None, [1]) for i in added], moved=[]
    )


def _run(torch: Any, mon: Any, logits: Any, board: Any, a: Any, churn: bool) -> tuple[float, float]:
    """Mean host ms per call, and wall ms per step with a device sync at the end; an argmax
    stands in for the sampler so each step also reads the logits once."""
    sync = torch.cuda.synchronize if logits.is_cuda else (lambda: None)
    host = 0.0
    for warm in (True, False):
        steps = 10 if warm else a.steps
        sync()
        t0 = time.perf_counter()
        for s in range(steps):
            if mon is not None:
                if churn:
                    first = (s * a.churn) % (a.rows - a.churn)
                    ids = range(first, first + a.churn)
                    mon.update_state(_update(board, added=ids, removed=ids))
                h = time.perf_counter()
                mon.apply(logits)
                if not warm:
                    host += time.perf_counter() - h
            logits.argmax(dim=-1)
        sync()
        wall = time.perf_counter() - t0
    return round(host * 1e3 / a.steps, 4), round(wall * 1e3 / a.steps, 4)


if __name__ == "__main__":
    main()
