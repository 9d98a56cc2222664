"""The engine host: one persistent vLLM engine per worker, and the jobs' way into it.

Celery's threads pool runs many jobs at once; each task thread builds its prompt here (the
tokenizer lives in the worker), hands token ids and sampling parameters to vLLM's own engine
client in this process (``worker.vllm_ext.client``), and blocks on the answer. Every job a
worker holds is therefore inside one engine at the same time, which is what lets vLLM's
continuous batching and prefix cache do their work. The engine is built once, at worker start,
and never per job.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from schemas import Settings
from schemas.results import TokenLogprob, TopLogprob

from .confidence import (
    ConfidenceBoard,
    LogprobRule,
    Monitor,
    Reading,
    marker_token,
    request_args,
)
from .errors import EngineDead, EngineError, JobTimeout, JobWithdrawn
from .metrics import EngineStats
from .models import model_runner, resolve_model
from .prompts import PromptTokenizer
from .structured import ToolCallReader
from .vllm_ext.client import CoreAddress, EngineClient, Output, Pooled
from .vllm_ext.compat import Plan
from .vllm_ext.configure import (
    IN_ENGINE_MONITOR,
    ConfigError,
    check_engine_settings,
    gpu_count,
    has_cuda,
)

log = logging.getLogger(__name__)

__all__ = ["ConfigError", "Engine", "EngineDead", "EngineError", "EngineHost", "Generation"]


@dataclass(frozen=True)
class Generation:
    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    first_token_at: float | None  # wall clock, from the engine's own request stats
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    sent_at: float | None = None  # wall clock: the prompt left for vLLM's loop
    submitted_at: float | None = None  # wall clock: vLLM received the prompt
    scheduled_at: float | None = None  # wall clock: the engine first scheduled it
    finished_at: float | None = None  # wall clock: the final output reached vLLM's front end
    preemptions: int = 0  # times the engine preempted it
    aborted: bool = False  # the confidence monitor stopped it (logprob early stop)
    confidence: Reading | None = None  # the monitor's numbers, when it watched this request
    logprobs: list[TokenLogprob] | None = None  # when the request asked for them


@dataclass(frozen=True)
class Embedding:
    """One input's vector, as float32 values in a NumPy array (its ``tolist`` gives floats,
    its ``tobytes`` what OpenAI's base64 encoding holds)."""

    vector: Any
    prompt_tokens: int


@runtime_checkable
class Engine(Protocol):
    """What the worker asks of its engine: ``EngineHost`` on vLLM, or a stub that isolates
    queue mechanics (``VQUEUE_ENGINE_CLASS``: tests/fake_engine.py, benchmarks/stub_engine.py).
    Written down so that a stub missing a member fails the type check, not a job."""

    settings: Settings
    in_flight: int
    max_in_flight: int
    jobs_done: int
    started_at: float
    runner: str  # "generate" (text jobs) or "pooling" (embed jobs alone)
    max_model_len: int  # the longest prompt the engine takes, as vLLM resolved it
    matryoshka: bool  # a pooling model whose vectors may be cut (embed jobs' ``dimensions``)

    @property
    def model_name(self) -> str: ...  # the first served name: what results report

    @property
    def model_names(self) -> list[str]: ...  # every name a line may give

    @property
    def model_path(self) -> str: ...  # its weights, fingerprinted for the result cache

    @property
    def adapters(self) -> dict[str, tuple[str, int, str]]: ...  # LoRA: name to its request

    @property
    def plan(self) -> Plan | None: ...  # vqueue's optimizations in vLLM; None without one

    @property
    def stats(self) -> EngineStats | None: ...  # reported by the process that owns the core

    @property
    def tokenizer(self) -> Any: ...  # None where nothing is tokenized for real

    @property
    def tool_calls(self) -> ToolCallReader | None: ...

    def chat_prompt(
        self,
        messages: list[dict[str, str]],
        known: tuple[str, list[int]] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]: ...

    def completion_prompt(self, text: str) -> list[int]: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def generate(
        self,
        prompt_ids: list[int],
        params: Any,
        timeout_s: float | None = None,
        prefix_key: str | None = None,
        monitor: Monitor | None = None,
        priority: int = 0,
        batch: str | None = None,
        salt: str | None = None,
        lora: tuple[str, int, str] | None = None,
    ) -> Generation: ...

    def embed_prompt(self, text: str) -> list[int]: ...

    def embed(
        self,
        inputs: list[list[int]],
        dimensions: int | None = None,
        timeout_s: float | None = None,
        priority: int = 0,
        batch: str | None = None,
        salt: str | None = None,
    ) -> list[Embedding]: ...

    def active_batches(self) -> list[str]: ...

    def abort_batch(self, batch: str, reason: str) -> int: ...

    def on_death(self, callback: Callable[[], None]) -> None: ...

    def close(self) -> None: ...


