"""A big batch through both paths with faults on the way, on a CPU host with the STUB engine:
what it costs the producer, the server, the workers and Redis, and whether every job ends once.

    .venv/bin/python -m benchmarks.bulk --jobs 100000 --workers 2
    .venv/bin/python -m benchmarks.bulk --jobs 1000000 --paths cli
    .venv/bin/python -m benchmarks.bulk --jobs 100000 --per-message 16   # jobs in packs

Per path, on a Redis of its own and ``--workers`` worker processes whose engine is an instant
STUB (``benchmarks/stub_engine.py``: the queue's own costs, no generation):

  cli   ``vqueue submit FILE --wait --out OUT --take``
  http  ``vqueue serve``: upload the file, create the batch, poll it, download the output

Faults, by the share of jobs done: at 25% the feeding process (``vqueue submit``, or the
server) is killed (-9) and started again, which resumes the feed where it stopped; at 50% one
worker is killed (-9) and another started. Sampled every half second: Redis ``used_memory``,
the resident memory of the feeding process, the server and every worker (each with its child
processes); at 0, 50% and 100% done, how long a status read takes (the batch store's, and
``GET /v1/batches/{id}``). The run fails (exit 1) unless every job has exactly one line in the
output. Prints a table and writes bulk-<jobs>.json under ``--out`` (default
benchmarks/results/).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import redis

from benchmarks import free_port, own_redis, plugin_env
from protocol.store import BatchStore

ROOT = Path(__file__).resolve().parent.parent
PREFIX = "bulk"


def _rss(proc: subprocess.Popen[Any] | None) -> int:
    """Resident bytes of a process and its children (a worker's urgent and engine processes)."""
    if proc is None or proc.poll() is not None:
        return 0
    try:
        p = psutil.Process(proc.pid)
        return sum(x.memory_info().rss for x in [p, *p.children(recursive=True)])
    except psutil.Error:
        return 0


def _kill(proc: subprocess.Popen[Any]) -> None:
    """SIGKILL to the process's group: it and everything it started."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(30)


class Run:
    """One path's run: its Redis, workers, feeder, sampler and figures."""

    def __init__(self, a: argparse.Namespace, path: str, src: Path, work: Path) -> None:
        self.a, self.path, self.src, self.work = a, path, src, work
        self.redis_proc, self.url = own_redis(work)
        self.r = redis.Redis.from_url(self.url, decode_responses=True)
        self.store = BatchStore(self.r, PREFIX)
        self.env = dict(
            plugin_env(), VQUEUE_BROKER_URL=self.url, VQUEUE_QUEUE="bulk",
            VQUEUE_KEY_PREFIX=PREFIX, VQUEUE_HEARTBEAT_S="1", VQUEUE_RESULT_CACHE="false",
            VQUEUE_ENGINE_CLASS="benchmarks.stub_engine:StubEngine",
            VQUEUE_CONCURRENCY=str(a.concurrency), VQUEUE_VISIBILITY_TIMEOUT_S="30",
            VQUEUE_JOB_TIMEOUT_S="20",
            VQUEUE_WAIT_STALL_S="0", VQUEUE_FILES_DIR=str(work / "files"),
            VQUEUE_MAX_FILE_BYTES=str(4 * 1024**3), VQUEUE_API_MAX_BATCH_REQUESTS=str(10**8),
            VQUEUE_API_MAX_OPEN_JOBS=str(10**8), VQUEUE_API_POLL_S="0.5",
        )  # fmt: skip
        if a.window:
            self.env["VQUEUE_FEED_WINDOW"] = str(a.window)
        self.env["VQUEUE_JOBS_PER_MESSAGE"] = str(a.per_message)
        self.workers: list[subprocess.Popen[Any]] = []
        self.feeder: subprocess.Popen[Any] | None = None
        self.server: subprocess.Popen[Any] | None = None
        self.peak = {"redis_used_memory": 0, "feeder_rss": 0, "server_rss": 0, "worker_rss": 0}
        self.redis_at: dict[str, int] = {}
        self.status_ms: dict[str, dict[str, float]] = {}
        self.events: list[tuple[float, str]] = []
        self.batch = ""
        self.stop = threading.Event()

    # -- processes
    def popen(self, argv: list[str], log: str) -> subprocess.Popen[Any]:
        with open(self.work / log, "a") as fh:
            return subprocess.Popen([sys.executable, "-m", "producer.cli", *argv], cwd=ROOT,
                                    env=self.env, stdout=fh, stderr=subprocess.STDOUT,
                                    start_new_session=True)  # fmt: skip

    def start_worker(self) -> None:
        n = len(self.workers)
        self.workers.append(self.popen(["worker", "-n", f"stub{n}@bulk", "-l", "WARNING"],
                                       f"worker{n}.log"))  # fmt: skip
        deadline = time.time() + 120
        while not self.r.exists(f"{PREFIX}:worker:stub{n}@bulk"):
            if time.time() > deadline or self.workers[-1].poll() is not None:
                raise RuntimeError(f"stub worker {n} did not start: see {self.work}")
            time.sleep(0.2)

    def start_server(self) -> None:
        self.api_port = free_port()
        self.server = self.popen(["serve", "--port", str(self.api_port)], "serve.log")
        for _ in range(300):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.api_port}/healthz", timeout=2):
                    return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"vqueue serve did not start: see {self.work}")

    # -- watching
    def done(self) -> int:
        st = self.store.status(self.batch) if self.batch else None
        return st.done if st else 0

    def sample(self) -> None:
        while not self.stop.is_set():
            used = int(self.r.info("memory")["used_memory"])
            self.peak["redis_used_memory"] = max(self.peak["redis_used_memory"], used)
            self.peak["feeder_rss"] = max(self.peak["feeder_rss"], _rss(self.feeder))
            self.peak["server_rss"] = max(self.peak["server_rss"], _rss(self.server))
            self.peak["worker_rss"] = max(self.peak["worker_rss"], *map(_rss, self.workers))
            self.stop.wait(0.5)

    def status_latency(self, when: str) -> None:
        took = []
        for _ in range(5):
            t = time.perf_counter()
            self.store.status(self.batch)
            took.append((time.perf_counter() - t) * 1000)
        got = {"store_ms": statistics.median(took)}
        if self.path == "http" and self.server is not None:
            took = []
            for _ in range(5):
                t = time.perf_counter()
                req = urllib.request.Request(
                    f"http://127.0.0.1:{self.api_port}/v1/batches/{self.batch}",
                    headers={"Authorization": f"Bearer {self.key}"},
                )
                with urllib.request.urlopen(req, timeout=30) as resp:
                    resp.read()
                took.append((time.perf_counter() - t) * 1000)
            got["http_ms"] = statistics.median(took)
        self.status_ms[when] = got
        self.redis_at[when] = int(self.r.info("memory")["used_memory"])

    def until(self, cond: Callable[[], bool], what: str, timeout: float) -> None:
        deadline = time.time() + timeout
        while not cond():
            if time.time() > deadline:
                raise RuntimeError(f"{self.path}: timed out waiting for {what}")
            time.sleep(0.2)

    def event(self, what: str) -> None:
        self.events.append((round(time.perf_counter() - self.t0, 1), what))
        print(f"  {self.path} {self.events[-1][0]:>7}s {what}", file=sys.stderr, flush=True)

    # -- the run
    def run(self) -> dict[str, Any]:
        a, n = self.a, self.a.jobs
        for _ in range(a.workers):
            self.start_worker()
        threading.Thread(target=self.sample, daemon=True).start()
        out = self.work / "out.jsonl"
        self.t0 = time.perf_counter()
        first: float | None = None
        if self.path == "cli":
            self.batch = "bulk-cli"
            argv = ["submit", str(self.src), "--batch", self.batch, "--wait", "--out", str(out),
                    "--take", "-q"]  # fmt: skip
            self.feeder = self.popen(argv, "submit.log")
        else:
            self.start_server()
            self.key = subprocess.run(
                [sys.executable, "-m", "producer.cli", "keys", "create", "bulk"], cwd=ROOT,
                env=self.env, capture_output=True, check=True,
            ).stdout.decode().strip()  # fmt: skip
            self.batch = self.http_create()
        self.until(lambda: self.r.exists(self.store.key(self.batch)) > 0, "the batch", 600)
        self.status_latency("0%")
        self.until(lambda: self.done() > 0, "a first result", 600)
        first = time.perf_counter() - self.t0
        self.event("first result")
        self.until(lambda: self.done() >= n // 4, "25% done", 3600)
        self.event("25% done: the feeding process killed (-9) and started again")
        if self.path == "cli":
            assert self.feeder is not None
            _kill(self.feeder)
            self.feeder = self.popen(argv, "submit.log")
        else:
            assert self.server is not None
            _kill(self.server)
            self.start_server()
        self.until(lambda: self.done() >= n // 2, "50% done", 3600)
        self.status_latency("50%")
        self.event("50% done: worker 0 killed (-9), another started")
        _kill(self.workers[0])
        self.start_worker()
        if self.path == "cli":
            assert self.feeder is not None
            self.until(lambda: self.feeder.poll() is not None, "the submit to end", 3600)  # type: ignore[union-attr]
            rc = self.feeder.returncode
            if rc != 0:
                raise RuntimeError(f"vqueue submit exited {rc}: see {self.work}/submit.log")
        else:
            out = self.http_wait(out)
        wall = time.perf_counter() - self.t0
        half_s = next(t for t, what in self.events if what.startswith("50% done"))
        self.event("done")
        self.status_latency("100%")
        self.stop.set()
        ids: dict[str, int] = {}
        redelivered = 0  # jobs a worker took more than once (vqueue lines say: ``deliveries``)
        with open(out) as fh:
            for line in fh:
                row = json.loads(line)
                key = row.get("custom_id") or row.get("id")
                ids[key] = ids.get(key, 0) + 1
                redelivered += int(row.get("deliveries", 1)) > 1
        twice = sum(1 for v in ids.values() if v > 1)
        # delivery counts left in Redis once every job has its result: each leaves with its
        # job's result, or with a copy of a finished job, so any left is residue
        counts_left = int(self.r.hlen(self.store.key(self.batch, "attempts")))
        return {
            "path": self.path,
            "jobs": n,
            "workers": a.workers,
            "window": a.window or "auto",
            "wall_s": round(wall, 1),
            "jobs_per_s": round(n / wall, 1),
            # the first half, before the worker is killed: the killed worker's jobs come back
            # only after the visibility timeout (30 s here), which bounds the whole run's rate
            "jobs_per_s_first_half": round((n // 2) / half_s, 1),
            "first_result_s": round(first, 2),
            "lines_out": sum(ids.values()),
            "jobs_with_two_lines": twice,
            "missing": n - len(ids),
            "delivered_more_than_once": redelivered,
            "delivery_counts_left": counts_left,
            "peak_mb": {
                k.removesuffix("_rss").removesuffix("_used_memory"): round(v / 2**20, 1)
                for k, v in self.peak.items()
            },  # fmt: skip
            "redis_mb_at": {k: round(v / 2**20, 1) for k, v in self.redis_at.items()},
            "status_ms": self.status_ms,
            "events": self.events,
        }

    def http_create(self) -> str:
        import openai

        sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{self.api_port}/v1", api_key=self.key,
                            max_retries=3)  # fmt: skip
        with open(self.src, "rb") as fh:
            f = sdk.files.create(file=fh, purpose="batch")
        self.event(f"uploaded {f.bytes / 2**20:.0f} MB")
        b = sdk.batches.create(input_file_id=f.id, endpoint="/v1/vqueue/jobs",
                               completion_window="24h")  # fmt: skip
        return str(b.id)

    def http_wait(self, out: Path) -> Path:
        import openai

        sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{self.api_port}/v1", api_key=self.key,
                            max_retries=3)  # fmt: skip
        while (b := sdk.batches.retrieve(self.batch)).status not in (
            "completed", "failed", "expired", "cancelled"
        ):  # fmt: skip
            time.sleep(0.5)
        if b.status != "completed" or not b.output_file_id:
            raise RuntimeError(f"http batch ended {b.status}: {b.errors}")
        out.write_bytes(sdk.files.content(b.output_file_id).content)
        return out

    def close(self) -> None:
        self.stop.set()
        for p in [*self.workers, self.feeder, self.server, self.redis_proc]:
            if p is not None and p.poll() is None:
                _kill(p)


def make_input(path: Path, n: int, chars: int) -> None:
    body = ("The customer reports that the invoice total is wrong and asks for a corrected "
            "copy before Friday. ") * (chars // 90 + 1)  # fmt: skip
    with open(path, "w") as fh:
        for i in range(n):
            fh.write(json.dumps({"id": f"j{i:07d}", "type": "summarize",
                                 "text": f"{i}: " + body[:chars]}) + "\n")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=100_000)
    ap.add_argument("--paths", default="cli,http")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=64, help="each worker's task threads")
    ap.add_argument("--window", type=int, default=0, help="VQUEUE_FEED_WINDOW (0: auto)")
    ap.add_argument("--text-chars", type=int, default=200)
    ap.add_argument("--per-message", type=int, default=1, help="VQUEUE_JOBS_PER_MESSAGE (packs)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    a = ap.parse_args()
    if not shutil.which("redis-server"):
        raise SystemExit("redis-server is needed on PATH")
    work = Path(tempfile.mkdtemp(prefix="vqueue-bulk-"))
    src = work / "input.jsonl"
    make_input(src, a.jobs, a.text_chars)
    print(f"bulk: {a.jobs} jobs, {src.stat().st_size / 2**20:.0f} MB, work in {work}",
          file=sys.stderr)  # fmt: skip
    rows = []
    for path in a.paths.split(","):
        (work / path).mkdir()
        run = Run(a, path, src, work / path)
        try:
            rows.append(run.run())
        finally:
            run.close()
    doc = {
        "command": "python -m benchmarks.bulk " + " ".join(sys.argv[1:]),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "host": {"cpus": os.cpu_count(), "memory_gb": round(psutil.virtual_memory().total / 1e9)},
        "engine": "STUB (benchmarks/stub_engine.py): the queue's own costs, no generation",
        "jobs_per_message": a.per_message,
        "rows": rows,
    }
    head = (f"{'path':<5} {'jobs/s':>8} {'to 50%':>8} {'first s':>8} {'redis MB':>9} "
            f"{'feeder MB':>10} {'server MB':>10} {'worker MB':>10} {'status ms 0/50/100%':>22} "
            f"{'once':>5}")  # fmt: skip
    print(head)
    for r in rows:
        st = "/".join(f"{r['status_ms'][k]['store_ms']:.1f}" for k in ("0%", "50%", "100%"))
        ok = r["missing"] == 0 and r["jobs_with_two_lines"] == 0
        p = r["peak_mb"]
        print(f"{r['path']:<5} {r['jobs_per_s']:>8.0f} {r['jobs_per_s_first_half']:>8.0f} "
              f"{r['first_result_s']:>8.2f} "
              f"{p['redis']:>9.0f} {p['feeder']:>10.0f} {p['server']:>10.0f} "
              f"{p['worker']:>10.0f} {st:>22} {'yes' if ok else 'NO':>5}")  # fmt: skip
    packs = f"-packs{a.per_message}" if a.per_message > 1 else ""
    dest = Path(a.out) / f"bulk-{a.jobs}{packs}-{time.strftime('%Y-%m-%d')}.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {dest}", file=sys.stderr)
    if any(r["missing"] or r["jobs_with_two_lines"] for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
