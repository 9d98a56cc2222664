"""A job's priority reaches the worker and vLLM's scheduler: an urgent job is taken in while the
worker holds its full share of bulk jobs, overtakes the bulk jobs already waiting inside the
engine, not only those still in Redis, and takes a running bulk job's slot rather than wait for
one to finish (real worker, real engine, small model)."""

from __future__ import annotations

import json

import pytest
import redis

from producer import Client

from .conftest import KEY_PREFIX, RUN, Procs, make_settings, wait_for

pytestmark = pytest.mark.engine

Q = f"vqtest-{RUN}-prio"
SEQS = 2  # sequences the engine runs at once; the worker holds four times as many


def _bulk(i: int) -> dict[str, object]:
    return {"id": f"bulk{i}", "type": "summarize", "priority": 0,
            "text": f"Report {i}: the quarterly numbers came in above plan in every region.",
            "max_tokens": 48, "min_tokens": 48, "ignore_eos": True}  # fmt: skip


def test_an_urgent_job_is_taken_in_past_a_full_share_and_starts_before_waiting_bulk_jobs(
    procs: Procs, redis_client: redis.Redis
) -> None:
    # Given one worker whose engine runs 2 sequences a step and which holds 8 jobs, saturated by
    # a batch of 30 bulk jobs at priority 0: 2 generating, 6 waiting in the engine, 22 in Redis
    w = procs.worker("prio", Q, VQUEUE_MAX_NUM_SEQS=str(SEQS), VQUEUE_CONCURRENCY=str(4 * SEQS))
    w.wait_ready(redis_client)
    urgent_lane = w.node.replace("@", "-urgent@")
    wait_for(lambda: redis_client.exists(f"{KEY_PREFIX}:worker:{urgent_lane}"), 180,
             "its urgent process")  # fmt: skip
    client = Client(make_settings(Q))
    bulk = client.submit_many([_bulk(i) for i in range(30)])

    def saturated() -> bool:  # holding 8, and the first 2 already generating (tokens flow)
        beat = redis_client.get(w.heartbeat_key())
        info = json.loads(beat) if beat else {}
        return info.get("in_flight", 0) >= 4 * SEQS and (info.get("tokens_per_s") or 0) > 0

    wait_for(saturated, 120, "the worker to hold 8 jobs, 2 of them generating")

    # When a priority-9 job is submitted behind them
    urgent = client.submit({"id": "urgent", "type": "summarize", "priority": 9,
                            "text": "Outage: the payment service is down in one region.",
                            "max_tokens": 16})  # fmt: skip
    u = urgent.result("urgent", timeout=300)
    done = list(bulk.results(timeout=600))

    # Then the worker's urgent process took it in at once, while the worker still held
    # its 8 bulk jobs (a slot may be between a finished job and the next for a few ms: 7)
    assert u.worker == urgent_lane, u.worker
    taken = u.timings.started_at or 0
    holding = [
        r.id for r in done if (r.timings.started_at or 0) <= taken < (r.timings.finished_at or 0)
    ]
    assert len(holding) >= 4 * SEQS - 1, (holding, u.timings)
    # and it got its first token before the bulk jobs that had none when it arrived, but for at
    # most the engine's 2 slots that freed while it was still on its way in from Redis ...
    assert u.status == "completed" and u.timings.first_token_at, u
    came, first = u.timings.enqueued_at, u.timings.first_token_at
    pending = [r for r in done if r.timings.first_token_at and r.timings.first_token_at > came]
    overtook = [r.id for r in pending if r.timings.first_token_at < first]
    assert len(overtook) <= SEQS, (overtook, u.timings)
    # ... and those it passed include jobs the worker already held, waiting in the engine: the
    # engine's scheduler put it ahead of them (first come first served would not)
    held = [r for r in pending if (r.timings.started_at or 0) < came]
    passed = [r.id for r in held if r.timings.first_token_at > first]
    assert len(passed) >= 3, ([r.id for r in held], passed, u.timings)
    # and it did not wait for one of the engine's 2 slots to free: a running bulk job was
    # preempted to give it one (VQUEUE_URGENT_PREEMPT; this KV cache never runs short), and
    # resumed where it was: every bulk answer whole, the urgent one never preempted
    preempted = [r.id for r in done if r.timings.preemptions]
    assert 1 <= len(preempted) <= SEQS and u.timings.preemptions == 0, (preempted, u.timings)
    assert len(done) == 30 and all(r.status == "completed" for r in done)
    assert all(r.usage.completion_tokens == 48 for r in done), [r.usage for r in done]
