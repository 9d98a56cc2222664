"""Project-level checks that need no engine: the compose file, the schema export, the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from protocol.exits import RET_CONFIG

from .conftest import ROOT, WORKDIR, clean_env, require, run_cli


def test_compose_file_is_valid_and_refuses_to_run_without_passwords() -> None:
    import os

    import yaml

    require("docker-compose")  # CI installs it; missing, this fails in CI
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_PASSWORD", "FLOWER_PASSWORD")}
    bare = subprocess.run(
        ["docker-compose", "config", "-q"], cwd=ROOT, env=env, capture_output=True
    )
    assert bare.returncode != 0 and b"set REDIS_PASSWORD" in bare.stderr
    env.update(REDIS_PASSWORD="r-secret", FLOWER_PASSWORD="f-secret")
    proc = subprocess.run(["docker-compose", "config"], cwd=ROOT, env=env, capture_output=True)
    assert proc.returncode == 0, proc.stderr.decode()
    services = yaml.safe_load(proc.stdout)["services"]
    assert "--appendonly" in services["redis"]["command"]
    redis_cmd = services["redis"]["command"]
    assert redis_cmd[redis_cmd.index("--maxmemory-policy") + 1] == "noeviction"
    for name, gpu in (("worker-gpu0", "0"), ("worker-gpu1", "1")):
        (device,) = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["device_ids"] == [gpu] and device["capabilities"] == ["gpu"]
        assert services[name]["environment"]["VQUEUE_BROKER_URL"].startswith("redis://:r-secret@")
    assert "--basic-auth=admin:f-secret" in services["flower"]["command"]


def test_schema_command_prints_the_job_schema() -> None:
    proc = run_cli("schema")
    schema = json.loads(proc.stdout)
    assert {"summarize", "extract", "codegen", "chat"} <= set(schema["discriminator"]["mapping"])


def test_producer_imports_no_engine() -> None:
    code = (
        "import producer, sys; from producer import cli; "
        "print(sorted(m for m in ('vllm', 'torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, cwd=WORKDIR,
                         env=clean_env())  # fmt: skip
    assert out.stdout.decode().strip() == "[]", out.stderr.decode()


def _imports() -> dict[str, set[str]]:
    """Each of the four packages' modules, and the modules of them it imports, wherever the
    import stands (a function's own imports included)."""
    import ast

    from .conftest import ROOT

    graph: dict[str, set[str]] = {}
    for package in ("worker", "producer", "protocol", "schemas"):
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            here = parts[:-1]
            name = ".".join(parts if parts[-1] != "__init__" else parts[:-1])
            found = graph.setdefault(name, set())
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    found.update(a.name for a in node.names)
                elif isinstance(node, ast.ImportFrom):
                    base = here[: len(here) - node.level + 1] if node.level else []
                    module = ".".join([*base, *([node.module] if node.module else [])])
                    found.update(f"{module}.{a.name}" for a in node.names)
                    if node.module:  # else `from . import x`: x alone is imported
                        found.add(module)
    known = set(graph)

    def owner(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    return {m: {o for d in deps if (o := owner(d)) and o != m} for m, deps in graph.items()}


def test_producer_and_worker_share_only_protocol_and_schemas() -> None:
    # The wire both sides speak lives in protocol/; neither side reaches into the other's code
    # (`vqueue worker` runs `python -m worker` in its place), and the bottom layers import
    # neither side
    foreign = {
        "worker": ("producer",),
        "producer": ("worker",),
        "protocol": ("producer", "worker"),
        "schemas": ("producer", "worker", "protocol"),
    }
    found = [(m, d) for m, deps in _imports().items() for d in deps
             if d.split(".")[0] in foreign[m.split(".")[0]]]  # fmt: skip
    assert found == []


def test_no_module_imports_one_that_imports_it_back() -> None:
    graph = _imports()
    cycles = []

    def walk(path: list[str]) -> None:
        for nxt in sorted(graph.get(path[-1], ())):
            if nxt == path[0]:
                cycles.append(path)
            elif nxt not in path and nxt > path[0]:  # each cycle once, from its least module
                walk([*path, nxt])

    for module in sorted(graph):
        walk([module])
    assert cycles == []


def test_the_worker_imports_no_vllm_until_it_builds_its_engine() -> None:
    # vLLM's internals are touched from one package (worker/vllm_ext), and only by the engine
    code = (
        "import sys, worker.app, worker.tasks, worker.engine, worker.runner, "
        "worker.vllm_ext.compat; "
        "print(sorted(m for m in ('vllm', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, cwd=WORKDIR,
                         env=clean_env())  # fmt: skip
    assert out.stdout.decode().strip().splitlines()[-1] == "[]", out.stderr.decode()[-2000:]


@pytest.mark.unit
def test_the_engine_stubs_offer_everything_the_worker_asks_of_an_engine() -> None:
    # the fake engine (queue-mechanics tests) and the benchmarks' stub stand in for EngineHost,
    # which the type check holds to the same protocol
    from benchmarks.stub_engine import StubEngine
    from schemas import Settings
    from worker.engine import Engine

    from .fake_engine import FakeEngine

    for stub in (FakeEngine, StubEngine):
        assert isinstance(stub(Settings()), Engine), stub


def test_worker_check_prints_what_its_engine_would_run_with() -> None:
    # `vqueue worker --check` starts nothing: vLLM, torch, the device and the plan
    proc = run_cli("worker", "--check", "--json", timeout=300)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    report = json.loads(proc.stdout.decode().strip().splitlines()[-1])
    assert report["vllm"].startswith("0.32") and report["torch"].startswith("2.13")
    assert report["device"] == "cpu" and report["plugin_registered"] is True
    assert report["model_runner"] == "v1" and report["monitor"] == "v1"
    assert report["guided_batching"] and report["grammar_reuse"] and report["mask_reorder"]
    assert report["missing"] == {} and report["degraded"] is False
    # the weights' format and the KV cache's element type, as vLLM resolved them
    assert (report["quantization"], report["kv_cache_dtype"]) == ("none", "auto")
    text = run_cli("worker", "--check", timeout=300).stdout.decode()
    assert "early_stop         v1" in text and "status             ok" in text
    # and what the settings turn off is reported off, not missing
    off = run_cli("worker", "--check", "--json", VQUEUE_VLLM_PATCHES="false",
                  VQUEUE_EARLY_STOP_PATH="logprobs", timeout=300)  # fmt: skip
    report = json.loads(off.stdout.decode().strip().splitlines()[-1])
    assert report["monitor"] == "logprobs" and not report["guided_batching"]
    assert report["missing"] == {}
    # an FP8 KV cache is reported where vLLM's CPU build keeps one (AVX-512 or AMX), and
    # refused before any engine starts where it would fail at start
    fp8 = run_cli("worker", "--check", "--json", VQUEUE_KV_CACHE_DTYPE="fp8", timeout=300)
    flags = Path("/proc/cpuinfo").read_text()
    if " avx512f" in flags or " amx_tile" in flags:
        assert json.loads(fp8.stdout.decode().splitlines()[-1])["kv_cache_dtype"] == "fp8"
    else:
        assert fp8.returncode == RET_CONFIG and b"AVX-512 or AMX" in fp8.stderr, fp8.stderr


@pytest.mark.parametrize("gpus", ["x", "0,,a", ","])
def test_worker_refuses_bad_gpu_ids(gpus: str) -> None:
    proc = run_cli("worker", "--gpus", gpus, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.decode().startswith("vqueue: --gpus takes GPU ids like 0 or 0,1")


def test_every_setting_is_documented() -> None:
    # docs/configuration.md is the one table of settings: it must not fall behind the code
    from schemas import Settings

    doc = (ROOT / "docs" / "configuration.md").read_text()

    def listed(name: str) -> bool:
        if f"`{name}`" in doc:
            return True
        # per-type rows read `max_tokens_summarize` / `_extract` / `_codegen` / `_chat`
        head, _, kind = name.rpartition("_")
        return f"`{head}_summarize`" in doc and (f"`_{kind}`" in doc or f"`{head}_{kind}`" in doc)

    missing = [name for name in Settings.model_fields if not listed(name)]
    assert not missing, f"settings missing from docs/configuration.md: {missing}"
