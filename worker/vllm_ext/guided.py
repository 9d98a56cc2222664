"""Guided decoding inside vLLM's engine process: the batched guided step, grammar reuse, and the
grammar mask reordered on the device. Installed by the plugin (``worker.vllm_ext.plugin``) on the
vLLM releases ``worker.vllm_ext.compat`` lists; the worker's own side of guided JSON (budgets,
the bounded grammar check, templates) is ``worker.structured``.
"""

from __future__ import annotations

import copy
import functools
import logging
import os
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


def install_batched_guided_step(threads: int = 0, reorder: bool = True) -> None:
    """Take the per-request Python out of guided decoding's engine step (from the vLLM plugin in
    ``worker.engine``, in every vLLM process). Measured in docs/benchmarks.md.

    With llguidance, every step of vLLM's engine core does three things per guided request in
    Python while holding the GIL: it advances the request's matcher by the sampled token, fills
    its row of the token mask (below 128 requests serially, else 16 at a time on a thread pool
    whose threads each take the GIL back per request), and copies that row into place for the
    batch order on the GPU. On a small model the engine step is host-bound, so this is most of
    what guided decoding costs. Here the matchers are advanced together and their masks filled
    together, each by one llguidance call that runs on its own Rust threads off the GIL, and the
    rows are put in batch order on the device. Masks and tokens are the same as vLLM's.

    Taken only where that holds: the guidance backend, no speculative decoding, no reasoning
    parser; anything else keeps vLLM's own path. Installed only on the vLLM releases ``compat``
    lists (guided-batching, mask-reorder).
    """
    try:
        from vllm.v1.structured_output import StructuredOutputManager, utils
        from vllm.v1.structured_output.backend_guidance import GuidanceGrammar
    except ImportError:
        return
    if getattr(StructuredOutputManager.grammar_bitmask, "__vqueue__", False):
        return
    _Batched.threads = threads or grammar_threads()
    StructuredOutputManager.grammar_bitmask = _batched_grammar_bitmask(  # type: ignore[method-assign]
        StructuredOutputManager.grammar_bitmask
    )
    _defer_accepts(GuidanceGrammar)
    if reorder:
        fast = _device_side_reorder(getattr(utils, "apply_grammar_bitmask"))  # noqa: B009
        setattr(utils, "apply_grammar_bitmask", fast)  # noqa: B010
        runner = sys.modules.get("vllm.v1.worker.gpu_model_runner")  # imported by name there
        if runner is not None and hasattr(runner, "apply_grammar_bitmask"):
            setattr(runner, "apply_grammar_bitmask", fast)  # noqa: B010
    # vLLM's own logger tree, so the line shows in the engine process's log
    logging.getLogger("vllm.vqueue").info(
        "vqueue: guided decoding's matchers and masks run batched"
    )


# Per vLLM process. A kept matcher's lexer cache grows with use (up to a few MiB for a big
# schema), times the groups per grammar: a workload cycling through more distinct schemas than
# this compiles again, as vLLM always does. Validated grammars cost only their key.
GRAMMARS_KEPT = 64
VALIDATED_KEPT = 4096


def install_grammar_reuse(groups: int = 0) -> None:
    """Compile each distinct grammar a few times per vLLM process instead of once per request
    (from the vLLM plugin in ``worker.engine``). Measured in docs/benchmarks.md.

    vLLM's guidance backend builds a new ``LLMatcher`` for every guided request and its frontend
    validates the grammar again for every request, each taking milliseconds with the GIL held,
    so in the engine process the compile thread stalls the engine loop whenever that loop lets
    go of the GIL. Here requests get ``deep_copy()`` of a kept matcher instead (microseconds),
    and a grammar the frontend has validated once is not validated again. Matchers that come
    out in error are never kept.

    llguidance's ``deep_copy`` gives the copy its own parser state but shares the original's
    lexer and its cache behind one lock, and the mask fill holds that lock: copies of one
    matcher fill their masks one after another, whatever the thread count. So each grammar is
    compiled ``groups`` times (by default as many as the mask threads) and requests are dealt
    round-robin to those groups: masks of one schema still fill in parallel, and each group's
    cache warms over many requests.
    """
    try:
        from vllm.v1.structured_output import backend_guidance
        from vllm.v1.structured_output.request import get_structured_output_key
    except ImportError:
        return
    backend = backend_guidance.GuidanceBackend
    if getattr(backend.compile_grammar, "__vqueue__", False):
        return
    if not hasattr(backend_guidance.llguidance.LLMatcher, "deep_copy"):
        return
    groups = groups or grammar_threads()
    backend.compile_grammar = _reused_grammars(backend.compile_grammar, groups, GRAMMARS_KEPT)  # type: ignore[method-assign]
    backend_guidance.validate_guidance_grammar = _validated_once(
        backend_guidance.validate_guidance_grammar, get_structured_output_key, VALIDATED_KEPT
    )
    logging.getLogger("vllm.vqueue").info(
        "vqueue: requests share compiled grammars (up to %d per distinct grammar)", groups
    )


