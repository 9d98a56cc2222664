"""vqueue's vLLM plugin (worker/engine.py: vllm_plugin): it changes how vLLM's engine step runs
guided decoding and the confidence monitor, never what it produces.

The end-to-end check runs two real engines on the embedded model, one with vLLM's own guided
step and one with the plugin's, on the same extraction prompts, through the raw-vLLM benchmark
(``benchmarks/guided_raw.py``), and compares every token.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_the_plugin_is_registered_with_vllm() -> None:
    found = [e.value for e in entry_points(group="vllm.general_plugins") if e.name == "vqueue"]
    assert found == ["worker.engine:vllm_plugin"]


@pytest.mark.parametrize("rows", [[3, 0, 5], list(range(7)), [6], [1, 2, 0, 4, 3, 6, 5]])
def test_masks_land_on_their_batch_rows(rows: list[int]) -> None:
    # Given a compact bitmask whose row i belongs to batch row rows[i]
    import torch

    from worker.structured import _apply_in_batch_order

    rng = np.random.default_rng(len(rows))
    batch, vocab = 7, 1000
    words = (vocab + 31) // 32
    compact = rng.integers(-(2**31), 2**31 - 1, size=(len(rows), words), dtype=np.int64)
    compact = compact.astype(np.int32)
    logits = torch.randn(batch, vocab)
    # When it is applied
    _apply_in_batch_order(logits, compact, rows)
    # Then exactly the tokens whose bit is clear in that row's mask are ruled out, and rows
    # without a mask keep every token
    full = np.full((batch, words), -1, dtype=np.int32)
    for i, r in enumerate(rows):
        full[r] = compact[i]
    allowed = np.unpackbits(full.view(np.uint8), bitorder="little").reshape(batch, -1)[:, :vocab]
    assert np.array_equal(torch.isinf(logits).numpy(), allowed == 0)


def test_batched_guided_step_gives_the_same_tokens(tmp_path: Path) -> None:
    # Given the same extraction prompts on two real engines: vLLM's guided step, and the plugin's
    from worker.models import prepare_embedded

    model = prepare_embedded()
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.guided_raw",
            "--model",
            str(model),
            "--out",
            str(tmp_path),
            "--jobs",
            "16",
            "--max-tokens",
            "40",
            "--rounds",
            "1",
            "--variants",
            "stock,parallel",
        ],  # fmt: skip
        cwd=ROOT,
        env={**os.environ, "VLLM_LOGGING_LEVEL": "INFO"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    # Then the plugin was in the engine that was meant to have it, and only there
    logs = run.stdout + run.stderr
    assert logs.count("guided decoding's matchers and masks run batched") >= 1
    rows = {}
    for variant in ("stock", "parallel"):
        lines = (tmp_path / f"guided-{variant}.jsonl").read_text().splitlines()
        rows[variant] = next(r for r in map(json.loads, lines) if r.get("run") == "guided")
    # and both generated the very same tokens, every one of them allowed by the job's grammar
    assert rows["stock"]["output_tokens"] > 16 * 10
    assert rows["parallel"]["digest"] == rows["stock"]["digest"]
    assert rows["stock"]["grammar_violations"] == rows["parallel"]["grammar_violations"] == 0
