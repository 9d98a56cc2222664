"""Session fixtures: a real Redis, the real embedded model, real worker processes.

Workers are started once per session (engine start is the slow part) on a private Redis database
and queue, and stopped at the end. Tests wait on conditions (heartbeat keys, batch counters),
never on fixed sleeps.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from schemas import Settings

ROOT = Path(__file__).resolve().parent.parent
REDIS_URL = os.environ.get("VQUEUE_TEST_REDIS", "redis://127.0.0.1:6379/13")
ARTIFACTS = ROOT / "tests" / "artifacts"


def wait_for(cond, timeout: float, what: str, interval: float = 0.2):
    """Poll ``cond`` until truthy; fail with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


@pytest.fixture(scope="session")
def redis_client() -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    try:
        client.ping()
    except redis.ConnectionError:
        subprocess.run(["redis-server", "--daemonize", "yes", "--save", ""], check=True)
        wait_for(lambda: _pings(client), 10, "redis-server to start")
    client.flushdb()
    yield client


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def make_settings(queue: str, **extra: object) -> Settings:
    fields: dict[str, object] = {"broker_url": REDIS_URL, "key_prefix": "vqtest", **extra}
    return Settings(_env_file=None, queue=queue, **fields)  # type: ignore[arg-type]


def worker_env(queue: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VQUEUE_")}
    env.update(
        VQUEUE_BROKER_URL=REDIS_URL,
        VQUEUE_QUEUE=queue,
        VQUEUE_KEY_PREFIX="vqtest",
        # small engine: two test workers and the suite fit in 24 GiB on 2 cores
        VQUEUE_KV_CACHE_MEMORY_BYTES=str(512 * 1024**2),
        VQUEUE_MAX_NUM_SEQS="8",
        VQUEUE_MAX_MODEL_LEN="2048",
        VQUEUE_CONCURRENCY="16",
        VQUEUE_HEARTBEAT_S="1",
        VQUEUE_METRICS_PORT="0",
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


class WorkerProc:
    """A real ``vqueue worker`` process, its log in tests/artifacts."""

    def __init__(self, name: str, queue: str, **env: str) -> None:
        self.name, self.queue = name, queue
        self.metrics_port = free_port()
        env.setdefault("VQUEUE_METRICS_PORT", str(self.metrics_port))
        ARTIFACTS.mkdir(exist_ok=True)
        self.log_path = ARTIFACTS / f"worker-{name}.log"
        if self.log_path.exists():  # a restarted worker of the same name keeps its first log
            self.log_path.replace(self.log_path.with_suffix(".prev.log"))
        self.log = open(self.log_path, "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "producer.cli", "worker", "-n", f"{name}@test", "-l", "INFO"],
            cwd=ROOT,
            env=worker_env(queue, **env),
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_ready(self, client: redis.Redis, timeout: float = 900) -> None:
        def ready() -> bool:
            if self.proc.poll() is not None:
                tail = self.log_path.read_text()[-4000:]
                raise AssertionError(f"worker {self.name} exited {self.proc.returncode}:\n{tail}")
            return bool(client.exists(f"vqtest:worker:{self.name}@test"))

        wait_for(ready, timeout, f"worker {self.name} to start", interval=1)

    def stop(self, timeout: float = 60) -> int | None:
        """SIGTERM to the worker process alone, as docker and Kubernetes send it: the engine's
        own process must stay up while the worker finishes what it holds."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()
        return self.proc.returncode


@pytest.fixture(scope="session")
def worker(redis_client: redis.Redis) -> Iterator[WorkerProc]:
    """One real worker with the real engine and model, shared by the whole session."""
    from worker.models import prepare_embedded

    prepare_embedded()
    w = WorkerProc("w1", "vqtest-main")
    try:
        w.wait_ready(redis_client)
        yield w
    finally:
        w.stop()


@pytest.fixture(scope="session")
def client(worker: WorkerProc):
    from producer import Client

    return Client(make_settings(worker.queue))


def run_cli(
    *args: str, queue: str = "vqtest-main", input: bytes | None = None, timeout: float = 600
):
    env = worker_env(queue)
    return subprocess.run(
        [sys.executable, "-m", "producer.cli", *args],
        cwd=ROOT,
        env=env,
        input=input,
        capture_output=True,
        timeout=timeout,
    )
