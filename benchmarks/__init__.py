"""Benchmarks: scripts that print a table and write JSON (docs/benchmarks.md)."""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any


def engine_setup(settings: Any, model: str) -> tuple[dict[str, Any], dict[str, str], Any]:
    """What a benchmark needs to build a raw vLLM engine the way a worker builds its own: the
    engine arguments (the monitor named in ``logits_processors`` where the plan says so) and the
    environment for the child process that builds it (the plan the plugin follows, and the
    plugin's entry point where vqueue runs from PYTHONPATH rather than installed, as on the GPU
    host, where there is no dist-info to find it by), and the plan itself, which results
    record."""
    from worker.vllm_ext.configure import MONITOR_CLASSES, configure_engine, engine_kwargs

    kwargs = engine_kwargs(settings, model)
    _, plan = configure_engine(settings, kwargs)
    kwargs = dict(kwargs)
    if plan.monitor in MONITOR_CLASSES:
        kwargs["logits_processors"] = [MONITOR_CLASSES[plan.monitor]]
    env = dict(os.environ)  # configure_engine set the owner and plan variables here
    return kwargs, _with_entry_point(env), plan


def _with_entry_point(env: dict[str, str]) -> dict[str, str]:
    from worker.vllm_ext.configure import plugin_registered
    from worker.vllm_ext.plugin import PLUGIN

    if plugin_registered():
        return env
    d = Path(tempfile.mkdtemp(prefix="vqueue-ep-"))
    info = d / "vqueue_plugin-0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vqueue-plugin\nVersion: 0\n")
    (info / "entry_points.txt").write_text(f"[vllm.general_plugins]\nvqueue = {PLUGIN}\n")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(d), env.get("PYTHONPATH")]))
    return env


def plugin_env() -> dict[str, str]:
    """The environment for a child that builds its engine with ``engine_setup`` itself."""
    return _with_entry_point(dict(os.environ))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def own_redis(work: Path | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """A ``redis-server`` of the run's own on a free port (no snapshot, no append-only file, its
    files under ``work``), once it answers, and its URL. A benchmark flushes and fills the Redis
    it uses, so never one that someone else holds. It runs in a session of its own, so that a
    benchmark killing its workers' process groups leaves it; the caller stops it."""
    import redis

    work = work or Path(tempfile.mkdtemp(prefix="vq-redis-"))
    port = free_port()
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--save", "", "--appendonly", "no",
         "--dir", str(work)],
        stdout=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    for _ in range(200):
        try:
            client.ping()
            return proc, url
        except redis.ConnectionError:
            if proc.poll() is not None:
                break
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"redis-server on port {port} did not start")
