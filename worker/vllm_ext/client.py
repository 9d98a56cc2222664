"""vLLM's own engine client, ``AsyncLLM``, inside the Celery process that takes the jobs.

Task threads hand requests to ``EngineClient.submit`` and wait on the future it returns; one
asyncio loop thread of this process runs ``AsyncLLM`` (vLLM's front end: it takes requests in,
sends them to the engine core over vLLM's own ZMQ, and turns each step's outputs into results).
Nothing of vqueue's own sits between a task and vLLM: a request is one
``call_soon_threadsafe`` onto the loop, and its answer one ``Future.set_result`` back.

Several Celery processes may share one engine core, as ``vllm serve --api-server-count N``
runs (``AsyncLLM(client_addresses=, client_count=, client_index=)``): the worker's process
launches the core with one pair of ZMQ addresses per client (``share``) and is its client 0;
each of its lanes (``worker.app.Lane``: more bulk processes, the urgent process) joins as the
next client with its pair (``CoreAddress``). Each
client gets only the outputs of its own requests. The launch is vLLM's ``launch_core_engines``,
whose signature differs between the releases in ``compat.VERIFIED["shared-core"]``; elsewhere
the worker runs one client and takes urgent jobs itself (``compat.shared_core_missing``).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import functools
import gc
import inspect
import json
import logging
import os
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

from schemas import Settings

from ..confidence import LogprobRule, Reading
from ..errors import EngineDead, EngineError
from ..metrics import EngineStats
from .configure import ConfigError

log = logging.getLogger(__name__)

__all__ = [
    "ConfigError",
    "CoreAddress",
    "EngineClient",
    "EngineDead",
    "EngineError",
    "Output",
    "Pooled",
]

# Requests started on vLLM's loop per tick: enough to keep the engine fed, few enough that one
# tick never holds up the loop's turn of engine outputs into results.
ADMIT_PER_TICK = 32
# how often the loop looks at whether vLLM's engine core is still there
WATCH_S = 1.0


# per output token: its id, its log probability, and the likeliest (id, log probability) pairs
TokenLogprobs = list[tuple[int, float, list[tuple[int, float]]]]


@dataclass(frozen=True)
class Output:
    """One finished request."""

    text: str
    finish_reason: str | None
    stop_reason: int | str | None
    prompt_tokens: int
    completion_tokens: int
    first_token_at: float | None  # wall clock, from the engine's own request stats
    cached_tokens: int
    arrived_at: float | None = None  # wall clock: vLLM's front end received the prompt
    scheduled_at: float | None = None  # wall clock: the engine first scheduled it
    aborted: bool = False  # the logprob rule stopped it (the path without the monitor)
    reading: Reading | None = None  # the rule's numbers, on that path
    finished_at: float | None = None  # wall clock: the final output reached the front end
    preemptions: int = 0  # times the engine preempted it (vLLM's request stats)
    # the output's token ids, for a request sent with ``detokenize=False`` (its ``text`` is
    # empty: the task thread decodes them, ``PromptTokenizer.output_text``)
    token_ids: list[int] | None = None
    # a request that asked for ``logprobs`` k: per output token, its id and log probability,
    # and the k likeliest (id, log probability) at its place, likeliest first
    logprobs: TokenLogprobs | None = None


@dataclass(frozen=True)
class Pooled:
    """One finished pooling request: its vector as vLLM's output holds it (a tensor)."""

    data: Any
    prompt_tokens: int
    arrived_at: float | None = None  # wall clock: vLLM's front end received the prompt
    finished_at: float | None = None  # wall clock: the output reached vLLM's front end


