"""Wall time per call of the engine step's parts, for an in-process engine
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``). Attribution only: the frontend shares the process, so the
absolute speed is not the worker's. Install after the engine is built, so the timers wrap whatever
vqueue's vLLM plugin put in place.
"""

from __future__ import annotations

import importlib
import time
from typing import Any

SPOTS = [
    ("vllm.v1.engine.core", "EngineCore", ["step", "step_with_batch_queue"]),
    (
        "vllm.v1.core.sched.scheduler",
        "Scheduler",
        ["schedule", "update_from_output", "get_grammar_bitmask"],
    ),
    ("vllm.v1.core.sched.async_scheduler", "AsyncScheduler", ["schedule", "update_from_output"]),
    ("vllm.v1.structured_output", "StructuredOutputManager", ["grammar_bitmask"]),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", ["execute_model", "sample_tokens"]),
    ("vllm.v1.sample.sampler", "Sampler", ["forward"]),
    ("worker.vllm_ext.monitor", "V1Monitor", ["apply", "update_state"]),
    # Model Runner V2 (named V2.* in the report)
    (
        "vllm.v1.worker.gpu.model_runner",
        "GPUModelRunner",
        ["execute_model", "sample_tokens", "prepare_inputs", "postprocess_sampled", "sample"],
    ),
    ("vllm.v1.worker.gpu.structured_outputs", "StructuredOutputsWorker", ["apply_grammar_bitmask"]),
    ("vllm.v1.worker.gpu.sample.sampler", "Sampler", ["__call__"]),
    ("worker.vllm_ext.monitor", "SlotMonitor", ["apply", "add_request"]),
]


class Timers:
    def __init__(self) -> None:
        self.total: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def clear(self) -> None:
        self.total.clear()
        self.calls.clear()

    def report(self) -> dict[str, dict[str, float]]:
        return {
            k: {
                "calls": self.calls[k],
                "total_ms": round(v * 1e3, 1),
                "mean_ms": round(v * 1e3 / max(1, self.calls[k]), 3),
            }
            for k, v in self.total.items()
        }


def install_timers() -> Timers:
    t = Timers()
    for mod, cls, names in SPOTS:
        try:
            c = getattr(importlib.import_module(mod), cls)
        except (ImportError, AttributeError):
            continue
        label = f"V2.{cls}" if ".gpu." in mod else cls
        for n in names:
            if n in c.__dict__:
                setattr(c, n, _timed(t, f"{label}.{n}", c.__dict__[n]))
    runner = importlib.import_module("vllm.v1.worker.gpu_model_runner")
    if hasattr(runner, "apply_grammar_bitmask"):
        runner.apply_grammar_bitmask = _timed(
            t, "apply_grammar_bitmask", runner.apply_grammar_bitmask
        )
    return t


def _timed(t: Timers, name: str, fn: Any) -> Any:
    def wrapper(*args: Any, **kw: Any) -> Any:
        s = time.perf_counter()
        try:
            return fn(*args, **kw)
        finally:
            t.total[name] = t.total.get(name, 0.0) + time.perf_counter() - s
            t.calls[name] = t.calls.get(name, 0) + 1

    return wrapper