class EngineHost:
    """The worker's engine: vLLM's engine client, the tokenizer used for prompt building,
    prefix gating, and the bookkeeping of the requests in flight."""

    def __init__(
        self,
        settings: Settings,
        share: list[CoreAddress] | None = None,
        join: CoreAddress | None = None,
    ) -> None:
        """``share``: launch the engine core for these clients, this process the first of them
        (the urgent process joins as another, ``join``); neither: vLLM's client launches a core
        of its own (``worker.vllm_ext.client``)."""
        self.settings = settings
        check_engine_settings(settings, has_cuda(), gpu_count())
        self.model_path = resolve_model(settings.model)
        # LoRA adapters by served name: (name, vLLM's int id for it, path)
        self.adapters = {
            name: (name, i, path) for i, (name, path) in enumerate(settings.adapters().items(), 1)
        }
        self.model_names = [*settings.served_names(), *self.adapters]
        self.model_name = self.model_names[0]
        self.runner = model_runner(settings.model, settings.runner)
        self._lock = threading.Lock()
        self._groups: OrderedDict[str, threading.Event] = OrderedDict()
        # the requests of each batch in the engine, to abort when the batch is withdrawn
        self._batches: dict[str, set[concurrent.futures.Future[Any]]] = {}
        self._withdrawn: dict[concurrent.futures.Future[Any], str] = {}
        self.in_flight = 0
        self.max_in_flight = 0
        self.jobs_done = 0
        self.started_at = time.time()
        self._nonce = os.urandom(4).hex()
        # the engine's numbers are reported once, by the process that launched its core
        self.stats: EngineStats | None = EngineStats() if join is None else None
        self.client = EngineClient(settings, self.model_path, self.stats, share, join)
        self.plan: Plan | None = self.client.plan
        model_config = self.client.engine.model_config
        self.max_model_len = int(model_config.max_model_len)
        # whether embed jobs may ask for fewer dimensions (vLLM refuses it otherwise)
        self.matryoshka = bool(getattr(model_config, "is_matryoshka", False))
        self.tokenizer = self.client.tokenizer
        self.prompts = PromptTokenizer(self.tokenizer, self._nonce, settings.tokenizer_threads)
        # Whether requests leave their text to the task threads (``detokenize=False``). vLLM's
        # front end otherwise detokenizes every running request at every engine step, on the
        # one loop that also takes every new request in; a task thread decodes its own answer
        # once, at its end, with the GIL released (``PromptTokenizer.output_text``).
        self.decodes_outputs = self.prompts.decodes_outputs
        # logprob early stop: the monitor in the engine reports to this board (worker/confidence)
        in_engine = (
            self.plan is not None
            and self.plan.monitor in IN_ENGINE_MONITOR
            and self.runner == "generate"
        )
        self.board = ConfidenceBoard() if in_engine else None
        # tool calls in a model's own syntax, read back when the operator names vLLM's parser
        self.tool_calls = (
            ToolCallReader(settings.tool_call_parser, self.tokenizer)
            if settings.tool_call_parser
            else None
        )
        self.marker = marker_token(self.tokenizer) if self.board else -1

    def chat_prompt(
        self,
        messages: list[dict[str, str]],
        known: tuple[str, list[int]] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Token ids of ``messages`` in the model's chat template; see ``prompts.render``."""
        try:
            return self.prompts.chat_prompt(messages, known, tools)
        except Exception as exc:  # noqa: BLE001  # the model's template refused this chat
            raise EngineError(f"the chat template failed: {type(exc).__name__}: {exc}") from None

    def completion_prompt(self, text: str) -> list[int]:
        """Token ids of a bare prompt (a ``/v1/completions`` line), no chat template."""
        return self.prompts.completion_prompt(text)

    def encode(self, text: str) -> list[int]:
        return self.prompts.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.prompts.decode(ids)

    def generate(
        self,
        prompt_ids: list[int],
        params: Any,
        timeout_s: float | None = None,
        prefix_key: str | None = None,
        monitor: Monitor | None = None,
        priority: int = 0,
        batch: str | None = None,
        salt: str | None = None,
        lora: tuple[str, int, str] | None = None,
    ) -> Generation:
        """Run one request to completion; blocks the calling (task) thread, not the engine.
        ``batch``: the job's, so that ``abort_batch`` can stop it. ``salt``: vLLM's
        ``cache_salt`` (the job's tenant): its prompt shares cached prefixes only with requests
        of the same salt, so no tenant can tell from timing or counts what another's prompts hold.
        With ``monitor`` (and the monitor loaded), the engine watches its confidence and, if
        ``monitor.abort``, stops it the step the rule holds (``Generation.aborted``).
        ``priority``: the job's, 0-9, higher first; vLLM's scheduler admits waiting requests in
        that order under ``scheduling_policy=priority`` (vLLM's own scale runs lower first).
        ``lora``: the adapter to answer with (``adapters``), None for the model alone."""
        started = time.monotonic()
        limit = min(timeout_s or self.settings.job_timeout_s, self.settings.job_timeout_s)
        first_of_group = self._gate(prefix_key, limit)
        limit = max(limit - (time.monotonic() - started), 0.001)
        params, slot, rule = self._watched(params, monitor)
        order = 9 - priority if self.settings.scheduling_policy == "priority" else 0
        sent_at = time.time()
        try:
            future = self.client.submit(prompt_ids, params, order, first_of_group, rule, salt, lora)
        except BaseException:
            if first_of_group is not None:
                first_of_group.set()  # never leave the group waiting
            raise
        out = self._waited(future, limit, batch)
        tokens, aborted, reading = out.completion_tokens, out.aborted, out.reading
        if slot is not None and self.board is not None:
            reading = self.board.read(slot, tokens)
            # the marker ends the request; without the rule firing it was the model's own token
            aborted = out.stop_reason == self.marker and reading.fired
            if aborted:
                tokens -= 1
        text = out.text
        if out.token_ids is not None:
            text = self.prompts.output_text(prompt_ids, out.token_ids, out.finish_reason == "stop")
        return Generation(
            text=text,
            finish_reason=out.finish_reason,
            prompt_tokens=out.prompt_tokens,
            completion_tokens=tokens,
            first_token_at=out.first_token_at,
            cached_tokens=out.cached_tokens,
            sent_at=sent_at,
            submitted_at=out.arrived_at,
            scheduled_at=out.scheduled_at,
            finished_at=out.finished_at,
            preemptions=out.preemptions,
            aborted=aborted,
            confidence=reading,
            logprobs=self._logprobs(out) if out.logprobs is not None else None,
        )

    def embed_prompt(self, text: str) -> list[int]:
        """A text's token ids as vLLM's embeddings endpoint makes them: the tokenizer's own
        special tokens around it, no chat template."""
        return self.prompts.with_specials(text)

    def embed(
        self,
        inputs: list[list[int]],
        dimensions: int | None = None,
        timeout_s: float | None = None,
        priority: int = 0,
        batch: str | None = None,
        salt: str | None = None,
    ) -> list[Embedding]:
        """Each input's vector, every one in the engine at once (vLLM's server sends a list's
        inputs as requests of their own, as here), pooled as the model's pooling config says;
        ``dimensions``: the first so many, renormalized (vLLM refuses it for a model that is
        not Matryoshka). Blocks the calling thread until all are back or ``timeout_s``."""
        from vllm.pooling_params import PoolingParams

        started = time.monotonic()
        limit = min(timeout_s or self.settings.job_timeout_s, self.settings.job_timeout_s)
        params = PoolingParams(task="embed", dimensions=dimensions)
        order = 9 - priority if self.settings.scheduling_policy == "priority" else 0
        futures = [self.client.submit_pooling(ids, params, order, salt) for ids in inputs]
        try:
            outs: list[Pooled] = [
                self._waited(f, max(limit - (time.monotonic() - started), 0.001), batch)
                for f in futures
            ]
        finally:
            for f in futures:  # a timeout or a withdrawal of one ends them all
                f.cancel()
        return [Embedding(_float32(o.data), o.prompt_tokens) for o in outs]

    def _watched(
        self, params: Any, monitor: Monitor | None
    ) -> tuple[Any, int | None, LogprobRule | None]:
        """``params`` as the request is sent, with where its confidence is read: a board slot
        (the monitor in the engine) or a rule over streamed logprobs (the client's)."""
        slot = None
        rule = None
        if monitor is not None and self.board is not None:
            slot = self.board.slot()
            params = params.clone()
            params.extra_args = {
                **(params.extra_args or {}),
                **request_args(self.board, slot, monitor, self.marker),
            }
            params.stop_token_ids = [*(params.stop_token_ids or []), self.marker]
        elif monitor is not None and self.plan is not None and self.plan.monitor == "logprobs":
            rule = LogprobRule(monitor)
        # stop strings are matched in vLLM's detokenizer, and the rule reads streamed text
        if self.decodes_outputs and rule is None and not params.stop:
            params = params.clone() if slot is None else params
            params.detokenize = False
        return params, slot, rule

    def _waited(
        self, future: concurrent.futures.Future[Any], limit: float, batch: str | None
    ) -> Any:
        """The request's output, counted in flight (and under its batch, for ``abort_batch``)
        while it runs; past ``limit`` it is aborted in the engine."""
        with self._lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            if batch is not None:
                self._batches.setdefault(batch, set()).add(future)
        try:
            return future.result(timeout=limit)
        except concurrent.futures.TimeoutError:
            future.cancel()  # the client aborts the request in the engine
            raise JobTimeout(f"still generating after {limit:g}s; aborted") from None
        except concurrent.futures.CancelledError:
            with self._lock:
                reason = self._withdrawn.pop(future, None)
            if reason is None:
                raise
            raise JobWithdrawn(reason) from None
        finally:
            with self._lock:
                self.in_flight -= 1
                self.jobs_done += 1
                if batch is not None:
                    mine = self._batches.get(batch)
                    if mine is not None:
                        mine.discard(future)
                        if not mine:
                            del self._batches[batch]
                self._withdrawn.pop(future, None)

    def _logprobs(self, out: Output) -> list[TokenLogprob]:
        """The output's per-token logprobs with each token's text, for the tokens its text
        holds: the EOS or stop token that ended it is left out, as from the text."""
        entries = out.logprobs or []
        if out.finish_reason == "stop" and not isinstance(out.stop_reason, str) and entries:
            entries = entries[:-1]
        ids = sorted({t for tid, _, top in entries for t in (tid, *(x for x, _ in top))})
        texts = dict(zip(ids, self.prompts.token_texts(ids), strict=True))

        def top(t: int, lp: float) -> TopLogprob:
            return TopLogprob(token=texts[t], logprob=lp, bytes=list(texts[t].encode()))

        return [
            TokenLogprob(
                token=texts[tid],
                logprob=lp,
                bytes=list(texts[tid].encode()),
                top_logprobs=[top(t, x) for t, x in alts],
            )  # fmt: skip
            for tid, lp, alts in entries
        ]

    def active_batches(self) -> list[str]:
        """Batches with a request in the engine now."""
        with self._lock:
            return list(self._batches)

    def abort_batch(self, batch: str, reason: str) -> int:
        """Abort every request of ``batch`` in the engine (its waiting task threads raise
        ``JobWithdrawn``); returns how many."""
        with self._lock:
            futures = list(self._batches.get(batch, ()))
            for f in futures:
                self._withdrawn[f] = reason
        return sum(f.cancel() or f.cancelled() for f in futures)

    def _gate(self, prefix_key: str | None, limit: float) -> threading.Event | None:
        """Prefix gating: the first job of a prefix group goes at once and the rest of its group
        waits until that job's prefill is done (its first token), so they find the prefix's KV
        blocks cached instead of all computing it in the same step. Returns the event the caller
        must set when it leads a group; None when it follows (or gating is off)."""
        if not prefix_key or not self.settings.prefix_gating:
            return None
        with self._lock:
            event = self._groups.get(prefix_key)
            if event is None:
                event = self._groups[prefix_key] = threading.Event()
                while len(self._groups) > 4096:  # remember recent groups only
                    self._groups.popitem(last=False)
                return event
            self._groups.move_to_end(prefix_key)
        event.wait(min(limit, self.settings.prefix_gate_timeout_s))
        return None

    def on_death(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` once if the engine dies, with or without a job running."""
        self.client.on_death(callback)

    def close(self) -> None:
        try:
            self.client.close()
        finally:
            if self.board is not None:
                self.board.close()


def _float32(data: Any) -> Any:
    """A pooled vector (a torch tensor, in the model's dtype) as a float32 NumPy array."""
    import torch

    return data.detach().to(dtype=torch.float32, device="cpu").numpy()


if TYPE_CHECKING:  # the type check holds the real engine to the protocol
    _real: type[Engine] = EngineHost
