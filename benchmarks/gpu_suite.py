"""The GPU suite: vqueue end to end against the better of two raw vLLM paths, on equal work.

    python -m benchmarks.gpu_suite --model /tmp/models/qwen05 --out $OUT \\
        --workloads mixed,prefix,long,long32k,json --rounds 3 --max-model-len 40960

Three systems, each with its own engine built from the same engine arguments (those a worker
builds: ``benchmarks.engine_setup``), all three resident on the GPU at once with their KV caches
sized in bytes, so that each round runs every workload on every system back to back (paired
rounds; the order of the systems rotates from round to round):

  raw LLM.chat  vLLM's offline ``LLM.chat`` on the jobs' messages, all at once; it renders and
                tokenizes inside its time.
  raw AsyncLLM  vLLM's online engine, the one a worker hosts, given every prompt as token ids at
                once; prompts are built by the worker's own code (``fit_input``, ``render``)
                before the clock starts.
  vqueue        one ``vqueue worker`` process; the Python producer submits every job and reads
                every result (the clock runs from the first submit to the last result read).
  vqueue no-monitor  (only when named in ``--systems``) the same worker and jobs, each with
                ``early_stop: false``: the confidence monitor's own share of a row.
  raw AsyncLLM as sent  (only when named) the raw AsyncLLM engine given every prompt at once
                with what a worker adds to each request of a job without early stop (its
                priority order, its tenant's ``cache_salt``, ``detokenize=False``): whether
                a gap between vqueue and raw lies in what the requests carry or in how they
                arrive. Not a baseline: it gets a ratio to raw as vqueue's rows do. It runs
                raw's prompts on raw's engine, and its salt keeps it from finding them in that
                engine's prefix cache, as vLLM keys every cached block by its request's salt.
  vqueue engine alone  (only when named) the worker's ``EngineHost`` (its engine client and
                engine, the monitor, what it adds to each request) built in the raw process
                and given raw's token ids at once, one thread a job: beside the as-sent row,
                whether a gap lies in the worker's engine host or in the queue before it.
  vqueue@NAME=VALUE[;NAME=VALUE]  (only when named) one more worker with an engine of its
                own, started with ``VQUEUE_NAME=VALUE``: a worker setting against raw vLLM and
                the default worker in the same rounds (``vqueue@JOBS_PER_MESSAGE=1``).

Equal work: the same prompts and sampling; output lengths fixed with ``ignore_eos``/``min_tokens``
(a random-weights model rarely stops). Guided JSON cannot be forced past its end, and vqueue runs
a JSON answer cut off at ``max_tokens`` once more with twice the room; both raw systems do the
same (LLM.chat in a second call, AsyncLLM per request, as the worker does), and every row counts
every token generated, first runs included. The script exits 1 when a vqueue row's generated
tokens differ by more than 1% from either raw row of its round.

Each round draws its own texts (same shapes and sizes; both sides of a round get the same jobs),
so that no round finds the last one's prompts in a prefix cache. Round 0 is not measured: every
workload at ``--warm-scale`` of its size on every system, so that whichever system runs first in
round 1 does not meet a workload's shapes alone (a 48-job warm-up left vqueue's first runs the
slowest of a call more often than not).

Each row also says how the run used the host: the CPU seconds of the system's processes, vLLM's
engine core apart (``engine_core_ms_per_step``), and the host's busy cores (``CpuTree``), beside
the GPU's clock and power (``GpuWatch``).

Per round, ``ratio_vs_raw`` is vqueue's jobs/s over the better raw row of that workload and round;
the summary gives medians over the rounds. Results go to ``--out`` after every round (suite.json,
suite.md), so a run cut short by ``--budget-s`` or a kill keeps what it measured. Also runs on a
CPU host at a small ``--scale``, which is how the script itself is checked.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

from pydantic import TypeAdapter

from benchmarks import free_port, plugin_env
from schemas import Job, Settings

from . import workloads as wl

ROOT = Path(__file__).resolve().parent.parent
_jobs: TypeAdapter[Any] = TypeAdapter(Job)
AS_SENT = "raw AsyncLLM as sent"
# the worker's own engine (``EngineHost``: its engine client, the monitor, what it adds to a
# request) driven from the raw process with raw's token ids, every prompt at once: no Celery and
# no Redis. Beside ``AS_SENT`` it splits a gap between the worker's engine host and the way the
# queue hands it jobs
ALONE = "vqueue engine alone"
SYSTEMS = ("raw LLM.chat", "raw AsyncLLM", "vqueue", "vqueue no-monitor", AS_SENT, ALONE)
RAW = SYSTEMS[:2]
# the same worker and jobs with the confidence monitor off (each job's ``early_stop: false``):
# what the monitor itself costs a row, told apart from the queue path in the same rounds
QUEUED = SYSTEMS[2:4]
# "vqueue@NAME=VALUE[;NAME=VALUE]": one more worker of its own, started with VQUEUE_NAME=VALUE
# in its environment (e.g. vqueue@INTAKE_PROCESSES=2), run in the same rounds as the others:
# a worker setting measured against raw vLLM and the default worker on the same card
VARIANT = "vqueue@"


def queued(system: str) -> bool:
    return system in QUEUED or system.startswith(VARIANT)


def variant_env(system: str) -> dict[str, str]:
    pairs = (x.split("=", 1) for x in system[len(VARIANT) :].split(";") if x)
    return {f"VQUEUE_{k.strip().upper()}": v.strip() for k, v in pairs}


# ------------------------------------------------------------------------------- helpers
def stop(proc: subprocess.Popen, log: Any, timeout: float) -> None:
    """SIGTERM (a worker drains, a server shuts down), SIGKILL after ``timeout``."""
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


def launch_worker(
    name: str, env: dict[str, str], log_path: Path, redis_url: str, *extra: str
) -> tuple[subprocess.Popen, Any, float]:
    """A ``vqueue worker`` on GPU 0 (when there is one); returns once its heartbeat shows, with
    its process, its log file and the seconds it took to start."""
    import redis

    from protocol.store import BatchStore

    s = Settings(
        _env_file=None, broker_url=redis_url, key_prefix=env.get("VQUEUE_KEY_PREFIX", "vqueue")
    )
    store = BatchStore.from_settings(s)
    redis.Redis.from_url(redis_url).ping()
    log = open(log_path, "w")  # noqa: SIM115
    argv = [sys.executable, "-m", "producer.cli", "worker", "-n", name, *extra]
    if shutil.which("nvidia-smi"):
        argv += ["--gpus", "0"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)

    default = Settings.model_fields["urgent_concurrency"].default
    # an engine stub, or a pooling model, takes every job in the one process (worker/app.py
    # `_engine`): no urgent one
    stub = not env.get("VQUEUE_ENGINE_CLASS", "worker.engine:").startswith("worker.engine:")
    alone = stub or env.get("VQUEUE_RUNNER") == "pooling"
    urgent = int(env.get("VQUEUE_URGENT_CONCURRENCY", default)) > 0 and not alone

    def up() -> bool:  # the worker, and its urgent process where it has one
        workers = store.workers(lanes=True)
        first = any(w.get("name") == name for w in workers)
        return first and (not urgent or any(w.get("urgent_of") == name for w in workers))

    while not up():
        if proc.poll() is not None or time.perf_counter() - t0 > 900:
            stop(proc, log, 30)
            raise RuntimeError(f"worker did not start (exit {proc.poll()}); see {log_path}")
        time.sleep(0.5)
    return proc, log, time.perf_counter() - t0


class OwnWorker(NamedTuple):
    proc: subprocess.Popen
    log: Any
    start_s: float
    client: Any  # producer.Client
    name: str


def worker_env(tag: str, model: str, redis_url: str, **env: str) -> dict[str, str]:
    """A benchmark worker's environment: vqueue's vLLM plugin findable, the queue and key prefix
    ``tag`` (nothing shared with another run on the same Redis), ``model``, ``env`` added."""
    return {
        **plugin_env(),
        "VQUEUE_BROKER_URL": redis_url,
        "VQUEUE_QUEUE": tag,
        "VQUEUE_KEY_PREFIX": tag,
        "VQUEUE_MODEL": model,
        "VQUEUE_HEARTBEAT_S": "1",
        # equal work: rounds repeat their prompts, and every one must reach the engine
        "VQUEUE_RESULT_CACHE": "false",
        **env,
    }


def own_worker(
    kind: str, model: str, redis_url: str, log_path: Path, *args: str, **env: str
) -> OwnWorker:
    """A ``vqueue worker`` serving ``model`` on a queue and key prefix of its own
    (``<kind>-<random>``), ``env`` added to its environment, and a producer for it; returns
    once it is up (``launch_worker``)."""
    from producer import Client

    tag = f"{kind}-{uuid.uuid4().hex[:8]}"
    full = worker_env(tag, model, redis_url, **env)
    proc, log, start_s = launch_worker(f"{tag}@gpu", full, log_path, redis_url, *args)
    client = Client(Settings(_env_file=None, broker_url=redis_url, queue=tag, key_prefix=tag))
    return OwnWorker(proc, log, start_s, client, f"{tag}@gpu")


class Stamps(NamedTuple):
    """One job's wall clocks through the system (None: not reported): queued in Redis
    (enqueued to started), building its prompt (to sent), on its way into vLLM (the hand-off to
    the engine client's loop and vLLM's input processing, to submitted), in the engine's queue
    (to scheduled), prefill (to the first token), then generating. Raw rows have no Redis and no
    prompt to build: enqueued and started are their clock's start,
    sent is when the request's coroutine called vLLM, and "into vLLM" is vLLM's own input
    processing of every prompt submitted at once."""

    enqueued: float | None = None
    started: float | None = None
    sent: float | None = None
    submitted: float | None = None
    scheduled: float | None = None
    first: float | None = None
    finished: float | None = None
    ttft_first: float | None = None  # raw rows: the first attempt's first token
    previous: float | None = None  # a job run again: when its earlier attempt ended

    @classmethod
    def of(cls, t: Any) -> Stamps:
        return cls(t.enqueued_at, t.started_at, t.sent_at, t.submitted_at, t.scheduled_at,
                   t.first_token_at, t.finished_at, previous=t.previous_finished_at)  # fmt: skip


PHASES = {  # row key: (from, to)
    "queue_wait_p50_s": ("enqueued", "started"),
    "prompt_build_p50_s": ("started", "sent"),
    "into_vllm_p50_s": ("sent", "submitted"),
    "engine_wait_p50_s": ("submitted", "scheduled"),
    "prefill_p50_s": ("scheduled", "first"),
    "generating_p50_s": ("first", "finished"),
}
# each phase's 99th percentile: where the batch's last jobs lost their time (a median can sit
# still while a tail of jobs reaches the engine late and the engine runs smaller steps)
TAILS = {k.replace("_p50_", "_p99_"): span for k, span in PHASES.items()}
RAMP = ("first_submitted_s", "last_submitted_s", "last_started_s", "last_sent_s", "last_result_s")
# jobs run again (a cut-off JSON answer): when the last first run ended, and how long from a
# first run's end to its rerun's prompt sent (vqueue: back to the task thread and out again)
RERUN = ("first_runs_done_s", "rerun_gap_p50_s", "rerun_gap_max_s")


def phases(stamps: list[Stamps], t0: float) -> dict[str, Any]:
    """Where the jobs' time went, per phase (medians), and the batch's shape on the clock of its
    run (seconds from its start): when the first and last job reached the engine, and when the
    last finished. A queue that feeds the engine later than a raw caller shows as a later
    ``last_submitted_s``; the rest is the same engine doing the same work. When the last job
    left Redis (``last_started_s``) and had its prompt built (``last_sent_s``) say which part
    of the queue path set that ramp."""

    def span(a: str, b: str) -> list[float]:
        return [getattr(x, b) - getattr(x, a) for x in stamps if getattr(x, a) and getattr(x, b)]

    subs = [x.submitted for x in stamps if x.submitted]
    out: dict[str, Any] = {k: pct(span(a, b), 50) for k, (a, b) in PHASES.items()}
    out.update({k: pct(span(a, b), 99) for k, (a, b) in TAILS.items()})
    out["first_submitted_s"] = min(subs) - t0 if subs else None
    out["last_submitted_s"] = max(subs) - t0 if subs else None
    latest = (
        ("last_started_s", "started"),
        ("last_sent_s", "sent"),
        ("first_runs_done_s", "previous"),
    )
    for key, field in latest:
        xs = [getattr(x, field) for x in stamps if getattr(x, field)]
        out[key] = max(xs) - t0 if xs else None
    out["last_result_s"] = max((x.finished or t0) for x in stamps) - t0
    gaps = span("previous", "sent")
    out["rerun_gap_p50_s"] = pct(gaps, 50)
    out["rerun_gap_max_s"] = max(gaps) if gaps else None
    return out


def pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


def build(
    t: wl.TextMaker,
    scale: float,
    names: list[str],
    scale_of: dict[str, float] | None = None,
    seed: int = 0,
    small: bool | None = None,
) -> dict[str, list[dict[str, Any]]]:
    """The workloads' jobs: at ``scale`` (1.0: mixed 1,000, prefix 800, long 200, long32k 40,
    json 500), or a workload's own scale in ``scale_of``; texts from ``t`` drawn with ``seed``.
    Each round has its own seed: with the same texts every round, a workload run without others
    in between finds its prompts in the engines' prefix cache from the second round on (40
    documents of 32K tokens fit in a 24 GiB cache), and times something else."""
    t.rng.seed(seed)
    if small is None:  # a CPU check: short documents, or it takes hours
        small = scale < 0.1
    scale_of = scale_of or {}

    def maker(name: str) -> list[dict[str, Any]]:
        k = scale_of.get(name, scale)

        def n(x: int) -> int:
            return max(3, round(x * k))

        if name == "mixed":
            return wl.mixed(t, n(1000))
        if name == "prefix":
            return wl.prefix_heavy(t, prefixes=max(2, n(25)), per_prefix=max(2, n(32)))
        if name == "long":
            return wl.long_context(t, n(200), in_tokens=1500 if small else 8000)
        if name == "long32k":
            return wl.long_context(t, n(40), in_tokens=3000 if small else 32000)
        if name == "json":
            return wl.json_heavy(t, n(500))
        raise SystemExit(f"unknown workload {name!r}")

    return {k: maker(k) for k in names}


def settings_for(a: argparse.Namespace) -> Settings:
    return Settings(
        _env_file=None,
        model=a.model,
        max_model_len=a.max_model_len,
        gpu_memory_utilization=a.gpu_memory_utilization,
        kv_cache_memory_bytes=a.kv_cache_bytes or None,
        load_format=a.load_format,
    )


# vLLM's own Prometheus series (0.26 and 0.32) that say how the engine spent a run: its steps
# (one histogram observation per step, of the tokens it scheduled) and its preemptions, each of
# which recomputes a prompt. Equal tokens in more steps, or more recomputed prompts, is more
# engine work for the same output.
ENGINE_SERIES = {
    "vllm:iteration_tokens_total_count": "engine_steps",
    "vllm:iteration_tokens_total_sum": "engine_tokens",
    "vllm:num_preemptions_total": "preemptions",
}


def engine_counters(text: str) -> dict[str, float]:
    """The engine's running totals (``ENGINE_SERIES``) in Prometheus text, summed over engines."""
    from prometheus_client.parser import text_string_to_metric_families

    out = dict.fromkeys(ENGINE_SERIES.values(), 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = ENGINE_SERIES.get(sample.name)
            if key is not None:
                out[key] += sample.value
    return out


def engine_work(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """What the engine did between two ``engine_counters`` readings, as row fields."""
    d = {k: after[k] - before[k] for k in after}
    steps = d["engine_steps"]
    return {
        "engine_steps": int(steps),
        "preemptions": int(d["preemptions"]),
        "tokens_per_step": d["engine_tokens"] / steps if steps else None,
    }


def row(
    workload: str,
    system: str,
    rnd: int,
    wall: float,
    jobs: int,
    generated: int,
    prompt_tokens: int,
    ttft: list[float],
    failed: int = 0,
    **extra: Any,
) -> dict[str, Any]:
    return {
        "workload": workload,
        "system": system,
        "round": rnd,
        "jobs": jobs,
        "failed": failed,
        "wall_s": wall,
        "jobs_per_s": jobs / wall,
        "generated_tokens": generated,
        "out_tok_per_s": generated / wall,
        "prompt_tokens": prompt_tokens,
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p99_s": pct(ttft, 99),
        **extra,
    }


def vqueue_row(
    client: Any, name: str, jobs: list[dict[str, Any]], rnd: int, timeout: float,
    system: str = "vqueue", metrics_url: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    """One workload through a worker end to end: the clock runs from the first submit to the
    last result read. With ``metrics_url`` (the worker's /metrics), what its engine did."""
    before = _scrape(metrics_url)
    t, t_wall0 = time.perf_counter(), time.time()
    batch = client.submit_many(jobs)
    submit_s = time.perf_counter() - t
    res = list(batch.results(timeout=timeout))
    wall = time.perf_counter() - t
    after = _scrape(metrics_url)
    done = [x for x in res if x.status == "completed"]
    ttft = [
        x.timings.first_token_at - x.timings.enqueued_at for x in res if x.timings.first_token_at
    ]
    parts = phases([Stamps.of(x.timings) for x in res], t_wall0)
    generated = sum(x.usage.completion_tokens + x.usage.wasted_tokens for x in res)
    sent = [x for x in res if x.timings.submitted_at]
    last = max(sent, key=lambda x: x.timings.submitted_at) if sent else None
    return row(
        name,
        system,
        rnd,
        wall,
        len(res),
        generated,
        sum(x.usage.prompt_tokens for x in res),
        ttft,
        failed=len(res) - len(done),
        submit_s=submit_s,
        retried=sum(1 for x in res if x.usage.wasted_tokens),
        errors=sorted({x.error.type for x in res if x.error}),
        cached_tokens=sum(x.usage.cached_tokens for x in res),
        **(engine_work(before, after) if before and after else {}),
        **parts,
        last_into_engine=_one_job(last, t_wall0) if last else None,
    )


def online_row(
    name: str, system: str, rnd: int, wall: float, t0: float, prep: list,
    res: list[tuple[int, int, Stamps, int]], work: dict[str, Any],
) -> dict[str, Any]:  # fmt: skip
    """A row of prompts handed to an engine at ``t0`` without a queue: per job, its tokens,
    whether it ran again, its clocks and its cached prompt tokens."""
    stamps = [r[2] for r in res]
    tokens, prompts = sum(r[0] for r in res), sum(len(ids) for _, _, ids, _ in prep)
    ttft = [x.ttft_first - t0 for x in stamps if x.ttft_first]
    return row(name, system, rnd, wall, len(res), tokens, prompts, ttft,
               retried=sum(r[1] for r in res), cached_tokens=sum(r[3] for r in res), **work,
               **phases([x._replace(enqueued=t0, started=t0) for x in stamps], t0))  # fmt: skip


def json_retry(job: Any, cut: bool, prompt_len: int, n: int, room: int) -> int | None:
    """The worker's one rerun of a JSON answer cut off at ``max_tokens`` (``runner``): the
    tokens it runs again with (twice as many, within the context), None when it does not."""
    from worker.answers import _wants_json

    if _wants_json(job) and cut and room - prompt_len > n:
        return min(2 * n, room - prompt_len)
    return None


def freeze_heap() -> None:
    """As vLLM's own server and every worker process do once started
    (``worker.app.freeze_heap``): no collection of the oldest generation walks the imported
    libraries in the middle of a row."""
    gc.collect()
    gc.freeze()


def _one_job(x: Any, t0: float) -> dict[str, Any]:
    """One job's way through the worker, its clocks in seconds from the row's start: which
    process took it (``worker``), and where the time went for the job that reached vLLM last."""
    st = Stamps.of(x.timings)
    return {
        "id": x.id,
        "worker": x.worker,
        "attempts": len(x.attempts or []),
        **{k: round(v - t0, 4) for k, v in st._asdict().items() if v is not None},
    }


def _scrape(url: str | None) -> dict[str, float] | None:
    """``engine_counters`` from a worker's /metrics; None without a url or when it fails."""
    if url is None:
        return None
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return engine_counters(resp.read().decode())
    except OSError:
        return None


# ---------------------------------------------------------------------- the raw engines
class RawEngines:
    """vLLM's offline ``LLM`` and online ``AsyncLLM`` in one process, built with a worker's
    engine arguments, serving the driver's ``RUN`` lines on stdin."""

    def __init__(
        self, a: argparse.Namespace, loads: dict[int, dict[str, list[dict[str, Any]]]]
    ) -> None:
        from vllm import LLM

        from . import engine_setup

        self.a, self.settings = a, settings_for(a)
        self.loads = loads
        kwargs, _env, self.plan = engine_setup(self.settings, a.model)
        self.llm: Any = None
        self.engine: Any = None
        self.llm_start_s = self.async_start_s = 0.0
        if "raw LLM.chat" in a.systems:
            t = time.perf_counter()
            self.llm = LLM(**kwargs)
            self.llm_start_s = time.perf_counter() - t
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        if "raw AsyncLLM" in a.systems or AS_SENT in a.systems:
            t = time.perf_counter()
            self.engine = self._call(self._build_async(kwargs))
            self.async_start_s = time.perf_counter() - t
        self.host: Any = None
        self.host_start_s = 0.0
        if ALONE in a.systems:
            from worker.engine import EngineHost

            t = time.perf_counter()
            self.host = EngineHost(self.settings)
            self.host_start_s = time.perf_counter() - t
        from transformers import AutoTokenizer

        from worker.prompts import PromptTokenizer

        self.prompts = PromptTokenizer(AutoTokenizer.from_pretrained(a.model), "raw")

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    @staticmethod
    def _counters() -> dict[str, float]:
        """``engine_counters`` of the AsyncLLM here (its stat logger writes this process's
        Prometheus registry; the offline LLM keeps no stats)."""
        from prometheus_client import REGISTRY, generate_latest

        return engine_counters(generate_latest(REGISTRY).decode())

    async def _build_async(self, kwargs: dict[str, Any]) -> Any:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        # as the worker builds its own (worker/engine.py): the offline usage context's defaults
        return AsyncLLM.from_engine_args(
            AsyncEngineArgs(**kwargs), usage_context=UsageContext.LLM_CLASS
        )

    def prepared(self, jobs: list[dict[str, Any]]) -> list[tuple[Any, Any, list[int], int]]:
        """(job, messages, prompt ids, max_tokens) per job, built by the worker's own code."""
        from worker.budget import fit_input
        from worker.prompts import build_messages

        s, out = self.settings, []
        for j in jobs:
            job = _jobs.validate_python(j)
            want = job.max_tokens or s.default_max_tokens(job.type)
            job, _cut, known = fit_input(job, self.prompts, s, want)
            messages = build_messages(job, s)
            ids = self.prompts.chat_prompt(messages, known)
            out.append((job, messages, ids, min(want, s.max_model_len - len(ids))))
        return out

    def run(self, system: str, name: str, rnd: int) -> dict[str, Any]:
        jobs = self.loads[rnd][name]
        prep = self.prepared(jobs)
        if system == "raw LLM.chat":
            return self._offline(name, rnd, prep)
        if system == ALONE:
            return self._alone(name, rnd, prep)
        return self._online(name, rnd, prep, system)

    def _alone(self, name: str, rnd: int, prep: list) -> dict[str, Any]:
        """Every prompt at once into the worker's ``EngineHost``, one thread a job, with the
        requests a worker sends (``runner._attempts``: the job's monitor, priority and tenant),
        and the same retry of a cut-off JSON answer as the raw rows. The monitor watches but
        never aborts, so that the tokens stay raw's."""
        from worker.confidence import Monitor
        from worker.sampling import early_stop_policy, sampling_params

        s, host, room = self.settings, self.host, self.settings.max_model_len

        def one(job: Any, ids: list[int], n: int) -> tuple[int, int, Stamps, int]:
            policy = early_stop_policy(job, s)
            monitor = None
            if policy is not None:
                grace = max(policy.grace_tokens, job.min_tokens)
                monitor = Monitor(policy.threshold, policy.window, grace, abort=False)
            tokens, retried, first_first, previous = 0, 0, None, None
            for attempt in (0, 1):
                gen = host.generate(ids, sampling_params(job, n), monitor=monitor,
                                    priority=job.priority, salt=s.tenant)  # fmt: skip
                tokens += gen.completion_tokens
                st = Stamps(sent=gen.sent_at, submitted=gen.submitted_at,
                            scheduled=gen.scheduled_at, first=gen.first_token_at,
                            finished=gen.finished_at or time.time())  # fmt: skip
                first_first = st.first if attempt == 0 else first_first
                more = json_retry(job, gen.finish_reason == "length", len(ids), n, room)
                if attempt or more is None:
                    break
                n, retried, previous = more, 1, st.finished
            stamps = st._replace(ttft_first=first_first, previous=previous)
            return tokens, retried, stamps, gen.cached_tokens

        def counters() -> dict[str, float]:
            from prometheus_client import REGISTRY, generate_latest

            # vLLM's own series, which its client registers in this process
            return engine_counters(generate_latest(REGISTRY).decode())

        before = counters()
        t, t0 = time.perf_counter(), time.time()
        with ThreadPoolExecutor(max_workers=max(1, len(prep))) as pool:
            res = list(pool.map(lambda p: one(p[0], p[2], p[3]), prep))
        wall = time.perf_counter() - t
        return online_row(name, ALONE, rnd, wall, t0, prep, res, engine_work(before, counters()))

    def _offline(self, name: str, rnd: int, prep: list) -> dict[str, Any]:
        from worker.sampling import sampling_params

        t = time.perf_counter()
        outs = self.llm.chat(
            [m for _, m, _, _ in prep],
            [sampling_params(j, n) for j, _, _, n in prep],
            use_tqdm=False,
        )
        generated = sum(len(o.outputs[0].token_ids) for o in outs)
        room = self.settings.max_model_len
        again = []
        for k, ((j, _, ids, n), o) in enumerate(zip(prep, outs, strict=True)):
            cut = o.outputs[0].finish_reason == "length"
            more = json_retry(j, cut, len(o.prompt_token_ids or ids), n, room)
            if more is not None:
                again.append((k, more))
        if again:  # the worker's retry of a cut-off JSON answer, as one more offline call
            more = self.llm.chat(
                [prep[k][1] for k, _ in again],
                [sampling_params(prep[k][0], n) for k, n in again],
                use_tqdm=False,
            )
            generated += sum(len(o.outputs[0].token_ids) for o in more)
        wall = time.perf_counter() - t
        ttft = [
            o.metrics.first_token_latency
            for o in outs
            if getattr(o, "metrics", None) is not None
            and getattr(o.metrics, "first_token_latency", None)
        ]
        return row(
            name,
            "raw LLM.chat",
            rnd,
            wall,
            len(outs),
            generated,
            sum(len(o.prompt_token_ids or []) for o in outs),
            ttft,
            retried=len(again),
        )

    def _online(self, name: str, rnd: int, prep: list, system: str) -> dict[str, Any]:
        from worker.sampling import sampling_params
        from worker.vllm_ext.client import _first_token_at, _scheduled_at

        room = self.settings.max_model_len
        as_sent = system == AS_SENT
        # what ``EngineHost.generate`` adds to a request (worker/engine.py)
        salt = {"cache_salt": self.settings.tenant} if as_sent else {}

        def params_of(job: Any, n: int) -> Any:
            params = sampling_params(job, n)
            if as_sent and not params.stop:  # the worker decodes the answer's ids itself
                params.detokenize = False
            return params

        def order(job: Any) -> int:
            by_priority = as_sent and self.settings.scheduling_policy == "priority"
            return 9 - job.priority if by_priority else 0

        async def one(job: Any, ids: list[int], n: int) -> tuple[int, int, Stamps, int]:
            tokens, retried, cached = 0, 0, 0
            first_first: float | None = None
            previous: float | None = None
            for attempt in (0, 1):
                final = None
                sent = time.time()
                async for out in self.engine.generate(
                    {"prompt_token_ids": ids, **salt},
                    params_of(job, n),
                    uuid.uuid4().hex,
                    priority=order(job),
                ):
                    final = out
                assert final is not None
                tokens += len(final.outputs[0].token_ids)
                cached = int(getattr(final, "num_cached_tokens", 0) or 0)
                # the returned attempt's engine stamps, as a vqueue result carries them
                st = Stamps(
                    sent=sent,
                    submitted=float(getattr(final.metrics, "arrival_time", 0)) or None,
                    scheduled=_scheduled_at(final.metrics),
                    first=_first_token_at(final.metrics),
                    finished=time.time(),
                )
                first_first = st.first if attempt == 0 else first_first  # TTFT: as before
                more = json_retry(
                    job, final.outputs[0].finish_reason == "length", len(ids), n, room
                )
                if attempt or more is None:
                    break
                n, retried, previous = more, 1, st.finished
            return tokens, retried, st._replace(ttft_first=first_first, previous=previous), cached

        async def everything() -> list[tuple[int, int, Stamps, int]]:
            return await asyncio.gather(*(one(j, ids, n) for j, _, ids, n in prep))

        before = self._counters()
        t, t0 = time.perf_counter(), time.time()
        res = self._call(everything())
        wall = time.perf_counter() - t
        work = engine_work(before, self._counters())
        return online_row(name, system, rnd, wall, t0, prep, res, work)


def serve_raw(a: argparse.Namespace) -> None:
    """The raw child: build both engines, say READY, then one ROW line per RUN line."""
    loads = {int(r): w for r, w in json.loads(Path(a.out, "workloads.json").read_text()).items()}
    raw = RawEngines(a, loads)
    freeze_heap()
    starts = {
        "llm_start_s": raw.llm_start_s,
        "async_start_s": raw.async_start_s,
        "engine_alone_start_s": raw.host_start_s,
        "plan": raw.plan.as_dict(),
    }
    print("READY " + json.dumps(starts), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "QUIT":
            break
        _, system, name, rnd = line.rstrip("\n").split("\t")
        print("ROW " + json.dumps(raw.run(system, name, int(rnd))), flush=True)
    if raw.engine is not None:
        raw.engine.shutdown()
    if raw.host is not None:
        raw.host.close()


class RawChild:
    """The driver's handle on ``serve_raw``."""

    def __init__(self, a: argparse.Namespace, env: dict[str, str], wait: bool = True) -> None:
        argv = [sys.executable, "-m", "benchmarks.gpu_suite", *sys.argv[1:], "--serve-raw"]
        env = dict(env, VLLM_LOGGING_STREAM="ext://sys.stderr")  # stdout carries the rows
        self.log = open(Path(a.out) / "raw.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            argv,
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )
        self.info: dict[str, Any] = {}
        if wait:
            self.ready()

    def ready(self) -> None:
        """Wait until its engines are loaded."""
        self.info = json.loads(self._expect("READY"))

    def _expect(self, tag: str) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(tag + " "):
                return line[len(tag) + 1 :]
            self.log.write(line)
        raise RuntimeError(f"the raw engines' process ended (exit {self.proc.wait()}); raw.log")

    def run(self, system: str, name: str, rnd: int) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"RUN\t{system}\t{name}\t{rnd}\n")
        self.proc.stdin.flush()
        r: dict[str, Any] = json.loads(self._expect("ROW"))
        return r

    def close(self) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write("QUIT\n")
            self.proc.stdin.close()
            self.proc.wait(120)
        except Exception:  # noqa: BLE001
            self.proc.kill()
        self.log.close()


# ------------------------------------------------------------------------------- vqueue
class Vqueue:
    """A worker on the same GPU, and the producer that feeds it."""

    def __init__(self, a: argparse.Namespace, **extra: str) -> None:
        env = dict(
            VQUEUE_MAX_MODEL_LEN=str(a.max_model_len),
            VQUEUE_GPU_MEMORY_UTILIZATION=str(a.gpu_memory_utilization),
            VQUEUE_LOAD_FORMAT=a.load_format,
            # raw vLLM has no loop retry, and random weights loop: equal work needs it off here
            VQUEUE_LOOP_DETECTION="off",
        )
        if a.kv_cache_bytes:
            env["VQUEUE_KV_CACHE_MEMORY_BYTES"] = str(a.kv_cache_bytes)
        env.update(extra)
        port = free_port()
        env["VQUEUE_METRICS_PORT"] = str(port)
        self.metrics_url = f"http://127.0.0.1:{port}/metrics"
        tag = "".join(f"-{k.removeprefix('VQUEUE_').lower()}={v}" for k, v in extra.items())
        log = "vqueue-worker" + re.sub(r"[^\w=.-]", "_", tag) + ".log"  # a log per variant
        w = own_worker("bench", a.model, a.redis, Path(a.out) / log,
                       "-l", "WARNING", **env)  # fmt: skip
        self.proc, self.log, self.start_s, self.client = w.proc, w.log, w.start_s, w.client
        self.a = a

    def run(
        self, name: str, jobs: list[dict[str, Any]], rnd: int, system: str = "vqueue"
    ) -> dict[str, Any]:
        if system == "vqueue no-monitor":
            jobs = [{**j, "early_stop": False} for j in jobs]
        return vqueue_row(self.client, name, jobs, rnd, self.a.timeout, system, self.metrics_url)

    def options_check(self) -> dict[str, Any]:
        """The chat options whose answer reads more of vLLM's output than text and token ids
        (per-token logprobs, ``n`` choices), once on this vLLM: whether each comes back whole.
        A check of the interface, not a figure."""
        ask = [{"role": "user", "content": "Name three colours."}]
        jobs = [
            {"id": "logprobs", "type": "chat", "messages": ask, "max_tokens": 8, "logprobs": 3},
            {"id": "n", "type": "chat", "messages": ask, "max_tokens": 8, "n": 3, "logprobs": 0},
        ]
        got = {r.id: r for r in self.client.submit_many(jobs).results(timeout=self.a.timeout)}
        lp, n = got["logprobs"], got["n"]
        return {
            "logprobs": {
                "status": lp.status,
                "error": lp.error.message if lp.error else None,
                "completion_tokens": lp.usage.completion_tokens,
                "tokens_with_logprobs": len(lp.logprobs or []),
                "top_logprobs_each": sorted({len(t.top_logprobs) for t in lp.logprobs or []}),
            },
            "n": {
                "status": n.status,
                "error": n.error.message if n.error else None,
                "choices": len(n.choices or []),
                "tokens_with_logprobs": [len(c.logprobs or []) for c in n.choices or []],
            },
        }

    def close(self) -> None:
        stop(self.proc, self.log, 120)


# ------------------------------------------------------------------------------- the GPU
class GpuWatch:
    """The GPU's SM clock, power and throttle reasons every 100 ms (NVML, through vLLM's own
    copy of pynvml), so that a row can say whether the card itself ran slower during it; and
    each process's share of the SMs (NVML's per-process samples), so that a row can say
    whether its own engine or another process kept the card busy."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, int, float, int]] = []  # time, MHz, W, reasons
        self.by_pid: list[tuple[float, int, int]] = []  # time, pid, SM %
        self._seen = 0  # NVML's timestamp (µs) of the last per-process sample read
        try:
            from vllm.third_party import pynvml

            pynvml.nvmlInit()
            self._nvml, self._h = pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception:  # no NVIDIA GPU here: rows go without
            return
        threading.Thread(target=self._run, name="gpu-watch", daemon=True).start()

    def _run(self) -> None:
        nv, h = self._nvml, self._h
        while True:
            try:
                self.samples.append(
                    (
                        time.time(),
                        nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM),
                        nv.nvmlDeviceGetPowerUsage(h) / 1000,
                        nv.nvmlDeviceGetCurrentClocksThrottleReasons(h),
                    )
                )
            except Exception:  # noqa: BLE001
                return
            self._processes()
            time.sleep(0.1)

    def _processes(self) -> None:
        """NVML's per-process SM samples since the last read (none yet, or a driver without
        them: the rows go without, the clock and power samples go on)."""
        try:
            got = self._nvml.nvmlDeviceGetProcessUtilization(self._h, self._seen)
        except Exception:  # noqa: BLE001
            return
        for x in got:
            self._seen = max(self._seen, int(x.timeStamp))
            self.by_pid.append((x.timeStamp / 1e6, int(x.pid), int(x.smUtil)))

    def during(self, t0: float, t1: float, own: set[int] | None = None) -> dict[str, Any]:
        xs = [x for x in self.samples if t0 <= x[0] <= t1]
        if not xs:
            return {}
        # reasons other than idle (1) and the application clock setting (2)
        slowed = sum(1 for x in xs if x[3] & ~0x3) / len(xs)
        out = {
            "sm_mhz_mean": statistics.mean(x[1] for x in xs),
            "sm_mhz_min": min(x[1] for x in xs),
            "power_w_mean": statistics.mean(x[2] for x in xs),
            "throttled_share": slowed,
        }
        per: dict[int, list[int]] = {}
        for at, pid, sm in self.by_pid:
            if t0 <= at <= t1:
                per.setdefault(pid, []).append(sm)
        if per and own is not None:  # each process's mean SM %, summed by side
            means = {pid: statistics.mean(v) for pid, v in per.items()}
            out["gpu_sm_own"] = sum(m for pid, m in means.items() if pid in own)
            out["gpu_sm_others"] = sum(m for pid, m in means.items() if pid not in own)
            out["gpu_sm_by_pid"] = {str(pid): round(m, 1) for pid, m in means.items()}
        return out


class CpuTree:
    """CPU seconds of a process and everything below it (Linux ``/proc``, nothing to install),
    split into vLLM's engine core and the rest, and the host's busy cores: whether a row's
    system spent its CPU where the engine step runs, or crowded the host around it."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.pids: set[int] = {pid}  # the tree at the last snapshot
        self.tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    @staticmethod
    def _stat(pid: str) -> tuple[int, str, float] | None:
        try:
            raw = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return None
        name, rest = raw[raw.index("(") + 1 : raw.rindex(")")], raw[raw.rindex(")") + 2 :].split()
        return int(rest[1]), name, int(rest[11]) + int(rest[12])  # ppid, comm, utime + stime

    @staticmethod
    def _host() -> tuple[int, int]:
        try:
            xs = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        except OSError:
            return 0, 0
        return sum(xs) - xs[3] - xs[4], sum(xs)  # busy (all but idle and iowait), total

    def snapshot(self) -> tuple[dict[str, float], tuple[int, int]]:
        procs = {}
        for d in os.listdir("/proc") if os.path.isdir("/proc") else []:
            if d.isdigit() and (st := self._stat(d)) is not None:
                procs[int(d)] = st
        mine, todo = {self.pid}, [self.pid]
        while todo:
            parent = todo.pop()
            for pid, (ppid, _, _) in procs.items():
                if ppid == parent and pid not in mine:
                    mine.add(pid)
                    todo.append(pid)
        self.pids = mine
        split = {"engine_core": 0.0, "other": 0.0}
        for pid in mine:
            if pid in procs:
                _, name, ticks = procs[pid]
                split["engine_core" if "EngineCor" in name else "other"] += ticks / self.tick
        return split, self._host()

    def between(self, a: Any, b: Any, steps: int | None) -> dict[str, Any]:
        (p0, (busy0, all0)), (p1, (busy1, all1)) = a, b
        core = p1["engine_core"] - p0["engine_core"]
        return {
            "cpu_s_engine_core": core,
            "cpu_s_other": p1["other"] - p0["other"],
            "engine_core_ms_per_step": 1e3 * core / steps if steps else None,
            "host_cores_busy": (busy1 - busy0) / (all1 - all0) * (os.cpu_count() or 1)
            if all1 > all0
            else None,
        }


# ------------------------------------------------------------------------------- report
def summarize(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """Per workload and system: medians over rounds; vqueue's ratio to the better raw row per
    round (median), and the equal-work check. Returns the summary rows and the failed checks."""
    problems: list[str] = []
    for r in rows:
        if r["system"] in RAW:
            continue
        raws = [
            x
            for x in rows
            if x["workload"] == r["workload"] and x["round"] == r["round"] and x["system"] in RAW
        ]
        if not raws:
            continue
        best = max(raws, key=lambda x: x["jobs_per_s"])
        r["ratio_vs_raw"] = r["jobs_per_s"] / best["jobs_per_s"]
        r["best_raw"] = best["system"]
        for x in raws:
            off = abs(r["generated_tokens"] - x["generated_tokens"]) / max(x["generated_tokens"], 1)
            r.setdefault("token_gap", {})[x["system"]] = off
            if off > 0.01:
                problems.append(
                    f"{r['workload']} round {r['round']}: {r['system']} generated "
                    f"{r['generated_tokens']} tokens, {x['system']} "
                    f"{x['generated_tokens']} ({off:.1%} apart)"
                )
    out = []
    for w in dict.fromkeys(r["workload"] for r in rows):
        for s in dict.fromkeys([*SYSTEMS, *(r["system"] for r in rows)]):
            rs = [r for r in rows if r["workload"] == w and r["system"] == s]
            if not rs:
                continue
            med = {
                k: statistics.median(r[k] for r in rs)
                for k in ("jobs_per_s", "out_tok_per_s", "wall_s", "generated_tokens")
            }
            summary = {
                "workload": w,
                "system": s,
                "rounds": len(rs),
                "jobs": rs[0]["jobs"],
                "failed": max(r["failed"] for r in rs),
                **med,
                "ttft_p50_s": _median(r["ttft_p50_s"] for r in rs),
                "ttft_p99_s": _median(r["ttft_p99_s"] for r in rs),
                # the share of prompt tokens the engine's prefix cache served; where the two
                # sides differ on equal prompts, the order jobs reached the engine did it
                "prefix_hit": _median(
                    r["cached_tokens"] / r["prompt_tokens"]
                    for r in rs
                    if r.get("cached_tokens") is not None and r["prompt_tokens"]
                ),
                "power_w": _median(r.get("power_w_mean") for r in rs),
                # the card's energy an output token: mean power over the round times its wall
                # time, over the tokens it generated (equal on both sides)
                "joules_per_token": _median(
                    r["power_w_mean"] * r["wall_s"] / r["generated_tokens"]
                    for r in rs
                    if r.get("power_w_mean") and r.get("generated_tokens")
                ),
                # SM % of the row's own processes and of every other (another engine's work
                # would share the card with this row's)
                "gpu_sm_own": _median(r.get("gpu_sm_own") for r in rs),
                "gpu_sm_others": _median(r.get("gpu_sm_others") for r in rs),
                # how the engine spent the run (ENGINE_SERIES): equal tokens in more steps,
                # or prompts recomputed after preemption, is more engine work
                "engine_steps": _median(r.get("engine_steps") for r in rs),
                "tokens_per_step": _median(r.get("tokens_per_step") for r in rs),
                "preemptions": _median(r.get("preemptions") for r in rs),
                # where the system's CPU went (CpuTree): the engine core's per step, and the
                # host's busy cores, which a system crowding the engine core's host shows
                "engine_core_ms_per_step": _median(r.get("engine_core_ms_per_step") for r in rs),
                "cpu_s_other": _median(r.get("cpu_s_other") for r in rs),
                "host_cores_busy": _median(r.get("host_cores_busy") for r in rs),
            }
            if s not in RAW and any("ratio_vs_raw" in r for r in rs):
                summary["ratio_vs_raw"] = statistics.median(
                    r["ratio_vs_raw"] for r in rs if "ratio_vs_raw" in r
                )
                summary["ratio_min"] = min(r["ratio_vs_raw"] for r in rs if "ratio_vs_raw" in r)
            for k in (*PHASES, *TAILS, *RAMP, *RERUN):
                summary[k] = _median(r.get(k) for r in rs)
            out.append(summary)
    return out, problems


def _median(xs: Any) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _f(x: Any, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def breakdown(summary: list[dict[str, Any]]) -> str:
    """Where the time went, per row (medians over rounds of per-round medians, seconds): the
    phases of a job, then when the last job reached the engine and the last result came."""
    lines = [
        "| workload | system | Redis wait | prompt build | into vLLM | engine queue | prefill "
        "| generating | last job out of Redis / prompt sent | first / last job in the engine "
        "| last result | reruns: first runs done, gap p50 / max |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summary:
        cells = " | ".join(_f(s.get(k), ".3f") for k in PHASES)
        lines.append(
            f"| {s['workload']} | {s['system']} | {cells} | {_f(s.get('last_started_s'), '.3f')}"
            f" / {_f(s.get('last_sent_s'), '.3f')} | {_f(s.get('first_submitted_s'), '.3f')}"
            f" / {_f(s.get('last_submitted_s'), '.3f')} | {_f(s.get('last_result_s'))} | "
            + (
                f"{_f(s.get('first_runs_done_s'))}, {_f(s.get('rerun_gap_p50_s'), '.3f')} / "
                f"{_f(s.get('rerun_gap_max_s'), '.3f')} |"
                if s.get("first_runs_done_s") is not None
                else "- |"
            )
        )
    return "\n".join(lines)


def table(summary: list[dict[str, Any]]) -> str:
    f = _f

    lines = [
        "| workload | system | jobs | rounds | jobs/s | output tok/s | generated tokens | "
        "TTFT p50 s | prefix-cache hits | GPU power W | mJ / output token | "
        "vs best raw (median, min) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summary:
        ratio = "-"
        if "ratio_vs_raw" in s:
            ratio = f"**{s['ratio_vs_raw']:.1%}** ({s['ratio_min']:.1%})"
        lines.append(
            f"| {s['workload']} | {s['system']} | {s['jobs']} | {s['rounds']} | "
            f"{f(s['jobs_per_s'], '.1f')} | {f(s['out_tok_per_s'], ',.0f')} | "
            f"{s['generated_tokens']:,.0f} | {f(s['ttft_p50_s'])} | "
            f"{f(s.get('prefix_hit'), '.1%')} | {f(s.get('power_w'), '.0f')} | "
            f"{f(s['joules_per_token'] * 1000 if s.get('joules_per_token') else None, '.2f')} | "
            f"{ratio} |"
        )
    return "\n".join(lines)


def write(out: Path, meta: dict[str, Any], rows: list[dict[str, Any]]) -> tuple[str, list[str]]:
    summary, problems = summarize(rows)
    doc = {"meta": meta, "summary": summary, "rows": rows, "equal_work_failures": problems}
    (out / "suite.json").write_text(json.dumps(doc, indent=2))
    text = table(summary) + "\n\n" + breakdown(summary)
    (out / "suite.md").write_text(text + "\n")
    return text, problems


def merge(paths: list[Path], out: Path) -> None:
    """One file from several device calls, each of which ran some of the workloads (a call's
    600 s do not hold every workload at full size): rows as they were, meta per call. A
    workload found in two calls is refused, since its rounds would no longer be paired."""
    docs = [json.loads(p.read_text()) for p in paths]
    seen: dict[str, Path] = {}
    for p, d in zip(paths, docs, strict=True):
        for w in dict.fromkeys(r["workload"] for r in d["rows"]):
            if w in seen:
                raise SystemExit(f"{w} is in both {seen[w]} and {p}")
            seen[w] = p
    meta = {
        "date": max(d["meta"]["date"] for d in docs),
        "merged_from": [str(p) for p in paths],
        "calls": [d["meta"] for d in docs],
        "workloads": {k: v for d in docs for k, v in d["meta"]["workloads"].items()},
    }
    out.mkdir(parents=True, exist_ok=True)
    text, problems = write(out, meta, [r for d in docs for r in d["rows"]])
    print(text)
    for p in problems:
        print(f"NOT EQUAL WORK: {p}", file=sys.stderr)


# --------------------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--out", required=True)
    ap.add_argument("--scale", type=float, default=1.0, help="multiply job counts")
    ap.add_argument(
        "--scale-of",
        default="",
        help="a workload's own scale, e.g. prefix=2,long32k=1 (the rest: --scale)",
    )
    ap.add_argument("--workloads", default="mixed,prefix,long,long32k,json")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--systems",
        default=",".join(SYSTEMS[:3]),
        help="a subset of: " + ", ".join(SYSTEMS) + " (each vqueue row is compared to the raw "
        "rows run)",
    )
    ap.add_argument("--max-model-len", type=int, default=40960)
    ap.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.28,
        help="low enough for three engines; the KV cache is --kv-cache-bytes",
    )
    ap.add_argument("--kv-cache-bytes", type=int, default=24 * 1024**3)
    ap.add_argument(
        "--start-together",
        action="store_true",
        help="start raw vLLM and the worker at once (needs --kv-cache-bytes, and room on the "
        "GPU for both): saves one engine start",
    )
    ap.add_argument("--load-format", default="auto", help="dummy: random weights, no files")
    ap.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument(
        "--budget-s",
        type=float,
        default=0,
        help="start no round that would end past this many seconds (0: no limit)",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="one more round, not measured, with every process sampling its stacks "
        "(benchmarks/profiling/sampler.py: profile/ and profile-<workload>-<system>.md "
        "under --out)",
    )
    ap.add_argument(
        "--warm-scale",
        type=float,
        default=0.1,
        help="round 0, not measured: every workload at this fraction of its size, every system",
    )
    ap.add_argument(
        "--pause-s",
        type=float,
        default=0.0,
        help="idle seconds before every run, so that none starts in the last one's wake",
    )
    ap.add_argument(
        "--merge",
        nargs="+",
        metavar="SUITE_JSON",
        help="no run: one suite.json/suite.md under --out from the rows of several calls' "
        "suite.json (each workload's rounds from one call: say which in the calls' meta)",
    )
    ap.add_argument("--serve-raw", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.merge:
        return merge([Path(x) for x in a.merge], Path(a.out))
    if not a.model:
        ap.error("--model is required")
    a.workloads = a.workloads.split(",")
    a.systems = [x.strip() for x in a.systems.split(",")]
    if unknown := {s for s in a.systems if s not in SYSTEMS and not s.startswith(VARIANT)}:
        ap.error(f"unknown systems: {sorted(unknown)}")
    if a.start_together and not a.kv_cache_bytes:
        ap.error("--start-together needs --kv-cache-bytes: an engine sizing its KV cache from "
                 "the free memory would count the other's as its own")  # fmt: skip
    # Qwen2.5's config says 32K positions; the long32k prompts with their answer need more
    os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    out = Path(a.out)
    if a.serve_raw:
        return serve_raw(a)
    began = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    scale_of = {k: float(v) for k, v in (x.split("=") for x in a.scale_of.split(",") if x)}
    texts = wl.TextMaker.of_model(a.model)
    last = a.rounds + a.profile  # the profiled round is one more, on prompts of its own
    loads = {r: build(texts, a.scale, a.workloads, scale_of, r) for r in range(1, last + 1)}
    # round 0, not measured: every workload at --warm-scale of its size on every system, so no
    # system meets a workload's shapes (CUDA graphs, grammars, long prompts) first in round 1
    warm_of = {k: v * a.warm_scale for k, v in scale_of.items()}
    loads[0] = build(texts, a.scale * a.warm_scale, a.workloads, warm_of, 0, a.scale < 0.1)
    # the no-monitor system shares vqueue's engine: texts of its own each round (same shapes and
    # sizes), or it would find the prompts vqueue just ran in that engine's prefix cache
    own = {
        r: build(texts, a.scale, a.workloads, scale_of, 1000 + r)
        for r in range(1, last + 1)
        if "vqueue no-monitor" in a.systems
    }
    prof = out / "profile"
    if a.profile:  # every process started from here on samples itself while prof/on exists
        from .profiling import sampler

        prof.mkdir(exist_ok=True)
        hook = str(ROOT / "benchmarks" / "profiling" / "hook")
        os.environ["PYTHONPATH"] = os.pathsep.join(
            filter(None, [hook, os.environ.get("PYTHONPATH")])
        )
        os.environ["VQUEUE_BENCH_PROFILE_DIR"] = str(prof)
        sampler.start()
    (out / "workloads.json").write_text(json.dumps(loads))
    meta: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "python -m benchmarks.gpu_suite " + " ".join(sys.argv[1:]),
        "gpu": subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
        ).stdout.strip()
        if shutil.which("nvidia-smi")
        else "none (CPU)",
        "workloads": {k: len(v) for k, v in loads[1].items()},
    }
    env = plugin_env()
    gpu = GpuWatch()
    t = time.perf_counter()
    # One engine at a time by default: vLLM checks the free memory as each one starts, and
    # sizes its KV cache from what it finds unless --kv-cache-bytes fixes it. With the size
    # fixed and both engines' shares free, --start-together starts them at once.
    raw = RawChild(a, env, wait=not a.start_together)
    vq = None
    vqs: dict[str, Vqueue] = {}
    rows: list[dict[str, Any]] = []
    try:
        if not a.start_together:
            meta.update(raw.info, raw_process_start_s=time.perf_counter() - t)
        # the default worker and each variant start at once, each with its own engine
        variants = [s for s in a.systems if s.startswith(VARIANT)]
        with ThreadPoolExecutor(1 + len(variants)) as pool:
            starting = {s: pool.submit(Vqueue, a, **variant_env(s)) for s in ["vqueue", *variants]}
            vqs = {s: f.result() for s, f in starting.items()}
        vq = vqs["vqueue"]
        if a.start_together:
            raw.ready()
            meta.update(raw.info, raw_process_start_s=time.perf_counter() - t)
            meta["started_together"] = True
        meta["vqueue_start_s"] = vq.start_s
        meta.update({f"{v}_start_s": vqs[v].start_s for v in variants})
        lanes = vq.client.store.workers(lanes=True)
        meta["vqueue_urgent_process"] = any(w.get("urgent_of") for w in lanes)
        import vllm

        meta["vllm"] = vllm.__version__
        systems = [s for s in SYSTEMS if s in a.systems] + variants
        freeze_heap()  # this process submits vqueue's jobs and reads their results
        on = {s: vqs.get(s, vq) for s in systems if queued(s)}  # the worker each system runs on
        for name, jobs in loads[0].items():  # round 0: every workload warm on every system
            for s in systems:
                _ = on[s].run(name, jobs, 0, s) if queued(s) else raw.run(s, name, 0)
        round_s = 0.0
        cpu = {s: CpuTree(on[s].proc.pid) for s in on}
        cpu_raw = CpuTree(raw.proc.pid)
        for rnd in range(1, last + 1):
            if a.budget_s and time.perf_counter() - began + round_s > a.budget_s:
                print(f"round {rnd} would end past --budget-s; stopping", flush=True)
                break
            profiled = rnd > a.rounds
            t = time.perf_counter()
            order = systems[rnd % len(systems) :] + systems[: rnd % len(systems)]
            for name, jobs in loads[rnd].items():
                for s in order:
                    part = f"{name}-{s.replace(' ', '-').replace('.', '')}"
                    time.sleep(a.pause_s)
                    if profiled:  # every process samples itself during this run only
                        (prof / "on").write_text(part)
                    tree = cpu.get(s, cpu_raw)
                    before = tree.snapshot()
                    t_run = time.time()
                    if queued(s):
                        mine = own[rnd][name] if s == "vqueue no-monitor" else jobs
                        r = on[s].run(name, mine, rnd, s)
                    else:
                        r = raw.run(s, name, rnd)
                    t_end = time.time()
                    r.update(tree.between(before, tree.snapshot(), r.get("engine_steps")))
                    r.update(started_at=t_run, **gpu.during(t_run, t_end, tree.pids))
                    if profiled:
                        (prof / "on").unlink()
                        time.sleep(0.6)  # each writes its stacks under prof/part
                        report = sampler.summarize(prof / part, 30)
                        (out / f"profile-{part}.md").write_text(report + "\n")
                    (meta.setdefault("profiled_rows", []) if profiled else rows).append(r)
                    print(json.dumps(r), flush=True)
            round_s = time.perf_counter() - t
            if not profiled:
                meta["rounds_done"] = rnd
            text, problems = write(out, meta, rows)
        if vq is not None:
            try:
                meta["options_check"] = vq.options_check()
            except Exception as exc:  # noqa: BLE001  # the figures stand; the check says why
                meta["options_check"] = {"failed": repr(exc)}
            print(json.dumps({"options_check": meta["options_check"]}), flush=True)
    finally:
        for w in vqs.values():
            w.close()
        raw.close()
    text, problems = write(out, meta, rows)
    print(text)
    for p in problems:
        print(f"NOT EQUAL WORK: {p}", file=sys.stderr)
    sys.exit(1 if problems or not rows else 0)


if __name__ == "__main__":
    main()
