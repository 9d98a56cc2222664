"""From a worker's settings to vLLM's config for its engine, with vqueue's optimizations planned
on it (``compat``) and the monitor named where vLLM has a public interface for it. The one place
the worker reaches into vLLM's config (the model runner it chose, the processors it loads)."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from schemas import Settings

from ..models import model_runner, resolve_model
from .compat import Plan, log_missing, plan, vllm_version
from .plugin import OWNER_ENV, PLAN_ENV, PLUGIN

log = logging.getLogger("worker.engine")

# CPU hosts have no GPU memory to take a fraction of; the KV cache is sized in bytes instead.
CPU_DEFAULT_KV_CACHE_BYTES = 2 * 1024**3
# Without AVX-512 bf16 is emulated on the CPU, many times slower than float32.
CPU_DEFAULT_DTYPE = "float32"


class ConfigError(ValueError):
    """Engine settings that cannot work together; the worker exits before loading anything."""


# Where the in-engine monitor reports to the worker's board; "logprobs" is watched there.
IN_ENGINE_MONITOR = ("v1", "v2", "v2-hook")
# The monitor's class per public path, as vLLM's `logits_processors` names it.
MONITOR_CLASSES = {
    "v1": "worker.vllm_ext.monitor:V1Monitor",
    "v2": "worker.vllm_ext.monitor:V2Monitor",
}


def plugin_registered() -> bool:
    """Whether vLLM will find vqueue's plugin: through the installed package's entry point."""
    from importlib.metadata import entry_points

    return any(e.value == PLUGIN for e in entry_points(group="vllm.general_plugins"))


def plan_for(settings: Settings, v2: bool) -> Plan:
    """This worker's optimizations on the installed vLLM with the model runner vLLM chose."""
    p = plan(
        vllm_version(),
        v2,
        monitor=settings.confidence_monitor,
        early_stop_path=settings.early_stop_path,
        guided_batching=settings.parallel_grammar_masks,
        grammar_reuse=settings.grammar_reuse,
        guidance=settings.structured_outputs_backend == "guidance",
        patches=settings.vllm_patches,
        plugin=plugin_registered(),
        urgent_order=urgent_order(settings),
        loops=settings.loop_detection != "off",
    )
    return p


def urgent_order(settings: Settings) -> int | None:
    """The urgent jobs' vLLM priority (``EngineHost`` sends ``9 - priority``), when an urgent
    request may preempt a running one (``scheduler.py``); None when it may not."""
    wanted = settings.urgent_preempt and settings.scheduling_policy == "priority"
    return 9 - settings.urgent_priority if wanted and settings.urgent_priority <= 9 else None


def configure_engine(settings: Settings, kwargs: dict[str, Any]) -> tuple[Any, Plan]:
    """vLLM's config for the engine arguments ``kwargs`` (``engine_kwargs``), and
    the plan of vqueue's optimizations on it.

    The config is built as vLLM's offline ``LLM`` builds it (``UsageContext.LLM_CLASS``): a
    batch system wants the offline defaults (on a large GPU, vLLM's offline table allows 8 times
    the batched tokens per step a bare engine gets, so a long prompt prefills in one step). The plan
    follows from the installed vLLM and the model runner this config selects; the monitor is
    named in ``logits_processors`` where vLLM has a public interface for it, and the engine's
    processes get the plan (and this process's pid, for their watchdog) through the
    environment, which vqueue's plugin reads there. Each optimization this vLLM cannot take is
    logged as one ERROR."""
    from vllm import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext

    # vLLM loads plugins in this process as soon as engine args are made, before the model
    # runner is known, and an engine core forked from here inherits what they installed rather
    # than loading them again: so the plugin first gets the plan for Model Runner V2, whose
    # only difference is the private V2 hook on vLLM 0.26 (harmless if V1 is chosen)
    os.environ[OWNER_ENV] = str(os.getpid())
    os.environ[PLAN_ENV] = json.dumps(plan_for(settings, v2=True).as_dict())
    args = AsyncEngineArgs(**kwargs)
    config = args.create_engine_config(usage_context=UsageContext.LLM_CLASS)
    p = plan_for(settings, bool(config.use_v2_model_runner))
    if kwargs.get("runner") == "pooling":  # no sampling: no monitor, urgent lane or grammar
        os.environ[PLAN_ENV] = json.dumps(p.as_dict())
        return config, p
    log_missing(p, log)
    if p.monitor in MONITOR_CLASSES:
        config.model_config.logits_processors = [MONITOR_CLASSES[p.monitor]]
    if p.urgent_order is not None:
        # vLLM's scheduler of the kind it chose (async or not), with urgent preemption
        name = (
            "UrgentFirstAsyncScheduler"
            if config.scheduler_config.async_scheduling
            else ("UrgentFirstScheduler")
        )
        config.scheduler_config.scheduler_cls = f"worker.vllm_ext.scheduler.{name}"
    os.environ[PLAN_ENV] = json.dumps(p.as_dict())
    return config, p


