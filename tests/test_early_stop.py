"""Logprob early stop with the real worker, engine and model (docs/early-stop.md)."""

from __future__ import annotations

import json
import re
import urllib.request
from typing import Any

import pytest
import redis

from producer import Client
from schemas import JobResult

from .conftest import RUN, Procs, WorkerProc, make_settings, wait_for

pytestmark = pytest.mark.engine

# Nonsense at a high temperature: the model's top-1 logprob sinks under -3 within tens of tokens.
NONSENSE = "zq vlorp 93 ;; ~~ ekk bramf ### 0x1f quux ]]{{ plint zorbl fnarg"
NORMAL = [
    "The city council voted on Tuesday to approve a new budget that increases funding for "
    "public parks by 12 percent and cuts spending on road repairs.",
    "Researchers found that mice given a high-fat diet developed memory problems within "
    "weeks, but the effect reversed when the diet changed.",
    "The quarterly report shows revenue of $4.2 million, up 8% year over year, driven by "
    "strong sales in Europe. Operating costs rose 3%.",
]


def _run(client: Client, jobs: list[dict[str, Any]]) -> dict[str, JobResult]:
    batch = client.submit_many(jobs)
    return {r.id: r for r in batch.results(timeout=600)}


def _scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^((?:vqueue|vllm)[^ ]*) ([0-9.e+-]+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def _bad(i: int, **extra: Any) -> dict[str, Any]:
    return {
        "id": f"bad-{i}",
        "type": "summarize",
        "text": NONSENSE,
        "temperature": 2.0,
        "seed": i,
        "max_tokens": 160,
        **extra,
    }


def test_low_confidence_is_aborted_retried_and_recorded(worker: WorkerProc, client: Client) -> None:
    # Given nonsense jobs at temperature 2 beside normal greedy jobs, in one batch
    before = _scrape(worker.metrics_port)
    policy = {"threshold": -3.0, "window": 2, "grace_tokens": 4, "max_retries": 2}
    jobs = [_bad(i, early_stop=policy) for i in range(3)]
    jobs += [
        {"id": f"ok-{i}", "type": "summarize", "text": t, "max_tokens": 96}
        for i, t in enumerate(NORMAL)
    ]
    got = _run(client, jobs)
    # Then every nonsense job's first attempt was aborted early, with its numbers recorded
    for i in range(3):
        r = got[f"bad-{i}"]
        assert r.status == "completed", r.error
        first = r.attempts[0]
        assert first.reason == "low_confidence" and first.low_confidence
        assert 4 + 2 <= first.tokens < 160  # past the grace period, long before max_tokens
        assert first.min_logprob is not None and first.min_logprob < -3.0
        assert first.mean_logprob is not None and first.min_logprob <= first.mean_logprob < 0
        assert first.temperature == 2.0 and first.seed == i
        # and it was retried with a lower temperature and a new seed, up to a last, greedy,
        # attempt that is never aborted and is flagged if it was low too
        assert 2 <= len(r.attempts) <= 3
        assert r.attempts[1].temperature == 1.0 and r.attempts[1].seed == i + 1
        last = r.attempts[-1]
        assert last.reason != "low_confidence" and r.low_confidence == last.low_confidence
        if len(r.attempts) == 3:
            assert last.temperature == 0.0
        assert r.usage.completion_tokens == last.tokens
        aborted = [a for a in r.attempts if a.reason == "low_confidence"]
        assert r.usage.wasted_tokens == sum(a.tokens for a in aborted)
        # and its timings show when the attempt before the returned one ended
        t = r.timings
        assert t.started_at and t.previous_finished_at and t.sent_at
        assert t.started_at < t.previous_finished_at <= t.sent_at, t
    # while the normal greedy jobs ran once, unaborted, under the summarize default policy
    for i in range(len(NORMAL)):
        r = got[f"ok-{i}"]
        assert r.status == "completed" and r.text
        assert len(r.attempts) == 1 and r.attempts[0].reason in ("stop", "length")
        assert not r.low_confidence and r.attempts[0].tokens == r.usage.completion_tokens
    # and the metrics count the aborts, retries and wasted tokens exactly (a worker counts a
    # result just after storing it, so a reader can see the result a moment before the count)
    bad = [got[f"bad-{i}"] for i in range(3)]
    want = {
        "vqueue_early_stop_aborts_total": sum(
            a.reason == "low_confidence" for r in bad for a in r.attempts
        ),
        "vqueue_early_stop_retries_total": sum(len(r.attempts) - 1 for r in bad),
        "vqueue_early_stop_wasted_tokens_total": sum(r.usage.wasted_tokens for r in bad),
        "vqueue_low_confidence_total": sum(r.low_confidence for r in bad),
    }

    def deltas() -> dict[str, float]:
        after = _scrape(worker.metrics_port)
        keys = {name: f'{name}{{type="summarize"}}' for name in want}
        return {n: after.get(k, 0.0) - before.get(k, 0.0) for n, k in keys.items()}

    try:
        wait_for(lambda: deltas() == want, 15, "the metrics to count the batch")
    except AssertionError:
        pass  # the comparison below says what differs
    assert deltas() == want


def test_normal_greedy_jobs_are_never_aborted(client: Client) -> None:
    # Given ordinary summaries, extractions and code at temperature 0, early stop on for all
    jobs: list[dict[str, Any]] = [
        {"id": f"s{i}", "type": "summarize", "text": t, "max_tokens": 96}
        for i, t in enumerate(NORMAL)
    ]
    jobs += [
        {"id": "c1", "type": "codegen", "max_tokens": 128,
         "instruction": "Write a Python function that returns the n-th Fibonacci number."},
        {"id": "c2", "type": "codegen", "max_tokens": 128,
         "instruction": "Write a Python function that sums the second column of a CSV file."},
        {"id": "e1", "type": "extract", "text": "Bob Smith is 42 and lives in Leeds.",
         "early_stop": True,
         "json_schema": {"type": "object", "required": ["name", "age"],
                         "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}},
    ]  # fmt: skip
    got = _run(client, jobs)
    # Then none was aborted: one attempt each, and its output is the result
    for r in got.values():
        assert r.status == "completed", r.error
        assert [a.reason for a in r.attempts] in (["stop"], ["length"]), r.attempts
        assert r.usage.wasted_tokens == 0
    assert got["e1"].data == {"name": "Bob Smith", "age": 42}


def test_early_stop_false_is_honoured_and_the_engine_is_left_clean(
    worker: WorkerProc, client: Client
) -> None:
    # Given the nonsense job that gets aborted, with early stop off
    before = _scrape(worker.metrics_port)
    off = _run(client, [_bad(0, id="off", early_stop=False)])["off"]
    # Then it ran once, unwatched, and nothing counted an abort
    assert off.status == "completed" and off.attempts == [] and off.usage.wasted_tokens == 0
    after = _scrape(worker.metrics_port)
    key = 'vqueue_early_stop_aborts_total{type="summarize"}'
    assert after.get(key, 0.0) == before.get(key, 0.0)
    # and after the aborts of the tests before, the engine holds no request: the next jobs run
    # normally and, once they are done, vLLM reports nothing running or waiting
    got = _run(
        client, [{"id": f"n{i}", "type": "summarize", "text": t} for i, t in enumerate(NORMAL)]
    )
    assert all(r.status == "completed" and r.attempts[0].reason != "low_confidence"
               for r in got.values())  # fmt: skip

    def idle() -> bool:
        m = _scrape(worker.metrics_port)
        return m["vqueue_engine_running_requests"] == 0 and m["vqueue_engine_waiting_requests"] == 0

    wait_for(idle, 30, "the engine to report no running or waiting request")


def test_without_the_monitor_early_stop_reads_vllms_logprobs(
    module_procs: Procs, redis_client: redis.Redis
) -> None:
    # Given a worker whose engine has no monitor and none of vqueue's patches to vLLM: early stop
    # on vLLM's own logprobs (what a vLLM release the monitor was not verified on gets)
    q = f"vqtest-{RUN}-fallback"
    w = module_procs.worker("fb", q, VQUEUE_EARLY_STOP_PATH="logprobs", VQUEUE_VLLM_PATCHES="false")
    w.wait_ready(redis_client)
    plan = json.loads(redis_client.get(w.heartbeat_key()) or "{}")["engine"]
    assert plan["monitor"] == "logprobs" and not plan["guided_batching"]
    assert not plan["grammar_reuse"] and not plan["mask_reorder"]
    client = Client(make_settings(q))
    # When nonsense at temperature 2 and normal greedy jobs run
    jobs = [_bad(i) for i in range(3)]
    jobs += [{"id": f"ok{i}", "type": "summarize", "text": t, "max_tokens": 64}
             for i, t in enumerate(NORMAL)]  # fmt: skip
    got = _run(client, jobs)
    # Then the nonsense was aborted and retried, each attempt recorded with its numbers, and
    # the normal jobs ran once, unaborted, as with the monitor
    bad = [got[f"bad-{i}"] for i in range(3)]
    assert any(r.attempts and r.attempts[0].reason == "low_confidence" for r in bad), bad
    for r in bad:
        assert r.status == "completed" and r.attempts and r.attempts[-1].reason != "low_confidence"
        for a in r.attempts:
            assert a.min_logprob is not None and a.mean_logprob is not None
        assert r.usage.wasted_tokens == sum(
            a.tokens for a in r.attempts if a.reason == "low_confidence"
        )
    for i in range(len(NORMAL)):
        assert [a.reason for a in got[f"ok{i}"].attempts] in (["stop"], ["length"])
    # and the engine ran vLLM's own paths: nothing of vqueue's was installed in it
    log = w.log_path.read_text()
    assert "matchers and masks run batched" not in log and "share compiled grammars" not in log
