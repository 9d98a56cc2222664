"""vLLM's frontend in a process of its own, apart from Celery.

vLLM's frontend (``AsyncLLM``) runs one loop that takes requests in and turns every engine
step's output into results; on short jobs it is never idle. Sharing an interpreter (one GIL)
with a worker's Celery consumer and task threads, every job's queue work (the Celery message,
the envelope, the prompt, the result written to Redis) is time taken from that loop, the engine
waits with free slots while jobs wait in Redis, and an urgent job waits behind bulk ones before
vLLM's scheduler sees it (docs/benchmarks.md has the measurements). ``vllm serve`` keeps its
API server apart from the engine core for the same reason; here the frontend loop runs alone in
a process of its own, and the worker keeps the queue work, the tokenizer and the per-job logic.
What crosses is token ids and sampling parameters one way, and each request's text, counts and
timings the other.

The wire is one duplex ``multiprocessing`` pipe of pickled tuples:

- worker to frontend: ``("gen", rid, prompt_ids, params, order, lead, rule, salt, lora)``,
  ``("abort", rid)``, ``("metrics", rid)``, ``("close",)``;
- frontend to worker: first ``("ready", plan, tokenizer)`` or ``("failed", kind, text)``, then
  lists of ``("first", rid)`` (a leading request's first token), ``("done", rid, Output)``,
  ``("error", rid, kind, text)``, ``("stats", totals)``, ``("metrics", rid, text)`` and, once
  vLLM's engine core is gone, ``("dead", reason)``.

Either side ending ends the other: the frontend shuts vLLM down when the worker's end of the
pipe closes, however the worker died, and the worker treats a frontend gone as a dead engine.

A worker with several intake processes (``Settings.intake_processes``) has its frontend also
listen on a Unix socket: each other process connects (``connect``), gets the same ``ready``,
and speaks the same messages; its answers go back on its own connection, and a connection
that closes has its requests aborted. The engine's numbers (``stats``, ``metrics``) are the
first process's to report.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import functools
import gc
import itertools
import logging
import multiprocessing
import os
import pickle
import queue
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from multiprocessing import connection
from multiprocessing.reduction import ForkingPickler
from typing import Any

from schemas import Settings

from .confidence import LogprobRule, Reading
from .metrics import EngineStats
from .vllm_ext.configure import ConfigError
from .vllm_ext.plugin import watch_owner

log = logging.getLogger(__name__)

# Requests the frontend starts on vLLM's loop per tick: enough to keep the engine fed, few
# enough that one tick never holds up the loop's turn of engine outputs into results.
ADMIT_PER_TICK = 32
# how often the frontend sends the scheduler's numbers (the worker's gauges and heartbeat)
STATS_EVERY_S = 1.0
# messages the frontend sends in one write, at most
SEND_BATCH = 512
# how long an intake process waits for its worker's frontend to listen: the frontend listens
# as soon as it is spawned, before it loads vLLM, which is seconds, not minutes
CONNECT_WAIT_S = 300.0


class EngineError(RuntimeError):
    """The engine refused or failed one request; the job fails, the worker carries on."""


class EngineDead(RuntimeError):
    """The engine process is gone: no job can run here any more; the worker must restart."""


# per output token: its id, its log probability, and the likeliest (id, log probability) pairs
TokenLogprobs = list[tuple[int, float, list[tuple[int, float]]]]


@dataclass(frozen=True)
class Output:
    """One finished request, as the frontend reports it."""

    text: str
    finish_reason: str | None
    stop_reason: int | str | None
    prompt_tokens: int
    completion_tokens: int
    first_token_at: float | None  # wall clock, from the engine's own request stats
    cached_tokens: int
    arrived_at: float | None = None  # wall clock: vLLM's frontend received the prompt
    scheduled_at: float | None = None  # wall clock: the engine first scheduled it
    aborted: bool = False  # the logprob rule stopped it (the path without the monitor)
    reading: Reading | None = None  # the rule's numbers, on that path
    finished_at: float | None = None  # wall clock: the final output reached the frontend
    preemptions: int = 0  # times the engine preempted it (vLLM's request stats)
    # the output's token ids, for a request sent with ``detokenize=False`` (its ``text`` is
    # empty: the worker's process decodes them, ``PromptTokenizer.output_text``)
    token_ids: list[int] | None = None
    # a request that asked for ``logprobs`` k: per output token, its id and log probability,
    # and the k likeliest (id, log probability) at its place, likeliest first
    logprobs: TokenLogprobs | None = None


# ------------------------------------------------------------------------- the worker's end
class FrontendLink:
    """The worker's end of one connection to the frontend: sends requests and hands each
    answer to its future.

    Task threads call ``submit`` and wait on the future it returns; one receiver thread reads
    the connection. Blocks in the constructor until the frontend says it is ready (or failed:
    ``ConfigError`` for settings vLLM refuses, ``RuntimeError`` for the rest)."""

    def __init__(self, conn: Any, on_stats: Any = None, process: Any = None) -> None:
        self._conn = conn
        self.process = process  # the frontend, when this worker started it
        self._on_stats = on_stats
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._pending: dict[str, concurrent.futures.Future[Any]] = {}
        self._leads: dict[str, threading.Event] = {}
        self.dead: str | None = None
        self._on_death: Any = None
        self._closed = False  # closed on purpose: what ends then is no death
        self._died = False
        _preload()  # while the frontend starts vLLM: what unpickling its tokenizer will import
        first = self._first()
        if first[0] == "failed":
            if process is not None:
                process.join(30)
            kind, text = first[1], first[2]
            raise (ConfigError if kind == "config" else RuntimeError)(text)
        _, self.plan, self.tokenizer = first
        threading.Thread(target=self._receive, name="vqueue-frontend-rx", daemon=True).start()

    def on_death(self, callback: Any) -> None:
        """Call ``callback()`` once when the engine dies, whether or not a request is waiting
        (at once if it already has). Not on ``close``: a stop asked for is no death."""
        with self._lock:
            self._on_death = callback
            died = self._died
        if died:
            callback()

    def _watched(self) -> list[Any]:
        return [self._conn] if self.process is None else [self._conn, self.process.sentinel]

    def _first(self) -> tuple[Any, ...]:
        ready = connection.wait(self._watched())
        if self._conn in ready:
            try:
                return tuple(self._conn.recv())
            except (EOFError, OSError):
                pass
        if self.process is None:
            raise RuntimeError("the engine's frontend closed the connection before it was ready")
        self.process.join(5)
        raise RuntimeError(
            f"the engine process exited (code {self.process.exitcode}) before it was ready"
        )

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
        Cancelling the future aborts it."""
        rid = uuid.uuid4().hex  # vLLM's request id too: fresh per call, a retry never collides
        future: concurrent.futures.Future[Output] = concurrent.futures.Future()
        data = pickle.dumps(
            ("gen", rid, prompt_ids, params, order, lead is not None, rule, salt, lora),
            protocol=pickle.HIGHEST_PROTOCOL,
        )
        with self._lock:
            if self.dead is not None:
                raise EngineDead(self.dead)
            self._pending[rid] = future
            if lead is not None:
                self._leads[rid] = lead
        future.add_done_callback(functools.partial(self._cancelled, rid))
        self._write(data)
        return future

    def metrics_text(self, timeout_s: float = 2.0) -> str | None:
        """vLLM's own Prometheus metrics, which live in the frontend process (exposition text)."""
        rid = uuid.uuid4().hex
        future: concurrent.futures.Future[str] = concurrent.futures.Future()
        with self._lock:
            if self.dead is not None:
                return None
            self._pending[rid] = future
        try:
            self._write(pickle.dumps(("metrics", rid)))
            return future.result(timeout=timeout_s)
        except (concurrent.futures.TimeoutError, EngineDead):
            return None
        finally:
            with self._lock:
                self._pending.pop(rid, None)

    def close(self) -> None:
        self._closed = True
        try:
            self._conn.close()
        except OSError:
            pass
        self._die("the engine was closed")

    def _write(self, data: bytes) -> None:
        try:
            with self._send_lock:
                self._conn.send_bytes(data)
        except (OSError, ValueError) as exc:  # the frontend is gone (or the pipe closed)
            raise EngineDead(self.dead or f"the engine process is gone ({exc})") from None

    def _cancelled(self, rid: str, future: concurrent.futures.Future[Any]) -> None:
        """A future cancelled by its waiter (a timeout, a withdrawn batch): abort the request."""
        if not future.cancelled():
            return
        with self._lock:
            self._pending.pop(rid, None)
            lead = self._leads.pop(rid, None)
        if lead is not None:
            lead.set()
        try:
            self._write(pickle.dumps(("abort", rid)))
        except EngineDead:
            pass

    def _receive(self) -> None:
        while True:
            ready = connection.wait(self._watched())
            if self._conn not in ready:
                break
            try:
                batch = self._conn.recv()
            except (EOFError, OSError):
                break
            for msg in batch:
                try:
                    self._dispatch(msg)
                except Exception:  # one odd message must not stop every job's answers
                    log.exception("frontend message %r not understood", msg[:2])
        if self.process is None:
            # the frontend's own process is its worker's to watch: this process learns of a death
            # from that worker's stop (``watch_owner``), or from its next request
            self._die("the engine's frontend closed the connection (its worker stopped)", False)
            return
        self.process.join(5)
        self._die(f"the engine process exited (code {self.process.exitcode})")

    def _dispatch(self, msg: tuple[Any, ...]) -> None:
        kind, rid = msg[0], msg[1]
        if kind == "stats":
            if self._on_stats is not None:
                self._on_stats(rid)
            return
        if kind == "dead":  # vLLM's engine core is gone (``rid``: why), whatever is running
            self._die(rid)
            return
        with self._lock:
            lead = self._leads.pop(rid, None)
            future = self._pending.pop(rid, None) if kind != "first" else None
        if lead is not None:
            lead.set()
        if future is None:
            return
        try:
            if kind in ("done", "metrics"):
                future.set_result(msg[2])
            elif msg[2] == "dead":
                future.set_exception(EngineDead(msg[3]))
            elif msg[2] == "cancelled":
                future.cancel()
            else:
                future.set_exception(EngineError(msg[3]))
        except concurrent.futures.InvalidStateError:  # its waiter cancelled it meanwhile
            pass

    def _die(self, reason: str, death: bool = True) -> None:
        """No more answers will come: every waiting request fails as a dead engine, and, for a
        ``death``, the ``on_death`` callback runs (unless the engine was closed on purpose)."""
        with self._lock:
            first = self.dead is None
            if first:
                self.dead = reason
            pending, self._pending = self._pending, {}
            leads, self._leads = self._leads, {}
            callback = None
            if first and death and not self._closed:
                self._died = True
                callback = self._on_death
        for lead in leads.values():
            lead.set()
        for future in pending.values():
            if not future.done():
                try:
                    future.set_exception(EngineDead(reason))
                except concurrent.futures.InvalidStateError:
                    pass
        if callback is not None:
            callback()