class _Kept:
    """One grammar's compiled matchers, never handed out themselves, and whose turn is next."""

    def __init__(self) -> None:
        self.templates: list[Any] = []
        self.turn = 0


def _reused_grammars(stock: Callable[..., Any], groups: int, entries: int) -> Callable[..., Any]:
    lock = threading.Lock()

    @functools.wraps(stock)
    def compile_grammar(self: Any, request_type: Any, grammar_spec: str, *args: Any,
                        **kwargs: Any) -> Any:  # fmt: skip
        # vLLM calls this from its grammar thread pool: the cache sits on the backend, whose
        # settings (whitespace, additional properties) shape the grammar
        key = (request_type, grammar_spec, repr(args), repr(sorted(kwargs.items())))
        template = None
        with lock:
            kept_all: OrderedDict[Any, _Kept] = self.__dict__.setdefault("_vqueue", OrderedDict())
            kept = kept_all.get(key)
            if kept is not None and len(kept.templates) >= groups:
                kept_all.move_to_end(key)
                template = kept.templates[kept.turn % groups]
                kept.turn += 1
        if template is not None:
            grammar = copy.copy(template)
            grammar.ll_matcher = template.ll_matcher.deep_copy()
            return grammar
        grammar = stock(self, request_type, grammar_spec, *args, **kwargs)
        if not grammar.ll_matcher.is_error():
            template = copy.copy(grammar)  # before the request's matcher takes any token
            template.ll_matcher = grammar.ll_matcher.deep_copy()
            with lock:
                kept = kept_all.setdefault(key, _Kept())
                if len(kept.templates) < groups:
                    kept.templates.append(template)
                kept_all.move_to_end(key)
                while len(kept_all) > entries:
                    kept_all.popitem(last=False)
        return grammar

    compile_grammar.__vqueue__ = True  # type: ignore[attr-defined]
    return compile_grammar


def _validated_once(stock: Callable[..., Any], key_of: Callable[[Any], Any],
                    entries: int) -> Callable[..., Any]:  # fmt: skip
    lock = threading.Lock()
    passed: OrderedDict[Any, None] = OrderedDict()

    @functools.wraps(stock)
    def validate_guidance_grammar(sampling_params: Any, tokenizer: Any = None) -> None:
        params = sampling_params.structured_outputs
        try:
            key = (key_of(params), id(tokenizer)) if params is not None else None
        except ValueError:
            key = None  # nothing valid to key on: vLLM's own check says why
        if key is not None:
            with lock:
                if key in passed:
                    passed.move_to_end(key)
                    return
        stock(sampling_params, tokenizer=tokenizer)  # raises on a bad grammar: never kept
        if key is not None:
            with lock:
                passed[key] = None
                while len(passed) > entries:
                    passed.popitem(last=False)

    return validate_guidance_grammar


