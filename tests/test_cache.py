"""The result cache: a greedy or seeded job whose answer is known for the same tenant, model,
prompt and parameters is answered without the engine; any change to them misses; identical
jobs running at once run once (real worker, real engine, small model; worker/cache.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from producer import Client
from schemas import Envelope, JobResult, Settings
from schemas.jobs import SummarizeJob
from worker.cache import ResultCache, determined

from .conftest import KEY_PREFIX, RUN, Procs, WorkerProc, make_settings, run_cli

Q = f"vqtest-{RUN}-cache"


@pytest.mark.unit
def test_the_key_changes_with_what_decides_the_answer_and_nothing_else() -> None:
    def cache(**settings: Any) -> ResultCache:
        s = Settings(_env_file=None, **settings)  # type: ignore[call-arg]
        return ResultCache(redis.Redis(), "p", s, {"m": "weights-1", "lora": "weights-1:a"})

    c = cache()
    job = SummarizeJob(type="summarize", id="a", text="t", max_tokens=8)
    key = c.key(job, "m", "vqueue", [1, 2, 3], 8)
    # what does not decide the answer: the job's id, metadata, priority, time limit
    same = job.model_copy(update={"id": "b", "metadata": {"x": 1}, "priority": 9, "timeout_s": 5})
    assert c.key(same, "m", "vqueue", [1, 2, 3], 8) == key
    assert cache(concurrency=64).key(job, "m", "vqueue", [1, 2, 3], 8) == key
    # what does
    assert c.key(job, "m", "vqueue", [1, 2, 4], 8) != key  # the prompt's tokens
    assert c.key(job, "m", "vqueue", [1, 2, 3], 9) != key  # the room it got
    assert c.key(job, "lora", "vqueue", [1, 2, 3], 8) != key  # an adapter's weights
    assert c.key(job, "m", "openai", [1, 2, 3], 8) != key  # the form its result takes
    for change in (
        {"temperature": 0.5},
        {"seed": 3},
        {"stop": ["x"]},
        {"top_p": 0.9},
        {"frequency_penalty": 0.1},
        {"max_words": 5},
        {"early_stop": False},
    ):
        assert c.key(job.model_copy(update=change), "m", "vqueue", [1, 2, 3], 8) != key, change
    for setting in ({"dtype": "float16"}, {"loop_retries": 0}, {"seed": 1}):
        assert cache(**setting).key(job, "m", "vqueue", [1, 2, 3], 8) != key, setting
    # and only greedy or seeded jobs are looked up at all
    assert determined(job) and determined(job.model_copy(update={"temperature": 1.0, "seed": 1}))
    assert not determined(job.model_copy(update={"temperature": 1.0}))


@pytest.fixture(scope="module")
def cache_worker(module_procs: Procs, redis_client: redis.Redis) -> WorkerProc:
    w = module_procs.worker("cache", Q, VQUEUE_RESULT_CACHE="true")
    w.wait_ready(redis_client)
    return w


def _job(ident: str, text: str, **extra: Any) -> dict[str, Any]:
    # early stop off: an unseeded job that needed a retry (a random seed) is not stored, and
    # which texts make this small model unsure is not what these tests are about
    return {"id": ident, "type": "summarize", "text": f"{RUN}: {text}", "max_tokens": 12,
            "early_stop": False, **extra}  # fmt: skip


def _one(job: dict[str, Any], tenant: str | None = None) -> JobResult:
    batch = Client(make_settings(Q, **({"tenant": tenant} if tenant else {}))).submit(job)
    return batch.result(job["id"], timeout=300)


@pytest.mark.engine
def test_a_determined_job_is_answered_from_the_cache_the_second_time(
    cache_worker: WorkerProc,
) -> None:
    # Given a greedy job that ran once
    first = _one(_job("a1", "The river rose two metres overnight and the bridge was closed."))
    assert first.status == "completed" and not first.cached, first
    # When the same job comes again, under another id in another batch
    again = _one(_job("a2", "The river rose two metres overnight and the bridge was closed."))
    # Then it is answered from the cache: the first run's answer and usage, and where it ran
    assert again.cached and again.cached_from is not None, again
    assert (again.cached_from.batch, again.cached_from.id) == (first.batch, "a1")
    assert again.text == first.text and again.usage == first.usage
    assert again.id == "a2" and again.timings.first_token_at is None  # no engine this time
    # and `vqueue results --table` marks the cached answer, and says what the mark means
    table = run_cli("results", again.batch, "--table", queue=Q).stdout.decode()
    assert "completed*" in table and "answered from the result cache" in table, table


@pytest.mark.engine
def test_changing_any_part_of_what_decides_the_answer_misses(cache_worker: WorkerProc) -> None:
    text = "Sales grew in the north and fell in the south; costs were flat."
    base = _one(_job("k0", text))
    assert base.status == "completed", base
    assert _one(_job("k0b", text)).cached  # the key holds while nothing changes
    variants = {
        "text": _job("k1", text + " Margins held."),
        "max_tokens": _job("k2", text, max_tokens=13),
        "seeded sampling": _job("k3", text, temperature=0.7, seed=5),
        "system prompt": _job("k4", text, system="Answer in one word."),
        "penalty": _job("k5", text, frequency_penalty=0.5),
        "stop": _job("k6", text, stop=["."]),
        "type": {"id": "k7", "type": "codegen", "language": "python",
                 "instruction": f"{RUN}: {text}", "max_tokens": 12, "early_stop": False},
    }  # fmt: skip
    for what, job in variants.items():
        r = _one(job)
        assert r.status == "completed" and not r.cached, (what, r)
    # and a seeded job is determined too: its second run is a hit
    assert _one(_job("k3b", text, temperature=0.7, seed=5)).cached


@pytest.mark.engine
def test_a_sampled_job_without_a_seed_always_runs(cache_worker: WorkerProc) -> None:
    text = "The committee met twice and agreed on nothing."
    first = _one(_job("s1", text, temperature=0.8))
    second = _one(_job("s2", text, temperature=0.8))
    assert first.status == second.status == "completed"
    assert not first.cached and not second.cached, (first, second)


@pytest.mark.engine
def test_a_failure_that_is_the_answer_is_cached_and_a_time_out_is_not(
    cache_worker: WorkerProc,
) -> None:
    # a JSON answer cut off at 3 tokens, and again at 6, fails the same way every time it runs
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    cut = {"id": "f1", "type": "extract", "text": f"{RUN}: Anna moved to Lyon in May.",
           "json_schema": schema, "max_tokens": 3}  # fmt: skip
    first = _one(cut)
    assert first.status == "failed" and first.error and first.error.type == "schema_incomplete"
    again = _one({**cut, "id": "f2"})
    assert again.cached and again.status == "failed" and again.error == first.error, again
    # a job that ran out of time says nothing of its answer: not kept
    slow = _job("f3", "The road was closed for a week.", max_tokens=400, min_tokens=400,
                ignore_eos=True, timeout_s=0.5)  # fmt: skip
    late = _one(slow)
    assert late.error is not None and late.error.type == "timeout", late
    assert not _one({**slow, "id": "f4"}).cached


@pytest.mark.engine
def test_a_greedy_job_that_was_retried_is_cached_with_its_attempts(
    cache_worker: WorkerProc,
) -> None:
    # a greedy job's early-stop retry samples with a seed drawn from the job itself, so the
    # same job retries the same way on a rerun: its answer is still determined
    text = "The museum will close for repairs until the spring."
    unsure = {"threshold": -1e-6, "window": 1, "grace_tokens": 0, "max_retries": 1}
    first = _one(_job("r1", text, early_stop=unsure))
    assert len(first.attempts) == 2 and first.attempts[1].seed is not None, first.attempts
    again = _one(_job("r2", text, early_stop=unsure))
    assert again.cached and again.attempts == first.attempts and again.text == first.text
    # and run in the engine, the same job retries with the same seed and answers the same
    fresh = _one(_job("r3", text, early_stop=unsure, cache=False))
    assert not fresh.cached and fresh.attempts[1].seed == first.attempts[1].seed, fresh.attempts
    assert fresh.text == first.text


@pytest.mark.engine
def test_tenants_do_not_share_entries(cache_worker: WorkerProc) -> None:
    text = "The new library opens on Monday with longer hours."
    assert not _one(_job("t1", text), tenant="acme").cached
    # the same line from another tenant runs in the engine ...
    other = _one(_job("t2", text), tenant="globex")
    assert other.status == "completed" and not other.cached, other
    # ... and each finds its own entry afterwards
    assert _one(_job("t3", text), tenant="acme").cached_from.id == "t1"  # type: ignore[union-attr]
    assert _one(_job("t4", text), tenant="globex").cached_from.id == "t2"  # type: ignore[union-attr]


@pytest.mark.engine
def test_identical_jobs_in_one_batch_run_once(cache_worker: WorkerProc) -> None:
    # Given five identical lines in one batch, which the worker takes in together
    text = "Three trains were late this morning because of a signal fault near the station."
    jobs = [_job(f"d{i}", text, max_tokens=32) for i in range(5)]
    batch = Client(make_settings(Q)).submit_many(jobs)
    got = {r.id: r for r in batch.results(timeout=300)}
    # Then one ran in the engine and the others got its answer
    ran = [r for r in got.values() if not r.cached]
    assert len(got) == 5 and len(ran) == 1, [(r.id, r.cached, r.status) for r in got.values()]
    for r in got.values():
        assert r.status == "completed" and r.text == ran[0].text, r
        if r.cached:
            assert r.cached_from is not None and r.cached_from.id == ran[0].id


@pytest.mark.engine
def test_cache_false_per_job_and_per_batch_runs_the_engine_and_stores_nothing(
    cache_worker: WorkerProc, redis_client: redis.Redis, tmp_path: Path
) -> None:
    text = "The harvest was early and the prices fell."
    # a job with cache false runs, and leaves no entry: the next identical job runs too
    assert not _one(_job("c1", text, cache=False)).cached
    assert not _one(_job("c2", text)).cached
    assert not _one(_job("c3", text, cache=False)).cached  # an entry exists now, not used
    # a batch submitted with cache off (an envelope's cache, what `--no-cache` sets)
    client = Client(make_settings(Q))
    env = Envelope(job=_job("c4", text), batch="x", enqueued_at=time.time(), cache=False)
    assert not client.submit_many([env]).result("c4", timeout=300).cached
    # and through the CLI
    line = json.dumps(_job("c5", text)).encode()
    out = tmp_path / "out.jsonl"
    done = run_cli("submit", "-", "--no-cache", "--wait", "--out", str(out), "-q", queue=Q,
                   input=line)  # fmt: skip
    assert done.returncode == 0, done.stderr.decode()
    (r,) = [JobResult.model_validate_json(x) for x in out.read_text().splitlines()]
    assert r.status == "completed" and not r.cached, r
    # while the same line without the flag is a hit
    done = run_cli("submit", "-", "--wait", "--out", str(out), "-q", queue=Q, input=line)
    assert done.returncode == 0, done.stderr.decode()
    (r,) = [JobResult.model_validate_json(x) for x in out.read_text().splitlines()]
    assert r.cached, r
    # the entries' bytes are counted against the cache's bound
    assert int(redis_client.get(f"{KEY_PREFIX}:cache:bytes") or 0) > 0