class FrontendProcess(FrontendLink):
    """Starts the frontend process and is its first connection. With ``listen`` (a Unix socket
    path and its key), the frontend also takes connections from the worker's other intake
    processes (``connect``) and serves them from the same engine."""

    def __init__(
        self,
        settings: Settings,
        model_path: str,
        on_stats: Any = None,
        listen: tuple[str, bytes] | None = None,
    ) -> None:
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no Celery threads
        conn, theirs = ctx.Pipe()
        # not a daemon: vLLM's frontend starts processes of its own (the engine core)
        process = ctx.Process(
            target=serve, args=(theirs, settings, model_path, listen), name="vqueue-frontend"
        )
        # vLLM's metrics in the frontend are its own registry's, fetched per scrape: keep them
        # out of the intake processes' shared metrics files (``worker.metrics.serve``)
        shared = os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
        try:
            process.start()
        finally:
            if shared is not None:
                os.environ["PROMETHEUS_MULTIPROC_DIR"] = shared
        theirs.close()
        super().__init__(conn, on_stats, process)

    def close(self, timeout_s: float = 30.0) -> None:
        self._closed = True
        try:
            self._write(pickle.dumps(("close",)))
        except EngineDead:
            pass
        self.process.join(timeout_s)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
        self._die("the engine was closed")


