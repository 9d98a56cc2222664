"""Project-level checks that need no engine: the compose file, the schema export, the CLI."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from .conftest import ROOT


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose not installed")
def test_compose_file_is_valid_and_refuses_to_run_without_passwords() -> None:
    import os

    import yaml

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
    for name, gpu in (("worker-gpu0", "0"), ("worker-gpu1", "1")):
        (device,) = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["device_ids"] == [gpu] and device["capabilities"] == ["gpu"]
        assert services[name]["environment"]["VQUEUE_BROKER_URL"].startswith("redis://:r-secret@")
    assert "--basic-auth=admin:f-secret" in services["flower"]["command"]


def test_schema_command_prints_the_job_schema() -> None:
    proc = subprocess.run([sys.executable, "-m", "producer.cli", "schema"], capture_output=True)
    schema = json.loads(proc.stdout)
    assert {"summarize", "extract", "codegen", "chat"} <= set(schema["discriminator"]["mapping"])


def test_producer_imports_no_engine() -> None:
    code = (
        "import producer, sys; from producer import cli; "
        "print(sorted(m for m in ('vllm', 'torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, cwd=ROOT)
    assert out.stdout.decode().strip() == "[]", out.stderr.decode()


@pytest.mark.parametrize("gpus", ["x", "0,,a", ","])
def test_worker_refuses_bad_gpu_ids(gpus: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "producer.cli", "worker", "--gpus", gpus],
        capture_output=True,
        cwd=ROOT,
        timeout=60,
    )
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
