"""The speed and safety options (docs/configuration.md), each with the real worker and model."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from producer import Client
from producer.client import Refused
from schemas import JobResult

from .conftest import ROOT, WorkerProc, make_settings, run_cli, wait_for

pytestmark = pytest.mark.engine

DOC = (
    "The city council met on Tuesday to discuss the new bus routes. Residents asked for later "
    "evening service, and the transport office promised a trial in the spring. "
) * 20  # about 600 tokens


def _run(client: Client, *jobs: dict[str, Any]) -> dict[str, JobResult]:
    batch = client.submit_many(list(jobs))
    return {r.id: r for r in batch.results(timeout=300)}


def test_system_prompt_per_job_per_batch_or_none(client: Client, tmp_path: Path) -> None:
    # Given the same job with the default system prompt, none, and a verbose one
    base = {"type": "summarize", "text": "Bees make honey.", "max_tokens": 8}
    verbose = "You are a meticulous, experienced assistant. " * 8
    got = _run(
        client,
        {**base, "id": "default"},
        {**base, "id": "none", "system": ""},
        {**base, "id": "verbose", "system": verbose},
    )
    n = {k: r.usage.prompt_tokens for k, r in got.items()}
    # Then no system turn is the shortest prompt and the verbose one the longest
    assert all(r.status == "completed" for r in got.values())
    assert n["none"] < n["default"] < n["verbose"]
    # and `vqueue submit --system` applies to the lines that set none
    src = tmp_path / "jobs.jsonl"
    src.write_text(
        '{"id": "a", "type": "summarize", "text": "Bees make honey.", "max_tokens": 8}\n'
    )
    proc = run_cli("submit", str(src), "--wait", "--json", "-q", "--system", "")
    summary = json.loads(proc.stdout.decode().strip().splitlines()[-1])
    res = client.batch(summary["batch"]).result("a", timeout=60)
    assert res.usage.prompt_tokens == n["none"]


def test_input_hygiene_strips_and_counts(client: Client) -> None:
    # Given a text with zero-width characters, a BOM, control characters and pasted spacing
    dirty = "\ufeffBees\u200b make\u00a0\u00a0honey.\x07\x1b  They   live\u200d in hives.\r\n"
    clean = "Bees make honey. They live in hives.\n"
    got = _run(client, {"id": "h", "type": "summarize", "text": dirty, "max_tokens": 8})["h"]
    ref = _run(client, {"id": "c", "type": "summarize", "text": clean, "max_tokens": 8})["c"]
    # Then the job runs on the clean text, and says how much was removed
    assert got.status == "completed" and got.input_chars_cleaned == len(dirty) - len(clean)
    assert got.usage.prompt_tokens == ref.usage.prompt_tokens and ref.input_chars_cleaned == 0
    # while code keeps its indentation and blank lines
    code = "def f(x):\n\n\n    return  x\u200b\n"
    c = _run(
        client,
        {"id": "k", "type": "codegen", "instruction": "Add a docstring.", "context": code,
         "max_tokens": 8},
    )["k"]  # fmt: skip
    assert c.input_chars_cleaned == 1


def test_context_limits_and_truncation_policies(client: Client) -> None:
    # Given one ~600-token document under each policy with a 100-token input limit
    job = {"type": "summarize", "text": DOC, "max_tokens": 8, "max_input_tokens": 100}
    got = _run(
        client,
        {**job, "id": "head", "truncation": "head"},
        {**job, "id": "tail", "truncation": "tail"},
        {**job, "id": "both", "truncation": "head_tail"},
        {**job, "id": "reject", "truncation": "reject"},
        {"type": "summarize", "id": "whole", "text": DOC, "max_tokens": 8},
    )
    # Then the cut ones run on at most 100 document tokens and say how many were cut
    whole = got["whole"]
    assert whole.status == "completed" and whole.input_tokens_truncated == 0
    for k in ("head", "tail", "both"):
        r = got[k]
        assert r.status == "completed", r.error
        assert r.input_tokens_truncated > 400
        assert r.usage.prompt_tokens <= whole.usage.prompt_tokens - r.input_tokens_truncated + 8
    # and reject fails the job by name
    assert got["reject"].error and got["reject"].error.type == "input_too_long"
    assert "limit is 100" in got["reject"].error.message
    # a document longer than the context is cut to fit by the type's default (head_tail)
    huge = _run(client, {"id": "huge", "type": "summarize", "text": DOC * 6, "max_tokens": 8})
    assert huge["huge"].status == "completed" and huge["huge"].input_tokens_truncated > 1000
    assert huge["huge"].usage.prompt_tokens + 8 <= 2048
    # a chat over its limit is refused, never cut
    chat = {"type": "chat", "id": "chat", "messages": [{"role": "user", "content": DOC}]}
    r = _run(client, {**chat, "max_input_tokens": 50, "max_tokens": 8})["chat"]
    assert r.error and r.error.type == "input_too_long"


def test_rate_limit_per_tenant(worker: WorkerProc, redis_client: redis.Redis) -> None:
    # Given a tenant limited to 20 jobs/s with a burst of 5
    s = make_settings(worker.queue, tenant="team-a", rate_limits={"team-a": 20.0},
                      rate_limit_burst=5)  # fmt: skip
    waits: list[str] = []
    client = Client(s, on_wait=waits.append)
    jobs = [{"type": "summarize", "text": f"Item {i}.", "max_tokens": 4} for i in range(25)]
    # When it submits 25 jobs
    t0 = time.monotonic()
    batch = client.submit_many(jobs)
    elapsed = time.monotonic() - t0
    # Then submission was held to the rate (20 jobs past the burst at 20/s), said why, and
    # every job ran
    assert elapsed >= 0.9 and waits and "team-a" in waits[0]
    assert batch.wait(timeout=300).completed == 25
    # and with on_limit=refuse the next submission is refused at once
    refusing = Client(s.model_copy(update={"on_limit": "refuse"}))
    with pytest.raises(Refused, match="team-a"):
        refusing.submit_many(jobs)
    # other tenants are not held back
    other = Client(s.model_copy(update={"tenant": "team-b", "on_limit": "refuse"}))
    other.submit_many(jobs[:10]).wait(timeout=300)


def test_max_queue_depth_refuses_or_waits(redis_client: redis.Redis, tmp_path: Path) -> None:
    # Given a queue nobody consumes, limited to 10 waiting jobs
    q = "vqtest-nobody"
    src = tmp_path / "jobs.jsonl"
    src.write_text("".join(f'{{"type": "summarize", "text": "x{i}"}}\n' for i in range(30)))
    env_limit = {"VQUEUE_MAX_QUEUE_DEPTH": "10", "VQUEUE_ON_LIMIT": "refuse"}
    # When a file of 30 jobs is submitted with on_limit=refuse
    proc = _cli_env(env_limit, "--queue", q, "submit", str(src))
    # Then the CLI refuses with exit code 7, saying why
    assert proc.returncode == 7, proc.stderr
    assert "VQUEUE_MAX_QUEUE_DEPTH=10" in proc.stderr.decode()
    assert Client(make_settings(q)).queue_depth() <= 10
    # and with on_limit=wait it waits, saying so, until the queue drains
    proc = subprocess.Popen(
        [sys.executable, "-m", "producer.cli", "--queue", q, "submit", str(src), "-q"],
        cwd=ROOT, env=_env({"VQUEUE_MAX_QUEUE_DEPTH": "10"}), stderr=subprocess.PIPE,
    )  # fmt: skip
    time.sleep(3)
    assert proc.poll() is None  # still waiting for room
    keys = [f"{q}:{i}" if i else q for i in range(10)]

    def drained() -> bool:  # a stand-in consumer empties the queue until submit is done
        redis_client.delete(*keys)
        return proc.poll() is not None

    wait_for(drained, 60, "submit to finish as the queue drains", interval=0.5)
    assert proc.returncode == 0 and b"waiting: queue" in proc.stderr.read()


def _env(extra: dict[str, str]) -> dict[str, str]:
    from .conftest import worker_env

    return worker_env("vqtest-main", **extra)


def _cli_env(extra: dict[str, str], *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "producer.cli", *args], cwd=ROOT, env=_env(extra),
        capture_output=True, timeout=120,
    )  # fmt: skip


def test_invalid_engine_settings_fail_at_start(redis_client: redis.Redis) -> None:
    # A value no setting takes: the CLI names the env var, exit 2, before anything starts
    proc = _cli_env({"VQUEUE_DTYPE": "float8"}, "worker")
    assert proc.returncode == 2 and b"VQUEUE_DTYPE" in proc.stderr
    assert b"Traceback" not in proc.stderr
    # A combination this host cannot run: the worker exits 3 with the reason, before loading
    w = WorkerProc("badcfg", "vqtest-badcfg", VQUEUE_QUANTIZATION="awq",
                   VQUEUE_TENSOR_PARALLEL_SIZE="2")  # fmt: skip
    assert w.proc.wait(120) == 3
    log = w.log_path.read_text()
    w.log.close()
    assert "VQUEUE_QUANTIZATION=awq needs a CUDA GPU" in log
    assert "VQUEUE_TENSOR_PARALLEL_SIZE > 1 needs GPUs" in log


def test_gguf_model_file_loads(redis_client: redis.Redis) -> None:
    # Given the embedded model's own GGUF file as VQUEUE_MODEL
    from worker.models import embedded_gguf

    gguf = embedded_gguf()
    w = WorkerProc("gguf", "vqtest-gguf", VQUEUE_MODEL=str(gguf))
    try:
        w.wait_ready(redis_client)
        client = Client(make_settings("vqtest-gguf"))
        # When a job runs on it
        res = _run(client, {"id": "g", "type": "summarize", "text": "Bees make honey.",
                            "max_tokens": 8})["g"]  # fmt: skip
    finally:
        w.stop()
    # Then it is served from the converted file, under the file's path as the model name
    assert res.status == "completed" and res.text
    assert res.model == str(gguf)


def test_output_budgets_and_stop_sequences(client: Client) -> None:
    # Given a summary with no max_tokens that would never stop by itself, and one with a stop
    endless = {"id": "budget", "type": "summarize", "text": "Bees make honey.", "ignore_eos": True}
    stopped = {"id": "stop", "type": "summarize", "text": DOC, "max_tokens": 64, "stop": [" the"]}
    got = _run(client, endless, stopped)
    # Then the first ends at the per-type budget (VQUEUE_MAX_TOKENS_SUMMARIZE, 256) ...
    assert got["budget"].usage.completion_tokens == 256
    assert got["budget"].finish_reason == "length"
    # ... and the second at its stop sequence, which is not in the text
    s = got["stop"]
    assert s.finish_reason == "stop" and " the" not in (s.text or "")
    assert s.usage.completion_tokens < 64