def connect(address: str, authkey: bytes, wait_s: float = CONNECT_WAIT_S) -> FrontendLink:
    """A connection to another process's frontend (an intake process's way to its engine).

    The worker starts its intake processes while its frontend starts vLLM: until the frontend
    listens, its socket is missing or refuses, and this tries again for up to ``wait_s``
    (the worker that started this process is watched meanwhile: ``watch_owner``). Once
    connected, it blocks until the engine is ready."""
    _preload()  # while the engine starts, not once it is up and waiting
    deadline = time.monotonic() + wait_s
    while True:
        try:
            conn = connection.Client(address, family="AF_UNIX", authkey=authkey)
            break
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            if time.monotonic() > deadline:
                waited = f"was not listening after {wait_s:g}s"
                raise EngineDead(f"the engine's frontend at {address} {waited}: {exc}") from None
            time.sleep(0.2)
        except (OSError, EOFError, multiprocessing.AuthenticationError) as exc:
            raise EngineDead(
                f"the engine's frontend at {address} cannot be reached: {exc}"
            ) from None
    return FrontendLink(conn)


def _preload() -> None:
    """Import here, while the frontend process builds the engine, what the worker needs once it
    is up (vLLM's tokenizer classes, its sampling parameters): overlapped, not added."""
    import importlib

    for name in (
        "vllm.sampling_params",
        "vllm.tokenizers.hf",  # vLLM >= 0.30
        "vllm.transformers_utils.tokenizer",  # before
        "transformers.tokenization_utils_fast",
    ):
        try:
            importlib.import_module(name)
        except ImportError:  # moved in this version, or missing: the frontend will say
            pass