def grammar_threads() -> int:
    """The default thread count for the masks: half the cores this process may use, at most 8:
    the engine's own loop, its output thread and the frontend need cores too, and more threads
    bought nothing measurable (docs/benchmarks.md)."""
    return max(1, min(8, usable_cores() // 2))


def usable_cores() -> int:
    """The cores this process may run on (its affinity, where the OS says), else the count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 2


class _Batched:
    """The engine process's llguidance executor and the tokens its matchers still have to take.

    The executor is made on first use: the plugin also runs in the process that forks the
    engine core, and a forked copy of an executor has no threads behind it.
    """

    pending: list[tuple[Any, int]] = []  # (GuidanceGrammar, token) accepted but not yet consumed
    threads = 1
    _executors: dict[int, Any] = {}

    @classmethod
    def executor(cls) -> Any:
        import llguidance

        ex = cls._executors.get(os.getpid())
        if ex is None:
            ex = cls._executors[os.getpid()] = llguidance.LLExecutor(cls.threads)
        return ex

    @classmethod
    def flush(cls) -> None:
        """Advance every matcher that was handed a token since the last flush, in one call."""
        if not cls.pending:
            return
        batch, cls.pending = cls.pending, []
        # a stopped matcher takes nothing more (vLLM's accept_tokens returns early for it too)
        live = [(g, t) for g, t in batch if not g.ll_matcher.is_stopped()]
        if not live:
            return
        done = cls.executor().consume_token_par([(g.ll_matcher, t) for g, t in live])
        for (g, _), ok in zip(live, done, strict=True):
            if not ok:  # cannot happen under the mask; vLLM would end the request, the matcher
                g.check_error()  # now only allows EOS, so it ends at once and fails validation


def _defer_accepts(grammar_cls: Any) -> None:
    """A sampled token was drawn under the matcher's own mask, so accepting it cannot fail: hand
    it over now, consume it with the rest of the batch before the next mask or any other use."""
    stock_accept = grammar_cls.accept_tokens

    def accept_tokens(self: Any, request_id: str, tokens: list[int]) -> bool:
        if len(tokens) == 1 and not self.terminated and tokens[0] != self.ll_tokenizer.eos_token:
            _Batched.pending.append((self, tokens[0]))
            return True
        _Batched.flush()
        return bool(stock_accept(self, request_id, tokens))

    grammar_cls.accept_tokens = accept_tokens
    for name in ("validate_tokens", "rollback", "fill_bitmask", "reset"):
        method = getattr(grammar_cls, name, None)
        if method is not None:
            setattr(grammar_cls, name, _flushing(method))


def _flushing(method: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        _Batched.flush()
        return method(*args, **kwargs)

    return call


def _batched_grammar_bitmask(stock: Callable[..., Any]) -> Callable[..., Any]:
    import llguidance.torch

    def grammar_bitmask(self: Any, requests: Any, request_ids: list[str], spec_tokens: Any) -> Any:
        _Batched.flush()
        backend = self.backend
        if (
            not request_ids
            or spec_tokens
            or type(backend).__name__ != "GuidanceBackend"
            or getattr(self, "reasoner_cls", None) is not None
            or self.vllm_config.speculative_config is not None
        ):
            return stock(self, requests, request_ids, spec_tokens)
        if self._grammar_bitmask is None:
            rows = self.vllm_config.scheduler_config.max_num_seqs
            self._grammar_bitmask = backend.allocate_token_bitmask(rows)
        bitmask = self._grammar_bitmask
        masks = bitmask.numpy()
        work = []
        for index, req_id in enumerate(request_ids):
            grammar = requests[req_id].structured_output_request.grammar
            if grammar.terminated:
                masks[index] = -1  # any token: vLLM's own path does the same
            else:
                work.append((grammar.ll_matcher, index))
        if work:
            llguidance.torch.fill_next_token_bitmask_par(_Batched.executor(), work, bitmask)
        return masks[: len(request_ids)]

    grammar_bitmask.__vqueue__ = True  # type: ignore[attr-defined]
    return grammar_bitmask


def _device_side_reorder(stock: Callable[..., Any]) -> Callable[..., Any]:
    """vLLM's ``apply_grammar_bitmask`` with the reordering moved to the device.

    vLLM allocates a batch-sized host bitmask every step, copies each request's row into its
    batch position in a Python loop and uploads the whole thing. Here the compact bitmask goes up
    as it is (it sits in the manager's pinned buffer when the model runs in the engine process),
    and one indexed copy on the device puts the rows in place.
    """

    def apply_grammar_bitmask(
        scheduler_output: Any, grammar_output: Any, input_batch: Any, logits: Any
    ) -> None:
        if scheduler_output.scheduled_spec_decode_tokens or logits.is_cpu:
            return stock(scheduler_output, grammar_output, input_batch, logits)
        index = input_batch.req_id_to_index
        rows = [index[r] for r in grammar_output.structured_output_request_ids]
        _apply_in_batch_order(logits, grammar_output.grammar_bitmask, rows)

    apply_grammar_bitmask.__vqueue__ = True  # type: ignore[attr-defined]
    return apply_grammar_bitmask


def _apply_in_batch_order(logits: Any, bitmask: Any, rows: list[int]) -> None:
    """Mask ``logits`` row ``rows[i]`` with ``bitmask`` row ``i`` (a numpy int32 array); the other
    rows are left alone."""
    import torch
    import xgrammar as xgr

    cuda = not logits.is_cpu
    masks = torch.from_numpy(bitmask).to(logits.device, non_blocking=cuda)
    if len(rows) == logits.shape[0] and rows == list(range(len(rows))):
        xgr.apply_token_bitmask_inplace(logits, masks)
        return
    at = torch.tensor(rows, dtype=torch.int64, pin_memory=cuda).to(logits.device, non_blocking=cuda)
    full = torch.full(
        (logits.shape[0], masks.shape[1]), -1, dtype=masks.dtype, device=logits.device
    )
    full.index_copy_(0, at, masks)
    # xgrammar's CUDA path takes a device tensor for indices (no host sync), its CPU path a list
    indices: Any = at.to(torch.int32) if cuda else rows
    xgr.apply_token_bitmask_inplace(logits, full, indices=indices)
