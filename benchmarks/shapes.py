"""Model folders of a real model's shape with no weights, for ``load_format=dummy`` runs.

    python -m benchmarks.shapes qwen2.5-7b /tmp/models/qwen7b \\
        --tokenizer /tmp/models/qwen25-tokenizer

vLLM builds random weights from the config alone, so a 7B engine's speed and memory can be
measured where its 15 GB of weights cannot travel (the lent GPU takes 64 MiB a call).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

SHAPES = {
    # Qwen2.5-7B-Instruct's config.json, as published
    "qwen2.5-7b": {
        "architectures": ["Qwen2ForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "hidden_act": "silu",
        "hidden_size": 3584,
        "initializer_range": 0.02,
        "intermediate_size": 18944,
        "max_position_embeddings": 32768,
        "max_window_layers": 28,
        "model_type": "qwen2",
        "num_attention_heads": 28,
        "num_hidden_layers": 28,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 131072,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 152064,
    },
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("out")
    ap.add_argument("--tokenizer", required=True, help="a folder with the model's tokenizer")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for f in Path(a.tokenizer).iterdir():
        if f.is_file():
            shutil.copy(f, out / f.name)
    (out / "config.json").write_text(json.dumps(SHAPES[a.shape], indent=2))
    print(f"{a.shape} shape (no weights: load_format=dummy) at {out}")


if __name__ == "__main__":
    main()