# ---------------------------------------------------------------------- the frontend process
def serve(
    conn: Any, settings: Settings, model_path: str, listen: tuple[str, bytes] | None = None
) -> None:
    """The frontend process: build vLLM, report ready, serve requests until told to stop or
    until the worker is gone."""
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="[%(asctime)s: %(levelname)s/vqueue-frontend] %(name)s: %(message)s",
    )
    try:  # vLLM names its processes (VLLM::EngineCore); `ps` shows this one beside them
        import setproctitle

        setproctitle.setproctitle("vqueue::frontend")
    except ImportError:
        pass
    # the reader, the sender and vLLM's loop share this interpreter: hand the GIL over often
    sys.setswitchinterval(settings.gil_switch_ms / 1000)
    # a worker killed with SIGKILL takes this process within a second (and vLLM's processes,
    # which watch this one, a second later): an orphaned engine would keep the GPU's memory
    watch_owner(os.getppid())
    # listening from the start: the worker's intake processes start beside the engine, not
    # after it (they import as much as a worker does), and wait in the backlog until it is up
    listener = None
    if listen is not None:  # the key is checked per connection, off the accepting thread
        listener = connection.Listener(listen[0], family="AF_UNIX", backlog=64)
        os.chmod(listen[0], 0o600)
    try:
        frontend = Frontend(conn, settings, model_path)
    except ConfigError as exc:
        conn.send(("failed", "config", str(exc)))
        return
    except BaseException as exc:
        log.exception("the vLLM engine failed to start")
        conn.send(("failed", "engine", f"{type(exc).__name__}: {exc}"))
        return
    if listener is not None and listen is not None:
        frontend.listen(listener, listen[1])
    frontend.run()


class _Link:
    """One worker process's connection, as the frontend sees it: its answers queue here and a
    sender thread writes them, batched, so that vLLM's loop never blocks on a pipe."""

    def __init__(self, conn: Any, name: str) -> None:
        self.conn = conn
        self.name = name
        self.out: queue.SimpleQueue[Any] = queue.SimpleQueue()
        threading.Thread(target=self._send_loop, name=f"{name}-tx", daemon=True).start()

    def _send_loop(self) -> None:
        while True:
            msgs = [self.out.get()]
            while len(msgs) < SEND_BATCH:
                try:
                    msgs.append(self.out.get_nowait())
                except queue.Empty:
                    break
            try:
                self.conn.send_bytes(pickle.dumps(msgs, protocol=pickle.HIGHEST_PROTOCOL))
            except OSError:  # that worker process is gone: its reader sees it too
                return


