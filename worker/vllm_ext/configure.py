"""From a worker's settings to vLLM's config for its engine, with vqueue's optimizations planned
on it (``compat``) and the monitor named where vLLM has a public interface for it. The one place
the worker reaches into vLLM's config (the model runner it chose, the processors it loads)."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from schemas import Settings

from .compat import Plan, log_missing, plan, vllm_version
from .plugin import OWNER_ENV, PLAN_ENV, PLUGIN

log = logging.getLogger("worker.engine")

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
    )
    return p


def configure_engine(settings: Settings, kwargs: dict[str, Any]) -> tuple[Any, Plan]:
    """vLLM's config for the engine arguments ``kwargs`` (``worker.engine.engine_kwargs``), and
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
    log_missing(p, log)
    if p.monitor in MONITOR_CLASSES:
        config.model_config.logits_processors = [MONITOR_CLASSES[p.monitor]]
    os.environ[PLAN_ENV] = json.dumps(p.as_dict())
    return config, p