@dataclass(frozen=True)
class CoreAddress:
    """One client's pair of ZMQ addresses on a shared engine core, and its place among them:
    what the worker hands each of its lanes (``Settings.engine_client``)."""

    input: str
    output: str
    index: int
    count: int

    def spell(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def parse(cls, text: str) -> CoreAddress:
        return cls(**json.loads(text))

    @classmethod
    def fresh(cls, count: int) -> list[CoreAddress]:
        """IPC addresses for ``count`` clients, named after this process (``vqueue-core-<pid>-``)
        so a killed worker's are found and removed at the next start
        (``worker.app.remove_stale_files``)."""
        stem = os.path.join(
            tempfile.gettempdir(), f"vqueue-core-{os.getpid()}-{os.urandom(4).hex()}"
        )
        return [cls(f"ipc://{stem}-in{i}", f"ipc://{stem}-out{i}", i, count) for i in range(count)]

    def client_addresses(self) -> dict[str, Any]:
        return {"input_address": self.input, "output_address": self.output}


class EngineClient:
    """``AsyncLLM`` on a loop thread of this process.

    ``share``: launch the engine core for these clients (this process is ``share[0]``);
    ``join``: be a client of a core another process launched; neither: ``AsyncLLM`` launches
    its own core, as it does offline. Blocks until the engine is ready (``ConfigError`` for
    settings vLLM refuses)."""

    def __init__(
        self,
        settings: Settings,
        model_path: str,
        stats: EngineStats | None = None,
        share: list[CoreAddress] | None = None,
        join: CoreAddress | None = None,
    ) -> None:
        self.settings = settings
        self.stats = stats
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="vllm-loop", daemon=True)
        self._thread.start()
        self._lock = threading.Lock()
        # (future, args) not yet started on the loop, oldest first
        self._admissions: collections.deque[tuple[concurrent.futures.Future[Any], tuple[Any, ...]]]
        self._admissions = collections.deque()
        self._admitting = False
        self._tasks: dict[concurrent.futures.Future[Any], asyncio.Task[Output]] = {}
        self.dead: str | None = None
        self._closed = False
        self._on_death: Any = None
        self._core: Any = None  # vLLM's manager of the engine core this process launched
        try:
            self.engine, self.plan = self._call(self._build(model_path, share, join))
        except BaseException:
            self.loop.call_soon_threadsafe(self.loop.stop)
            raise
        tokenizer = self.engine.get_tokenizer()
        if inspect.iscoroutine(tokenizer):  # vLLM < 0.30 made it a coroutine
            tokenizer = self._call(tokenizer)
        self.tokenizer = tokenizer
        self.loop.call_soon_threadsafe(lambda: self.loop.create_task(self._watch()))

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    async def _build(
        self, model_path: str, share: list[CoreAddress] | None, join: CoreAddress | None
    ) -> tuple[Any, Any]:
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        from .compat import launch_core
        from .configure import configure_engine, engine_kwargs

        config, plan = configure_engine(self.settings, engine_kwargs(self.settings, model_path))
        log.info("starting vLLM engine %s: %s", plan.vllm, plan.as_dict())
        # our stat logger rides along with vLLM's own (log line, vllm:* Prometheus metrics)
        # (EngineStats has StatLoggerBase's methods without importing vLLM to inherit them)
        loggers: list[Any] = [lambda *_a, **_k: self.stats] if self.stats is not None else []
        kwargs: dict[str, Any] = {"usage_context": UsageContext.LLM_CLASS, "stat_loggers": loggers}
        me = join
        if share:
            self._core = launch_core(config, share)  # blocks until the core is up
            me = share[0]
        if me is not None:
            kwargs.update(
                client_addresses=me.client_addresses(), client_count=me.count, client_index=me.index
            )
        engine = AsyncLLM.from_vllm_config(config, **kwargs)
        if self.settings.log_stats_s > 0 and self.stats is not None:
            asyncio.get_running_loop().create_task(self._log_stats(engine))
        return engine, plan

    async def _log_stats(self, engine: Any) -> None:
        """vLLM's own periodic line (throughput, running/waiting, KV use, prefix-cache hits),
        which its API server prints and a bare AsyncLLM does not."""
        while True:
            await asyncio.sleep(self.settings.log_stats_s)
            await engine.do_log_stats()

    async def _watch(self) -> None:
        """Notice the engine core's death whether or not a request runs. vLLM's client watches
        a core it launched itself (``errored``); a core launched for several clients
        (``share``) is watched here, by its processes, as vLLM's own monitor does: its clients
        would otherwise wait on a socket nobody writes to. A joined client (the urgent process)
        learns of it from its worker's exit (``watch_owner``)."""
        while self.dead is None:
            procs = getattr(self._core, "processes", None) or ()
            gone = [p for p in procs if not p.is_alive()]
            if (gone or getattr(self.engine, "errored", False)) and not self._closed:
                why = f" (exit code {gone[0].exitcode})" if gone else ""
                log.error("vLLM's engine core is gone%s", why)
                self._die(f"vLLM's engine core is gone{why}")
                return
            await asyncio.sleep(WATCH_S)

    # ------------------------------------------------------------------- task threads' side
    def submit(
        self,
        prompt_ids: list[int],
        params: Any,
        order: int,
        lead: threading.Event | None = None,
        rule: LogprobRule | None = None,
        salt: str | None = None,
        lora: tuple[str, int, str] | None = None,
    ) -> concurrent.futures.Future[Output]:
        """Start one request. ``order``: vLLM's priority (lower first); ``lead``: set at the
        request's first token (or its end); ``lora``: vLLM's ``LoRARequest`` arguments.
        Cancelling the future aborts the request in the engine."""
        run = functools.partial(self._generate, params=params, order=order, lead=lead,
                                rule=rule, lora=lora)  # fmt: skip
        return self._queued(prompt_ids, salt, lead, run)

    def submit_pooling(
        self, prompt_ids: list[int], params: Any, order: int, salt: str | None = None
    ) -> concurrent.futures.Future[Pooled]:
        """Start one pooling request (an embedding: ``params`` is vLLM's ``PoolingParams``),
        as ``submit`` starts a generation."""
        run = functools.partial(self._pool, params=params, order=order)
        return self._queued(prompt_ids, salt, None, run)

    def _queued(
        self, prompt_ids: list[int], salt: str | None, lead: threading.Event | None, run: Any
    ) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            if self.dead is not None:
                raise EngineDead(self.dead)
            self._admissions.append((future, (prompt_ids, salt, lead, run)))
            wake = not self._admitting
            self._admitting = True
        future.add_done_callback(self._cancelled)
        if wake:
            self.loop.call_soon_threadsafe(self._admit)
        return future

    def _cancelled(self, future: concurrent.futures.Future[Any]) -> None:
        """A future its waiter cancelled (a timeout, a withdrawn batch): abort the request.
        One not started yet is dropped when its turn comes (``_admit``)."""
        if future.cancelled() and self.dead is None and not self.loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop stopped meanwhile
                self.loop.call_soon_threadsafe(self._cancel, future)

    def on_death(self, callback: Any) -> None:
        """Call ``callback()`` once when the engine dies, whether or not a request is waiting
        (at once if it already has). Not on ``close``: a stop asked for is no death."""
        with self._lock:
            self._on_death = callback
            died = self.dead is not None and not self._closed
        if died:
            callback()

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop vLLM's front end, then the engine core when this process launched it."""
        self._closed = True
        try:
            done = asyncio.run_coroutine_threadsafe(_stop_output_handler(self.engine), self.loop)
            with contextlib.suppress(Exception):  # a wedged loop: shut down as vLLM would
                done.result(timeout=5)
            self.engine.shutdown()
            if self._core is not None:
                self._core.shutdown(timeout=timeout_s)
        finally:
            self._die("the engine was closed")
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)

    def _die(self, reason: str) -> None:
        """No more answers will come: every waiting request fails as a dead engine, and the
        ``on_death`` callback runs (unless the engine was closed on purpose)."""
        with self._lock:
            if self.dead is not None:
                return
            self.dead = reason
            waiting = list(self._admissions)
            self._admissions.clear()
            callback = None if self._closed else self._on_death
        for _, (_ids, _salt, lead, _run) in waiting:
            if lead is not None:
                lead.set()  # a prefix group's lead that never started
        for future in [*(f for f, _ in waiting), *list(self._tasks)]:
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                future.set_exception(EngineDead(reason))
        if callback is not None:
            callback()

    # ------------------------------------------------------------------------ the loop's side
    def _admit(self) -> None:
        """Start requests in arrival order, ``ADMIT_PER_TICK`` at a time, so one tick's
        callbacks stay short while the loop also turns engine steps into results. Order by
        priority is vLLM's scheduler's (``order``), and the order jobs leave Redis."""
        with self._lock:
            n = min(ADMIT_PER_TICK, len(self._admissions))
            batch = [self._admissions.popleft() for _ in range(n)]
            self._admitting = bool(self._admissions)
        for future, (ids, salt, lead, run) in batch:
            if future.done():  # cancelled before its turn: it never starts
                if lead is not None:
                    lead.set()
                continue
            prompt = {"prompt_token_ids": ids, **({"cache_salt": salt} if salt else {})}
            task = self.loop.create_task(run(prompt))
            self._tasks[future] = task
            task.add_done_callback(functools.partial(self._finished, future, lead))
        if self._admitting:
            self.loop.call_soon(self._admit)

    def _cancel(self, future: concurrent.futures.Future[Any]) -> None:
        task = self._tasks.get(future)
        if task is not None:
            task.cancel()  # CancelledError inside _generate: vLLM aborts the request

    def _finished(
        self,
        future: concurrent.futures.Future[Any],
        lead: threading.Event | None,
        task: asyncio.Task[Output],
    ) -> None:
        self._tasks.pop(future, None)
        if lead is not None:
            lead.set()  # never leave a prefix group waiting
        if future.done():
            return
        with contextlib.suppress(concurrent.futures.InvalidStateError):
            if task.cancelled():
                future.cancel()
            elif (exc := task.exception()) is not None:
                future.set_exception(exc)
            else:
                future.set_result(task.result())

    async def _generate(
        self,
        prompt: dict[str, Any],
        *,
        params: Any,
        order: int,
        lead: threading.Event | None,
        rule: LogprobRule | None,
        lora: tuple[str, int, str] | None = None,
    ) -> Output:
        """One request to its end. ``lead``: set at the first token (prefix gating). ``rule``:
        the early stop without the in-engine monitor: the request streams vLLM's own top-1
        logprob with each token, and is aborted in the engine at the token the rule holds,
        if ``rule.monitor.abort``."""
        from vllm.sampling_params import RequestOutputKind

        lora_request = None
        if lora is not None:
            from vllm.lora.request import LoRARequest

            lora_request = LoRARequest(*lora)
        if rule is not None:
            params = params.clone()
            params.logprobs = max(params.logprobs or 0, 1)
            params.output_kind = RequestOutputKind.DELTA
        elif lead is not None:  # the group's first job reports its first token to the rest
            params = params.clone()
            params.output_kind = RequestOutputKind.CUMULATIVE
        rid = os.urandom(16).hex()  # fresh per call: a retry never collides
        final = None
        pieces: list[str] = []  # the text, when it streams back in deltas
        streamed = 0
        aborted = False
        try:
            async for out in self.engine.generate(
                prompt, params, rid, lora_request=lora_request, priority=order
            ):
                if final is None and lead is not None:
                    lead.set()
                final = out
                if rule is not None:
                    delta = out.outputs[0]
                    pieces.append(delta.text)
                    streamed += len(delta.token_ids)
                    if _rule_holds(rule, delta.logprobs) and rule.monitor.abort:
                        aborted = True
                        await self.engine.abort(rid)
                        break
        except asyncio.CancelledError:
            await self.engine.abort(rid)
            raise
        except Exception as exc:  # vLLM's own validation errors, engine-side failures
            if type(exc).__name__ == "EngineDeadError" or self.engine.errored:
                raise EngineDead(f"{type(exc).__name__}: {exc}") from exc
            raise EngineError(f"{type(exc).__name__}: {exc}") from exc
        if final is None or not final.outputs:
            raise EngineError("the engine returned no output")
        choice = final.outputs[0]
        text, tokens, finish = choice.text, len(choice.token_ids), choice.finish_reason
        reading = None
        if rule is not None:
            text, tokens, reading = "".join(pieces), streamed, rule.reading()
            finish = "stop" if aborted else finish
        stats = getattr(final, "metrics", None)
        return Output(
            text=text,
            finish_reason=finish,
            stop_reason=choice.stop_reason,
            prompt_tokens=len(final.prompt_token_ids or prompt["prompt_token_ids"]),
            completion_tokens=tokens,
            first_token_at=_first_token_at(stats),
            cached_tokens=int(getattr(final, "num_cached_tokens", 0) or 0),
            arrived_at=float(getattr(stats, "arrival_time", 0)) or None,
            scheduled_at=_scheduled_at(stats),
            aborted=aborted,
            reading=reading,
            finished_at=time.time(),
            preemptions=int(getattr(stats, "num_preemptions", 0) or 0),
            token_ids=None if params.detokenize else list(choice.token_ids),
            logprobs=_token_logprobs(choice, params.logprobs) if rule is None else None,
        )

    async def _pool(self, prompt: dict[str, Any], *, params: Any, order: int) -> Pooled:
        """One pooling request to its end (``AsyncLLM.encode``, as vLLM's embeddings endpoint
        runs it): the pooled vector as vLLM's output holds it (a CPU tensor), which the task
        thread turns into floats, not this loop."""
        rid = os.urandom(16).hex()
        final = None
        try:
            async for out in self.engine.encode(prompt, params, rid, priority=order):
                final = out
        except asyncio.CancelledError:
            await self.engine.abort(rid)
            raise
        except Exception as exc:  # vLLM's validation errors (dimensions), engine failures
            if type(exc).__name__ == "EngineDeadError" or self.engine.errored:
                raise EngineDead(f"{type(exc).__name__}: {exc}") from exc
            raise EngineError(f"{type(exc).__name__}: {exc}") from exc
        if final is None or getattr(final.outputs, "data", None) is None:
            raise EngineError("the engine returned no embedding")
        stats = getattr(final, "metrics", None)
        return Pooled(
            data=final.outputs.data,
            prompt_tokens=len(final.prompt_token_ids or prompt["prompt_token_ids"]),
            arrived_at=float(getattr(stats, "arrival_time", 0) or 0) or None,
            finished_at=time.time(),
        )