class Frontend:
    """vLLM's ``AsyncLLM`` on its own loop thread, fed by a reader thread per connection (the
    worker's pipe, and the intake processes' sockets) and answering through sender threads."""

    def __init__(self, conn: Any, settings: Settings, model_path: str) -> None:
        self.settings = settings
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="vllm-loop")
        self._thread.daemon = True
        self._thread.start()
        self.stats = EngineStats()
        self._lock = threading.Lock()
        self._admissions: collections.deque[tuple[str, tuple[Any, ...]]] = collections.deque()
        self._waiting: set[str] = set()  # in ``_admissions`` and not aborted
        self._owner: dict[str, _Link] = {}  # each request's connection, until its answer
        self._admitting = False
        self._tasks: dict[str, asyncio.Task[Output]] = {}
        self._intakes: list[_Link] = []  # the intake processes' connections, while open
        self._stopping = False
        self.engine, self.plan = self._call(self._build(model_path))
        tokenizer = self.engine.get_tokenizer()
        if asyncio.iscoroutine(tokenizer):  # vLLM < 0.30 made it a coroutine
            tokenizer = self._call(tokenizer)
        self.tokenizer = tokenizer
        # vLLM and its engine client stay for the process's life: out of the collector's walks
        # (``worker.app.freeze_heap``; vLLM's API server freezes its heap the same way)
        gc.collect()
        gc.freeze()
        # vLLM's cached tokenizer pickles (vLLM sends it to its own processes the same way)
        conn.send(("ready", self.plan, tokenizer))
        self.main = _Link(conn, "vqueue-frontend")
        self.loop.call_soon_threadsafe(lambda: self.loop.create_task(self._report()))

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    async def _build(self, model_path: str) -> tuple[Any, Any]:
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        from .vllm_ext.configure import configure_engine, engine_kwargs

        kwargs = engine_kwargs(self.settings, model_path)
        config, plan = configure_engine(self.settings, kwargs)
        log.info("starting vLLM engine %s: %s", plan.vllm, plan.as_dict())
        # our stat logger rides along with vLLM's own (log line, vllm:* Prometheus metrics)
        # (EngineStats has StatLoggerBase's methods without importing vLLM to inherit them)
        loggers: list[Any] = [lambda *_a, **_k: self.stats]
        engine = AsyncLLM.from_vllm_config(
            config, usage_context=UsageContext.LLM_CLASS, stat_loggers=loggers
        )
        if self.settings.log_stats_s > 0:
            self._stats_task = asyncio.get_running_loop().create_task(self._log_stats(engine))
        return engine, plan

    async def _log_stats(self, engine: Any) -> None:
        """vLLM's own periodic line (throughput, running/waiting, KV use, prefix-cache hits),
        which its API server prints and a bare AsyncLLM does not."""
        while True:
            await asyncio.sleep(self.settings.log_stats_s)
            await engine.do_log_stats()

    async def _report(self) -> None:
        """Send the engine's numbers every ``STATS_EVERY_S`` (the worker that started this
        process keeps the engine's gauges), and tell every connection once vLLM's engine core
        is gone. A request running then fails with vLLM's ``EngineDeadError``, but an engine
        that dies with none running would otherwise go unnoticed until the next job."""
        while True:
            self.main.out.put(("stats", self.stats.totals()))
            if getattr(self.engine, "errored", False) and not self._stopping:
                log.error("vLLM's engine core is gone; telling the worker")
                with self._lock:
                    links = [self.main, *self._intakes]
                for link in links:
                    link.out.put(("dead", "vLLM's engine core is gone"))
                return
            await asyncio.sleep(STATS_EVERY_S)

    def listen(self, listener: Any, key: bytes) -> None:
        """Take the worker's intake processes' connections (``connect``) on a Unix socket
        only they know the key of; each gets the tokenizer and its own reader and sender."""
        log.info("serving the worker's intake processes on %s", listener.address)
        # pickled once: the tokenizer is megabytes, and every intake process gets the same
        ready = ForkingPickler.dumps(("ready", self.plan, self.tokenizer))

        def accept() -> None:
            for n in itertools.count(1):
                try:
                    conn = listener.accept()
                except OSError as exc:
                    log.warning("an intake connection failed: %s", exc)
                    continue
                # each in a thread of its own, from the key's challenge on: a connection that
                # never answers, or an intake process still importing that is slow to read the
                # tokenizer, must not hold up the others
                name = f"vqueue-intake-{n}"
                threading.Thread(
                    target=self._serve_intake, args=(conn, name, ready, key), name=name,
                    daemon=True,
                ).start()  # fmt: skip

        threading.Thread(target=accept, name="vqueue-frontend-listen", daemon=True).start()

    def _serve_intake(self, conn: Any, name: str, ready: bytes, key: bytes) -> None:
        try:  # what ``Listener(authkey=)`` does in ``accept``, here on this connection's thread
            connection.deliver_challenge(conn, key)
            connection.answer_challenge(conn, key)
            conn.send_bytes(ready)
        except (OSError, EOFError, multiprocessing.AuthenticationError) as exc:
            log.warning("an intake connection failed: %s", exc)
            conn.close()
            return
        link = _Link(conn, name)
        with self._lock:
            self._intakes.append(link)
        self._read(link)
        with self._lock:
            self._intakes.remove(link)
            mine = [rid for rid, owner in self._owner.items() if owner is link]
        for rid in mine:  # nobody waits for these any more
            self._abort(rid)
        log.warning("an intake process disconnected; %d of its requests aborted", len(mine))

    def run(self) -> None:
        """Read the worker's messages until it closes us or goes away, then stop vLLM."""
        try:
            self._read(self.main)
        finally:
            self._stopping = True  # vLLM reads as errored from here on: no death to report
            try:
                quiet = _stop_output_handler(self.engine)
                done = asyncio.run_coroutine_threadsafe(quiet, self.loop)
                with contextlib.suppress(Exception):  # a wedged loop: shut down as vLLM would
                    done.result(timeout=5)
                self.engine.shutdown()
            finally:
                self.loop.call_soon_threadsafe(self.loop.stop)
                self._thread.join(timeout=10)

    def _read(self, link: _Link) -> None:
        try:
            while True:
                msg = pickle.loads(link.conn.recv_bytes())
                kind = msg[0]
                if kind == "gen":
                    self._enqueue(link, msg[1], msg[2:])
                elif kind == "abort":
                    self._abort(msg[1])
                elif kind == "metrics":
                    link.out.put(("metrics", msg[1], _exposition()))
                elif kind == "close":
                    return
        except (EOFError, OSError):
            log.warning("%s: its worker process is gone", link.name)

    def _reply(self, rid: str, msg: tuple[Any, ...], last: bool = True) -> None:
        with self._lock:
            link = self._owner.pop(rid, None) if last else self._owner.get(rid)
        if link is not None:
            link.out.put(msg)

    def _enqueue(self, link: _Link, rid: str, args: tuple[Any, ...]) -> None:
        """Start requests on the loop in arrival order, ``ADMIT_PER_TICK`` at a time, so one
        tick's callbacks stay short while the loop also turns engine steps into results. Order
        by priority is vLLM's scheduler's (``order``), and the order jobs leave Redis."""
        with self._lock:
            self._owner[rid] = link
            self._admissions.append((rid, args))
            self._waiting.add(rid)
            if self._admitting:
                return
            self._admitting = True
        self.loop.call_soon_threadsafe(self._admit)

    def _admit(self) -> None:
        with self._lock:
            n = min(ADMIT_PER_TICK, len(self._admissions))
            batch = [self._admissions.popleft() for _ in range(n)]
            self._admitting = bool(self._admissions)
            batch = [b for b in batch if b[0] in self._waiting]
            self._waiting.difference_update(b[0] for b in batch)
        for rid, (ids, params, order, lead, rule, salt, lora) in batch:
            prompt = {"prompt_token_ids": ids, **({"cache_salt": salt} if salt else {})}
            task = self.loop.create_task(
                self._generate(rid, prompt, params, order, lead, rule, lora)
            )
            self._tasks[rid] = task
            task.add_done_callback(functools.partial(self._finished, rid))
        if self._admitting:
            self.loop.call_soon(self._admit)

    def _abort(self, rid: str) -> None:
        with self._lock:
            if rid in self._waiting:  # not started yet: it never will be
                self._waiting.discard(rid)
                self._owner.pop(rid, None)
                return
        self.loop.call_soon_threadsafe(self._cancel, rid)

    def _cancel(self, rid: str) -> None:
        task = self._tasks.get(rid)
        if task is not None:
            task.cancel()  # CancelledError inside _generate: vLLM aborts the request

    def _finished(self, rid: str, task: asyncio.Task[Output]) -> None:
        self._tasks.pop(rid, None)
        if task.cancelled():
            self._reply(rid, ("error", rid, "cancelled", ""))
        elif (exc := task.exception()) is not None:
            kind = "dead" if isinstance(exc, EngineDead) else "engine"
            self._reply(rid, ("error", rid, kind, str(exc)))
        else:
            self._reply(rid, ("done", rid, task.result()))

    async def _generate(
        self,
        rid: str,
        prompt: dict[str, Any],
        params: Any,
        order: int,
        lead: bool,
        rule: LogprobRule | None,
        lora: tuple[str, int, str] | None = None,
    ) -> Output:
        """One request to its end. ``lead``: report the first token (prefix gating). ``rule``:
        the early stop without the in-engine monitor: the request streams vLLM's own top-1
        logprob with each token, and is aborted in the engine at the token the rule holds,
        if ``rule.monitor.abort``."""
        from vllm.sampling_params import RequestOutputKind

        lora_request = None
        if lora is not None:
            from vllm.lora.request import LoRARequest

            lora_request = LoRARequest(*lora)
        final = None
        if rule is not None:
            params = params.clone()
            params.logprobs = max(params.logprobs or 0, 1)
            params.output_kind = RequestOutputKind.DELTA
        elif lead:  # the group's first job reports its first token to the rest
            params = params.clone()
            params.output_kind = RequestOutputKind.CUMULATIVE
        pieces: list[str] = []  # the text, when it streams back in deltas
        streamed = 0
        aborted = False
        try:
            async for out in self.engine.generate(
                prompt, params, rid, lora_request=lora_request, priority=order
            ):
                if final is None and lead:
                    self._reply(rid, ("first", rid), last=False)
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
        return Output(
            text=text,
            finish_reason=finish,
            stop_reason=choice.stop_reason,
            prompt_tokens=len(final.prompt_token_ids or prompt["prompt_token_ids"]),
            completion_tokens=tokens,
            first_token_at=_first_token_at(final),
            cached_tokens=int(getattr(final, "num_cached_tokens", 0) or 0),
            arrived_at=_arrived_at(final),
            scheduled_at=_scheduled_at(final),
            aborted=aborted,
            reading=reading,
            finished_at=time.time(),
            preemptions=int(getattr(getattr(final, "metrics", None), "num_preemptions", 0) or 0),
            token_ids=None if params.detokenize else list(choice.token_ids),
            logprobs=_token_logprobs(choice, params.logprobs) if rule is None else None,
        )