def engine_kwargs(s: Settings, model_path: str) -> dict[str, Any]:
    """vLLM engine arguments from settings; the raw-vLLM benchmark uses the same ones."""
    from vllm.config import StructuredOutputsConfig

    cuda = has_cuda()
    kwargs: dict[str, Any] = dict(
        model=model_path,
        served_model_name=s.served_names()[0],
        max_model_len=s.max_model_len,
        max_num_seqs=s.max_num_seqs or device_max_num_seqs(),
        dtype=s.dtype if s.dtype != "auto" or cuda else CPU_DEFAULT_DTYPE,
        tensor_parallel_size=s.tensor_parallel_size,
        enforce_eager=s.enforce_eager if s.enforce_eager is not None else not cuda,
        enable_prefix_caching=s.enable_prefix_caching,
        scheduling_policy=s.scheduling_policy,
        seed=s.seed,
        gpu_memory_utilization=s.gpu_memory_utilization,
        # Small models pad guided JSON with whitespace until max_tokens; forbid it engine-wide
        # (in vLLM >= 0.26 this is engine config, the per-request flag is not consulted).
        structured_outputs_config=StructuredOutputsConfig(
            backend=s.structured_outputs_backend,  # type: ignore[arg-type]  # checked by vLLM
            disable_any_whitespace=True,
        ),
    )
    if model_runner(s.model, s.runner) == "pooling":
        # an embedding model's length is its own (a sentence-transformers config often bounds
        # it below the architecture's), unless the operator sets one; its prefix caching is
        # vLLM's to choose, as pooling models may not take it
        kwargs["runner"] = "pooling"
        del kwargs["enable_prefix_caching"], kwargs["structured_outputs_config"]
        if "max_model_len" not in s.model_fields_set:
            del kwargs["max_model_len"]
    if s.hf_overrides:
        kwargs["hf_overrides"] = s.hf_overrides
    if s.lora_adapters:
        kwargs.update(enable_lora=True, max_loras=s.max_loras, max_lora_rank=s.max_lora_rank)
    if s.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = s.max_num_batched_tokens
    if not cuda:
        # vLLM rewinds a seeded request's generator past the token a split prefill throws
        # away, and a CPU generator cannot rewind: one job with a `seed` among long prompts
        # would end the engine. Whole prefills never throw a token away; a step then holds
        # up to a whole prompt, so its budget is at least the context (vLLM's default then)
        kwargs["enable_chunked_prefill"] = False
        if s.max_num_batched_tokens:
            kwargs["max_num_batched_tokens"] = max(s.max_num_batched_tokens, s.max_model_len)
    if s.load_format != "auto":
        kwargs["load_format"] = s.load_format
    if s.quantization:
        kwargs["quantization"] = s.quantization
    if s.kv_cache_dtype != "auto":
        kwargs["kv_cache_dtype"] = s.kv_cache_dtype
    if s.attention_backend:
        kwargs["attention_backend"] = s.attention_backend
    if s.cpu_offload_gb:
        kwargs["cpu_offload_gb"] = s.cpu_offload_gb
    kv_bytes = s.kv_cache_memory_bytes
    if kv_bytes is None and not cuda:
        kv_bytes = CPU_DEFAULT_KV_CACHE_BYTES
    if kv_bytes is not None:
        kwargs["kv_cache_memory_bytes"] = kv_bytes
    return kwargs


# Weight formats that need CUDA kernels.
_GPU_ONLY_QUANTIZATION = {
    "awq",
    "awq_marlin",
    "gptq",
    "gptq_marlin",
    "marlin",
    "fp8",
    "bitsandbytes",
}


def check_engine_settings(s: Settings, cuda: bool, gpus: int) -> None:
    """Refuse combinations vLLM would fail on later, or worse, accept and run badly."""
    problems = []
    if s.model.endswith(".gguf") and s.quantization:
        problems.append("a .gguf VQUEUE_MODEL is dequantized on load; unset VQUEUE_QUANTIZATION")
    if not cuda:
        if s.quantization in _GPU_ONLY_QUANTIZATION:
            problems.append(f"VQUEUE_QUANTIZATION={s.quantization} needs a CUDA GPU")
        if s.kv_cache_dtype != "auto" and not _cpu_has_fp8_kv():
            problems.append(
                f"VQUEUE_KV_CACHE_DTYPE={s.kv_cache_dtype}: vLLM's CPU build keeps an FP8 KV "
                "cache only on x86 CPUs with AVX-512 or AMX, and this one has neither"
            )
        if s.cpu_offload_gb:
            problems.append("VQUEUE_CPU_OFFLOAD_GB offloads GPU weights; this host has no GPU")
        if s.tensor_parallel_size > 1:
            problems.append("VQUEUE_TENSOR_PARALLEL_SIZE > 1 needs GPUs")
    elif s.tensor_parallel_size > gpus:
        problems.append(
            f"VQUEUE_TENSOR_PARALLEL_SIZE={s.tensor_parallel_size} but {gpus} GPU(s) are visible"
        )
    seqs = s.max_num_seqs or (device_max_num_seqs() if cuda else 256)
    if s.max_num_batched_tokens is not None and s.max_num_batched_tokens < seqs:
        problems.append(
            f"VQUEUE_MAX_NUM_BATCHED_TOKENS={s.max_num_batched_tokens} is below "
            f"max_num_seqs={seqs}: not every running sequence could advance"
        )
    if s.kv_cache_memory_bytes is not None and s.kv_cache_memory_bytes < 16 * 1024**2:
        problems.append("VQUEUE_KV_CACHE_MEMORY_BYTES under 16 MiB holds almost nothing")
    try:
        for name, path in s.adapters().items():
            if not os.path.isfile(os.path.join(path, "adapter_config.json")):
                problems.append(f"LoRA adapter {name!r}: no adapter_config.json in {path}")
    except ValueError as exc:
        problems.append(str(exc))
    if problems:
        raise ConfigError("; ".join(problems))


