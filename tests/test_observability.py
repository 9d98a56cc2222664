"""What operators see: Flower's API and pages, the worker's Prometheus metrics, `vqueue status`.

All against the real worker (real engine), a real Flower process and Debian's Chromium; and
the worker's own histogram arithmetic against prometheus_client's.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from base64 import b64encode
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from producer import Client

from .conftest import (
    ARTIFACTS,
    MAIN_QUEUE,
    WORKDIR,
    Procs,
    WorkerProc,
    free_port,
    make_settings,
    require,
    run_cli,
    wait_for,
    worker_env,
)

pytestmark = pytest.mark.engine

FLOWER_AUTH = ("admin", "s3cret")


def _get(url: str, auth: tuple[str, str] | None = None, timeout: float = 10) -> bytes:
    req = urllib.request.Request(url)
    if auth:
        req.add_header("Authorization", "Basic " + b64encode(":".join(auth).encode()).decode())
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return bytes(resp.read())


def _get_json(url: str, auth: tuple[str, str] | None = None) -> Any:
    try:
        return json.loads(_get(url, auth))
    except OSError:
        return None


@pytest.fixture(scope="module")
def flower(worker: WorkerProc, module_procs: Procs) -> str:
    """Flower on the test broker, with basic auth as in docker-compose.yml."""
    port = free_port()
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    log = open(ARTIFACTS / "flower.log", "w")  # noqa: SIM115
    module_procs.popen(
        [sys.executable, "-m", "celery", "-A", "worker.app", "flower", f"--port={port}",
         "--address=127.0.0.1", f"--basic-auth={':'.join(FLOWER_AUTH)}"],
        env=worker_env(worker.queue), stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    # /api/workers asks the workers over the broker: an answer means Flower is wired up
    wait_for(
        lambda: worker.node in (_get_json(f"{url}/api/workers", FLOWER_AUTH) or {}),
        60,
        "Flower to see the worker",
        interval=1,
    )
    # The worker starts without task events (VQUEUE_TASK_EVENTS off); Flower turns them on
    # (enable_events every 5 s). Until a one-token probe job shows in Flower, they are not on.
    probe = Client(make_settings(worker.queue))
    tries = iter(range(1000))

    def probe_listed() -> bool:
        batch = probe.submit_many([{"id": f"probe{next(tries)}", "type": "summarize",
                                    "text": "Hi.", "max_tokens": 1}])  # fmt: skip
        batch.wait(timeout=120)
        tasks = _get_json(f"{url}/api/tasks?limit=1000", FLOWER_AUTH) or {}
        return any(k.startswith(batch.id + ":") for k in tasks)

    wait_for(probe_listed, 90, "Flower to turn the worker's task events on", interval=2)
    return url


def _flower_batch(client: Client) -> tuple[str, list[str]]:
    ids = ["fl-sum", "fl-ext", "fl-code"]
    jobs = [
        {"id": ids[0], "type": "summarize", "text": "Rain fell all week.", "max_tokens": 12},
        {
            "id": ids[1],
            "type": "extract",
            "text": "Ann is 31.",
            "max_tokens": 24,
            "json_schema": {"type": "object", "properties": {"age": {"type": "integer"}}},
        },
        {"id": ids[2], "type": "codegen", "instruction": "Add two numbers.", "max_tokens": 24},
    ]
    batch = client.submit_many(jobs)
    batch.wait(timeout=300)
    return batch.id, ids


def test_flower_api_lists_jobs_readably(flower: str, worker: WorkerProc, client: Client) -> None:
    # Given Flower watching the broker, and a batch that has run
    batch, ids = _flower_batch(client)
    task_ids = {f"{batch}:{i}" for i in ids}

    # When Flower's REST API is asked for tasks
    def seen() -> dict[str, Any] | None:
        tasks = _get_json(f"{flower}/api/tasks?limit=1000", FLOWER_AUTH) or {}
        mine = {k: v for k, v in tasks.items() if k in task_ids}
        done = len(mine) == 3 and all(t["state"] == "SUCCESS" for t in mine.values())
        return mine if done else None

    tasks = wait_for(seen, 60, "Flower to list the batch's tasks")

    # Then each shows its per-type name, a one-line args summary, and a short result
    for job_id, type_ in zip(ids, ["summarize", "extract", "codegen"], strict=True):
        t = tasks[f"{batch}:{job_id}"]
        assert t["name"] == f"vqueue.{type_}"
        assert t["args"].startswith(f"{type_} id={job_id} batch={batch} prefix=")
        assert len(t["args"]) < 120 and "Rain fell" not in t["args"]
        assert "'status': 'completed'" in t["result"] and len(t["result"]) < 120
        assert t["worker"] == worker.node
    workers = _get_json(f"{flower}/api/workers?refresh=1", FLOWER_AUTH)
    assert worker.node in workers
    # the API refuses anyone without the password
    with pytest.raises(urllib.error.HTTPError) as denied:
        _get(f"{flower}/api/tasks")
    assert denied.value.code == 401


def test_a_failed_job_is_a_failure_in_flower(flower: str, client: Client) -> None:
    # Given a job that fails at the worker (its text too long, to be refused),
    # alone in its message, and the same beside a job that completes, in one pack
    fail = {"type": "summarize", "text": "word " * 4000, "truncation": "reject"}
    alone = client.submit_many([{**fail, "id": "fl-fail"}])
    packed = client.submit_many(
        [{**fail, "id": "fl-fail"}, {"id": "fl-ok", "type": "summarize", "text": "Hi."}]
    )
    assert alone.wait(timeout=300).failed == 1 and packed.wait(timeout=300).failed == 1
    (result,) = alone.results(timeout=60)
    why = result.error.type if result.error else "?"  # past the input limit, or the context

    # When Flower is asked for the failed tasks
    def failed() -> dict[str, Any] | None:
        tasks = _get_json(f"{flower}/api/tasks?state=FAILURE&limit=1000", FLOWER_AUTH) or {}
        ids = (f"{alone.id}:fl-fail", f"{packed.id}:fl-fail+1")
        return tasks if all(i in tasks for i in ids) else None

    tasks = wait_for(failed, 60, "Flower to list the failed jobs as FAILURE")

    # Then both messages are there, each naming its failed job and why; the pack names the
    # jobs it carried in its args
    one = tasks[f"{alone.id}:fl-fail"]
    assert f"'1 job(s) failed: fl-fail ({why})'" in one["exception"], one
    pack = tasks[f"{packed.id}:fl-fail+1"]
    assert f"1 of 2 job(s) failed: fl-fail ({why})" in pack["exception"], pack
    assert "ids=fl-fail,fl-ok" in pack["args"]


def test_flower_tasks_page_in_chromium(flower: str, client: Client) -> None:
    # Given Debian's Chromium (CI installs it; missing, this fails in CI) and a finished batch
    require("chromium")
    batch, ids = _flower_batch(client)
    url = flower.replace("http://", f"http://{':'.join(FLOWER_AUTH)}@") + "/tasks"
    shot = ARTIFACTS / "flower-tasks.png"
    chrome = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
              "--virtual-time-budget=10000", "--window-size=1600,900"]  # fmt: skip

    # When headless Chromium loads Flower's tasks page (its table is filled by XHR)
    def page() -> str | None:
        dom = subprocess.run([*chrome, "--dump-dom", url], capture_output=True, timeout=120)
        text = dom.stdout.decode(errors="replace")
        return text if all(f"{batch}:{i}" in text for i in ids) else None

    dom = wait_for(page, 60, "the job ids on Flower's tasks page", interval=2)
    subprocess.run([*chrome, f"--screenshot={shot}", url], capture_output=True, timeout=120)

    # Then the page names the jobs by type and id, and the screenshot is kept
    assert "vqueue.extract" in dom and "vqueue.codegen" in dom
    assert shot.stat().st_size > 10_000 and shot.read_bytes()[:4] == b"\x89PNG"


def _on_a_terminal(*args: str, seen: list[bytes] | None = None) -> bytes:
    """stdout of a CLI run on a pseudo-terminal (click drops escape codes on a pipe); ``seen``
    gets the output as it comes, for a caller watching from another thread."""
    import os
    import pty

    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "producer.cli", *args],
        cwd=WORKDIR, env=worker_env(MAIN_QUEUE), stdout=follower, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    os.close(follower)
    out = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # EIO: the terminal's other end is closed
            break
        if not chunk:
            break
        out += chunk
        if seen is not None:
            seen.append(chunk)
    os.close(leader)
    assert proc.wait(300) == 0
    return out


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = _get(f"http://127.0.0.1:{port}/metrics").decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _delta(before: dict, after: dict, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_metrics_count_a_batch(worker: WorkerProc, client: Client) -> None:
    # Given the worker's metrics before a batch of 3 summaries and 1 job too long for the context
    before = _scrape(worker.metrics_port)
    # (the three share a system prompt longer than the engine's KV blocks, so the prefix cache
    # has whole blocks of it to serve)
    system = "You summarize shipping notes for a logistics team in one short line. " * 30
    jobs: list[dict[str, Any]] = [
        {"id": f"m{i}", "type": "summarize", "text": f"Item {i} was shipped late.", "max_tokens": 8,
         "system": system}
        for i in range(3)
    ]  # fmt: skip
    jobs.append(
        {"id": "m-long", "type": "summarize", "text": "word " * 3000, "max_tokens": 8,
         "truncation": "reject"}
    )  # fmt: skip

    # When the batch runs
    batch = client.submit_many(jobs)
    results = {r.id: r for r in batch.results(timeout=300)}
    tokens = sum(r.usage.completion_tokens for r in results.values())

    # Then the counters moved by exactly this batch, once they caught up with it (a worker
    # counts a result just after storing it; vLLM's own counters follow its next step)
    def settled() -> dict[Any, float] | None:
        now = _scrape(worker.metrics_port)
        done = _delta(before, now, "vqueue_jobs_completed_total", type="summarize") == 3
        engine = _delta(before, now, "vqueue_engine_generation_tokens_total") == tokens
        return now if done and engine else None

    after = wait_for(settled, 15, "the metrics to count the batch")
    assert results["m-long"].error and results["m-long"].error.type == "prompt_too_long"
    d = lambda name, **kw: _delta(before, after, name, **kw)  # noqa: E731
    assert d("vqueue_jobs_completed_total", type="summarize") == 3
    assert d("vqueue_jobs_failed_total", type="summarize", error="prompt_too_long") == 1
    assert d("vqueue_queue_wait_seconds_count", type="summarize") == 4
    assert d("vqueue_time_to_first_token_seconds_count", type="summarize") == 3
    assert d("vqueue_generation_tokens_total", type="summarize") == tokens > 0
    prompt = sum(r.usage.prompt_tokens for r in results.values())
    assert d("vqueue_prompt_tokens_total", type="summarize") == prompt
    # the engine's own view: every generated token, every prompt token looked up in the cache
    assert d("vqueue_engine_generation_tokens_total") == tokens
    assert d("vqueue_prefix_cache_queries_tokens_total") == prompt
    # the three summaries share their system prompt: the cache served some of it, and what the
    # engine counts as hits is what the results say came from the cache
    cached = sum(r.usage.cached_tokens for r in results.values())
    assert cached > 0 and d("vqueue_prefix_cache_hits_tokens_total") == cached
    for gauge in ("vqueue_engine_running_requests", "vqueue_engine_kv_cache_usage_ratio"):
        assert (gauge, ()) in after
    # vLLM's own metrics are served on the same port
    assert any(name.startswith("vllm:") for name, _ in after)


@pytest.mark.unit
def test_a_packs_observations_land_where_prometheus_own_observe_puts_them() -> None:
    # Given two histograms with the worker's run buckets in registries of their own
    from prometheus_client import CollectorRegistry, Histogram

    from worker.metrics import _RUN_BUCKETS, _observe_all

    one, packed = CollectorRegistry(), CollectorRegistry()
    h1 = Histogram("h", "h", buckets=_RUN_BUCKETS, registry=one)
    h2 = Histogram("h", "h", buckets=_RUN_BUCKETS, registry=packed)
    values = [0.0, 0.05, 0.0500001, 0.3, 7, 7, 320, 321, 1e9, 2.5]
    # When one observes each value through prometheus_client and the other takes them at once
    for v in values:
        h1.observe(v)
    _observe_all(h2, values)
    # Then every bucket, the count and the sum read the same
    samples = [
        {(s.name, tuple(s.labels.items())): s.value for f in r.collect() for s in f.samples}
        for r in (one, packed)
    ]
    assert samples[0] == samples[1]
    assert samples[1][("h_bucket", (("le", "0.05"),))] == 2


def test_status_shows_workers_queues_and_batches(worker: WorkerProc, client: Client) -> None:
    # Given a finished batch
    b = client.submit({"type": "summarize", "text": "Short.", "max_tokens": 8})
    b.wait(timeout=120)

    # When status is asked for the fleet and for the batch
    fleet = json.loads(run_cli("status", "--json").stdout)
    st = json.loads(run_cli("status", b.id, "--json").stdout)
    text = run_cli("status").stdout.decode()

    # Then the worker shows host, model, load and engine figures; the queue its depth
    (w,) = [w for w in fleet["workers"] if w["name"] == worker.node]
    assert w["model"] == "smollm2-135m-instruct" and w["concurrency"] == 16
    assert w["metrics_url"].endswith("/metrics") and w["host"]
    assert {"tokens_per_s", "engine_running", "engine_waiting", "kv_cache_usage"} <= w.keys()
    own = f"{MAIN_QUEUE}@{worker.node}"
    assert fleet["queues"][MAIN_QUEUE] == 0 and fleet["queues"][own] == 0
    assert worker.node in text and "tok/s=" in text and f"queue {MAIN_QUEUE}: 0 waiting" in text
    # and which of vqueue's engine optimizations run there (the same as `worker --check`)
    assert w["engine"]["monitor"] == "v1" and w["engine"]["missing"] == {}
    assert "engine: vLLM 0.32" in text and "early stop v1" in text
    # and the batch its counts, rate and ETA
    assert (st["total"], st["completed"], st["remaining"]) == (1, 1, 0)
    assert st["rate_per_s"] > 0 and st["eta_s"] == 0
    missing = run_cli("status", "no-such-batch")
    assert missing.returncode == 5 and "no batch" in missing.stderr.decode()


def test_status_watch_follows_a_running_batch(client: Client) -> None:
    # Given a batch still open (more jobs to come), with one job in it
    import threading

    job = {"type": "summarize", "text": "Story.", "max_tokens": 16}
    b = client.submit_many([dict(job, id="first")], seal=False)
    # When `status --watch` follows it on a terminal
    seen: list[bytes] = []
    got: list[bytes] = []
    watcher = threading.Thread(
        target=lambda: got.append(_on_a_terminal("status", b.id, "--watch", seen=seen))
    )
    watcher.start()
    wait_for(lambda: b"1/1 done" in b"".join(seen), 120, "the watch to show the first job done")
    # and the rest of the batch arrives and runs
    client.submit_many([dict(job, id=f"more{i}") for i in range(5)], batch=b.id)
    watcher.join(300)
    # Then it redrew in place as the batch grew and ran, and ended with the batch
    (watch,) = got
    frames = watch.split(b"\x1b[H\x1b[2J")
    assert watch.startswith(b"\x1b[H\x1b[2J") and len(frames) > 2, watch[-500:]
    assert b"/1 done" in frames[1] and b"6/6 done" in frames[-1]