async def _stop_output_handler(engine: Any) -> None:
    """Stop AsyncLLM's output handler before its engine core goes. ``AsyncLLM.shutdown`` (vLLM
    0.26 and 0.32, read in their source) stops the core first and cancels the handler after;
    a handler that sees the core go in between (a race) logs "AsyncLLM output_handler failed"
    with an ``EngineDeadError`` traceback on a clean stop (vllm-project/vllm#48745; the fix,
    #49000, is open). Cancelling it first only reorders what shutdown does anyway; a vLLM
    without the attribute is left to its own order."""
    handler = getattr(engine, "output_handler", None)
    if handler is None or handler.done():
        return
    handler.cancel()
    with contextlib.suppress(BaseException):  # its cancellation, or the error it ended with
        await handler


def _exposition() -> str:
    from prometheus_client import REGISTRY, generate_latest

    return generate_latest(REGISTRY).decode()


def _token_logprobs(choice: Any, k: int | None) -> TokenLogprobs | None:
    """vLLM's per-token logprobs of a finished output (a dict of token id to ``Logprob`` per
    position, the sampled token always among them), as plain tuples that pickle small."""
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


def _first_token_at(final: Any) -> float | None:
    """Wall clock of the first token, from the engine's own request stats."""
    stats = getattr(final, "metrics", None)
    if stats is not None and getattr(stats, "first_token_latency", None):
        return float(stats.arrival_time + stats.first_token_latency)
    return None


def _arrived_at(final: Any) -> float | None:
    """Wall clock at which vLLM's frontend took the request (its ``arrival_time``)."""
    at = getattr(getattr(final, "metrics", None), "arrival_time", 0)
    return float(at) if at else None


def _scheduled_at(final: Any) -> float | None:
    """Wall clock at which the engine first scheduled the request: its arrival plus the time it
    waited in the scheduler's queue. The engine core stamps ``queued_ts`` and ``scheduled_ts``
    on its own monotonic clock (vLLM's ``RequestStateStats``, 0.26 through 0.33), so only their
    difference crosses to the frontend's wall clock; the hop between the two processes (well
    under a millisecond) is left out."""
    stats = getattr(final, "metrics", None)
    at = getattr(stats, "arrival_time", 0)
    queued, scheduled = getattr(stats, "queued_ts", 0), getattr(stats, "scheduled_ts", 0)
    return float(at + max(scheduled - queued, 0.0)) if at and queued and scheduled else None