def freeze_heap() -> None:
    """Move every object alive now out of the garbage collector's reach (``gc.freeze``), as
    vLLM's own API server does once it has started. A process that has imported Celery, vLLM
    and transformers and loaded a tokenizer holds hundreds of thousands of tracked objects, and
    each collection of the oldest generation walks them all while every thread of the process
    waits: a pause in which that process takes no job off Redis, sends none to the engine and
    records no result (docs/benchmarks.md). Frozen, a collection walks only what was made since.
    What is frozen lives for the process's life anyway."""
    gc.collect()
    gc.freeze()


async def _stop_output_handler(engine: Any) -> None:
    """Stop AsyncLLM's output handler before its engine core goes. ``AsyncLLM.shutdown`` (vLLM
    0.26 and 0.32, read in their source) stops the core first and cancels the handler after;
    a handler that sees the core go in between (a race) logs "AsyncLLM output_handler failed"
    with an ``EngineDeadError`` traceback on a clean stop (vllm-project/vllm#48745). Cancelling
    it first only reorders what shutdown does anyway; a vLLM without the attribute is left to
    its own order."""
    handler = getattr(engine, "output_handler", None)
    if handler is None or handler.done():
        return
    handler.cancel()
    with contextlib.suppress(BaseException):  # its cancellation, or the error it ended with
        await handler