def _cpu_has_fp8_kv() -> bool:
    """What vLLM's CPU attention needs for an FP8 KV cache (it raises otherwise, at start)."""
    try:
        flags = open("/proc/cpuinfo").read()  # noqa: SIM115
    except OSError:  # not Linux: let vLLM decide
        return True
    return " avx512f" in flags or " amx_tile" in flags


def device_max_num_seqs() -> int:
    """Sequences per engine step when ``VQUEUE_MAX_NUM_SEQS`` is unset: vLLM's offline default
    for this device (``EngineArgs`` with ``UsageContext.LLM_CLASS``, the same table in vLLM 0.26
    and 0.32): 1024 on GPUs of 70 GiB or more other than the A100, 256 on the rest and on CPUs.
    A bare engine would get the same; it is resolved here because the worker's threads pool
    (``2 x max_num_seqs``) is sized before the engine exists. A small model's step on a large
    GPU is bound by the host, so more sequences per step is most of the offline speed."""
    if not os.path.exists("/dev/nvidiactl"):  # no NVIDIA driver: not worth importing torch
        return 256
    try:
        import torch

        if not torch.cuda.is_available():
            return 256
        props = torch.cuda.get_device_properties(0)
    except Exception:  # noqa: BLE001  # no usable CUDA: vLLM's default for unknown devices
        return 256
    big = props.total_memory >= 70 * 1024**3 and "a100" not in props.name.lower()
    return 1024 if big else 256


# Bulk Celery processes a GPU worker runs unless told (Settings.bulk_processes): each is one more
# of vLLM's front ends to the engine core, with its own GIL for chat templates, tokenizer calls
# and output processing; four is where the suite's rows stopped gaining (docs/benchmarks.md)
GPU_BULK_PROCESSES = 4


def device_bulk_processes() -> int:
    """Bulk processes when ``VQUEUE_BULK_PROCESSES`` is unset: on a GPU, ``GPU_BULK_PROCESSES``
    where the host has a core for each of them beside the engine's (16 cores or more), else a
    quarter of its cores; on a CPU one, since the engine itself computes on the cores."""
    if not _cuda_usable():
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(GPU_BULK_PROCESSES, (cores or 4) // 4))


def _cuda_usable() -> bool:
    if not os.path.exists("/dev/nvidiactl"):
        return False
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001  # no usable CUDA
        return False


def gpu_count() -> int:
    try:
        import torch

        return int(torch.cuda.device_count())
    except Exception:
        return 0


def has_cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def check(settings: Settings) -> dict[str, Any]:
    """What ``vqueue worker --check`` reports: vLLM, torch, the device, and the plan of
    optimizations, from vLLM's own config for these settings (no engine is started). Raises
    ``ConfigError`` for settings that cannot run here."""
    import torch

    cuda, gpus = has_cuda(), gpu_count()
    check_engine_settings(settings, cuda, gpus)
    model_path = resolve_model(settings.model)
    config, p = configure_engine(settings, engine_kwargs(settings, model_path))
    device = torch.cuda.get_device_name(0) if cuda else "cpu"
    return {
        "vllm": p.vllm,
        "torch": torch.__version__,
        "device": device,
        "gpus": gpus,
        "model": settings.model,
        "model_path": model_path,
        # as vLLM resolved them: the checkpoint's or the setting's weight format (a Hopper
        # card runs gptq and awq through Marlin kernels: gptq_marlin), the compute dtype, and
        # the KV cache's element type
        "quantization": config.model_config.quantization or "none",
        "dtype": str(config.model_config.dtype).removeprefix("torch."),
        "kv_cache_dtype": config.cache_config.cache_dtype,
        "plugin_registered": plugin_registered(),
        **{k: v for k, v in p.as_dict().items() if k != "vllm"},
        "degraded": p.degraded,
    }
