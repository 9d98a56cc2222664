"""Benchmarks: scripts that print a table and write JSON (docs/benchmarks.md)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def plugin_env() -> dict[str, str]:
    """The environment for a child that builds an engine. vqueue's vLLM plugin (which puts the
    confidence monitor and the batched guided step into the engine) is found by its entry
    point; where vqueue runs from PYTHONPATH rather than installed (the GPU host), there is no
    dist-info to find it by, so one is written to a temporary directory put on the path."""
    from worker.engine import plugin_registered

    env = dict(os.environ)
    if plugin_registered():
        return env
    d = Path(tempfile.mkdtemp(prefix="vqueue-ep-"))
    info = d / "vqueue_plugin-0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vqueue-plugin\nVersion: 0\n")
    (info / "entry_points.txt").write_text(
        "[vllm.general_plugins]\nvqueue = worker.engine:vllm_plugin\n"
    )
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(d), env.get("PYTHONPATH")]))
    return env