def _token_logprobs(choice: Any, k: int | None) -> TokenLogprobs | None:
    """vLLM's per-token logprobs of a finished output (a dict of token id to ``Logprob`` per
    position, the sampled token always among them), as plain tuples."""
    if k is None or choice.logprobs is None:
        return None
    out = []
    for tid, top in zip(choice.token_ids, choice.logprobs, strict=False):
        likeliest = sorted(top.items(), key=lambda kv: -kv[1].logprob)[:k]
        sampled = top.get(tid)
        out.append((
            tid,
            sampled.logprob if sampled is not None else float("-inf"),
            [(t, lp.logprob) for t, lp in likeliest],
        ))  # fmt: skip
    return out


def _rule_holds(rule: LogprobRule, logprobs: Any) -> bool:
    """Feed each new token's top-1 logprob (vLLM's ``logprobs=1`` dicts) to ``rule``."""
    held = False
    for top in logprobs or ():
        held = rule.step(max(lp.logprob for lp in top.values()) if top else 0.0) or held
    return held


def _first_token_at(stats: Any) -> float | None:
    """Wall clock of the first token, from the engine's own request stats."""
    if stats is not None and getattr(stats, "first_token_latency", None):
        return float(stats.arrival_time + stats.first_token_latency)
    return None


def _scheduled_at(stats: Any) -> float | None:
    """Wall clock at which the engine first scheduled the request: its arrival plus the time it
    waited in the scheduler's queue. The engine core stamps ``queued_ts`` and ``scheduled_ts``
    on its own monotonic clock (vLLM's ``RequestStateStats``, 0.26 through 0.33), so only their
    difference crosses to the front end's wall clock; the hop between the two processes (well
    under a millisecond) is left out."""
    at = getattr(stats, "arrival_time", 0)
    queued, scheduled = getattr(stats, "queued_ts", 0), getattr(stats, "scheduled_ts", 0)
    return float(at + max(scheduled - queued, 0.0)) if at and queued and scheduled else None
