"""The producer's side of Redis: the Celery protocol-v2 messages it writes itself must equal
Celery's own, and its reader must see every result a worker stores."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from protocol.wire import queue_key, task_message
from schemas import Envelope, ExtractJob, SummarizeJob
from worker.app import create_app

from .conftest import RUN, make_settings


def test_message_matches_what_celery_and_kombu_write(redis_client: redis.Redis) -> None:
    # Given one envelope, sent once by Celery itself and once written by us
    queue = f"vqtest-{RUN}-wire"
    app = create_app(make_settings(queue))
    job = SummarizeJob(type="summarize", id="a1", text="Some text.", priority=7)
    env = Envelope(job=job, batch="b1", enqueued_at=1.0)
    argsrepr = f"summarize id=a1 batch=b1 prefix={env.prefix_key}"
    app.send_task(
        "vqueue.summarize",
        args=[json.loads(env.wire())],  # its fields at their defaults left out, as ours
        task_id="b1:a1",
        queue=queue,
        priority=2,
        argsrepr=argsrepr,
        kwargsrepr="{}",
    )
    theirs = json.loads(redis_client.lpop(queue_key(queue, 2)))
    key, raw = task_message(env, queue)
    ours = json.loads(raw)
    # Then they land on the same priority list with the same headers and properties
    assert key == queue_key(queue, 2) == f"{queue}:2"
    assert ours["headers"].keys() == theirs["headers"].keys()
    for field in (
        "lang",
        "task",
        "id",
        "root_id",
        "argsrepr",
        "kwargsrepr",
        "retries",
        "timelimit",
    ):
        assert ours["headers"][field] == theirs["headers"][field], field
    # (send_task also copies argsrepr/kwargsrepr into properties, which no consumer reads)
    leaked = {"body_encoding", "argsrepr", "kwargsrepr"}
    assert set(ours["properties"]) == set(theirs["properties"]) - leaked
    for field in ("correlation_id", "delivery_mode", "delivery_info", "priority"):
        assert ours["properties"][field] == theirs["properties"][field], field
    # and kombu decodes both bodies to the same (args, kwargs, embed)
    with app.connection_for_write() as conn:
        channel = conn.default_channel
        decoded = [channel.Message(m, channel=channel).decode() for m in (ours, theirs)]
    assert decoded[0] == decoded[1]
    assert decoded[0][0][0]["job"]["id"] == "a1"
    # and the envelope travels without the fields at their defaults, and reads back whole
    assert "temperature" not in decoded[0][0][0]["job"] and "format" not in decoded[0][0][0]
    assert Envelope.model_validate(decoded[0][0][0]).model_dump() == env.model_dump()


def test_a_pack_message_decodes_to_its_envelopes_whole_or_in_part(
    redis_client: redis.Redis,
) -> None:
    # Given three envelopes of one type and priority framed as one message, and a fourth of
    # another type after them
    from protocol.wire import frames

    queue = f"vqtest-{RUN}-pack"
    app = create_app(make_settings(queue))
    jobs = [SummarizeJob(type="summarize", id=f"p{i}", text=f"Text {i}.") for i in range(3)]
    envs = [Envelope(job=j, batch="b1", enqueued_at=1.0) for j in jobs]
    envs.append(Envelope(job=ExtractJob(type="extract", id="x", text="T.", json_schema={}),
                         batch="b1", enqueued_at=1.0))  # fmt: skip
    # When they are framed four to a message
    messages = frames(envs, queue, per_message=4)
    # Then the three share a message and the other type has its own
    assert [[i for i, _, _ in m[3]] for m in messages] == [["p0", "p1", "p2"], ["x"]]
    key, head, tail, pieces = messages[0]
    with app.connection_for_write() as conn:
        channel = conn.default_channel

        def decode(parts: list[str]) -> Any:
            raw = json.loads(head + ",".join(parts) + tail)
            return raw, channel.Message(raw, channel=channel).decode()

        # and kombu decodes the pack to one argument, the list of its envelopes, under the
        # first job's task id, marked as a pack's
        raw, (args, kwargs, _) = decode([p for _, _, p in pieces])
        assert [e["job"]["id"] for e in args[0]] == ["p0", "p1", "p2"] and kwargs == {}
        assert raw["headers"]["task"] == "vqueue.summarize"
        assert raw["headers"]["id"] == "b1:p0+2"
        # and any part of it (what the claim script pushes when some ids are done) decodes too
        _, (args, _, _) = decode([pieces[2][2]])
        assert [e["job"]["id"] for e in args[0]] == ["p2"]
        # while a lone envelope is the task's argument itself, as Celery would send it
        lone = json.loads(task_message(envs[3], queue)[1])
        args, _, _ = channel.Message(lone, channel=channel).decode()
    assert args[0]["job"]["id"] == "x"
    assert key == queue_key(queue, 9)


def test_a_result_stored_while_the_reader_waits_is_never_skipped(redis_client: redis.Redis) -> None:
    # Given a sealed batch of one job, and a worker that stores its result at the worst moment:
    # just after the reader's wait for results has come back empty (a real race, seen in CI)
    import uuid

    from producer import Client
    from schemas import JobResult, Timings

    client = Client(make_settings(f"vqtest-{RUN}-race"))
    store, batch = client.store, f"race-{uuid.uuid4().hex[:8]}"
    store.create(batch, "vqueue")
    store.claim(batch, [("j1", None)])
    store.seal(batch)
    result = JobResult(id="j1", batch=batch, type="summarize", status="completed", text="ok",
                       timings=Timings(enqueued_at=1.0))  # fmt: skip
    read = store.read

    def read_then_worker_records(*args: object, **kwargs: object) -> object:
        page = read(*args, **kwargs)  # type: ignore[arg-type]
        if not page and not store.status(batch).done:  # type: ignore[union-attr]
            store.record(result)
        return page

    store.read = read_then_worker_records  # type: ignore[method-assign]
    try:
        # When the batch's results are read to the end
        got = list(client.batch(batch).results(timeout=30))
    finally:
        store.delete(batch)
    # Then the result is among them
    assert [r.id for r in got] == ["j1"]


def _sealed_batch(name: str, jobs: list[str]) -> tuple[Any, str, Callable[[str], Any]]:
    """A client, a sealed batch of ``jobs`` with none done, and a maker of their results."""
    import uuid

    from producer import Client
    from schemas import JobResult, Timings

    client = Client(make_settings(f"vqtest-{RUN}-{name}"))
    batch = f"{name}-{uuid.uuid4().hex[:8]}"
    client.store.create(batch, "vqueue")
    client.store.claim(batch, [(j, None) for j in jobs])
    client.store.seal(batch)

    def result(job: str) -> JobResult:
        return JobResult(id=job, batch=batch, type="summarize", status="completed", text="ok",
                         timings=Timings(enqueued_at=1.0))  # fmt: skip

    return client, batch, result


def _read_to_end(
    client: Any, batch: str, before_read: Callable[[int], None]
) -> tuple[list[Any], list[tuple[int | None, list[str]]]]:
    """Every result of ``batch`` as ``Batch.results`` reads them, with ``before_read(k)``
    called before its k-th read of the stream (from 0); also each read's ``block_ms`` and the
    job ids it brought. The batch is deleted after."""
    store = client.store
    read, reads = store.read, []

    def wrapped(*args: object, **kwargs: object) -> object:
        before_read(len(reads))
        page = read(*args, **kwargs)
        reads.append((kwargs.get("block_ms"), [r.id for _, r in page]))
        return page

    store.read = wrapped
    try:
        return list(client.batch(batch).results(timeout=30)), reads
    finally:
        store.read = read
        store.delete(batch)


def test_a_reader_that_has_every_result_of_a_sealed_batch_stops_without_waiting_again(
    redis_client: redis.Redis,
) -> None:
    # Given a sealed batch of two jobs, the first done before the reader starts and the second
    # stored just before the reader's second read of the stream
    client, batch, result = _sealed_batch("count", ["j1", "j2"])
    client.store.record(result("j1"))

    def second_done(k: int) -> None:
        if k == 1:
            client.store.record(result("j2"))

    # When the batch's results are read to the end
    got, reads = _read_to_end(client, batch, second_done)
    # Then both come, and once the reader held as many results as the batch has jobs, no read
    # of the stream waited for more: it asked Redis at once whether the batch was complete
    assert sorted(r.id for r in got) == ["j1", "j2"]
    last = next(i for i, (_, ids) in enumerate(reads) if "j2" in ids)
    assert [block for block, _ in reads[last + 1 :]] == [None]


def test_a_reader_counting_results_still_waits_for_a_job_whose_result_was_run_again(
    redis_client: redis.Redis,
) -> None:
    # Given a sealed batch of two jobs and a reader that has taken j1's result, when j1 is
    # forgotten and run again (a forced re-run) before j2 is done: the reader's count of
    # results reaches the batch's total while j2 is still running
    client, batch, result = _sealed_batch("rerun", ["j1", "j2"])
    client.store.record(result("j1"))

    def j1_reruns_then_j2_ends(k: int) -> None:
        if k == 1:
            client.store.forget(batch, "j1")
            client.store.record(result("j1"))
        elif k == 3:  # after a read that found nothing new
            client.store.record(result("j2"))

    # When the batch's results are read to the end
    got, _ = _read_to_end(client, batch, j1_reruns_then_j2_ends)
    # Then the reader did not stop at its count: j2's result is among what it read
    assert [r.id for r in got] == ["j1", "j1", "j2"]


def test_a_batch_reaches_the_queue_while_it_is_still_being_submitted(
    redis_client: redis.Redis,
) -> None:
    # Given a producer handed 2,000 jobs one at a time (a big file read as it goes)
    from producer import Client
    from protocol.wire import queue_depth, queue_keys

    queue = f"vqtest-{RUN}-stream"
    client = Client(make_settings(queue))
    lists = queue_keys(queue)
    waiting_at: list[int] = []

    def jobs():  # type: ignore[no-untyped-def]
        for i in range(2000):
            if i == 100:  # what a worker could already take
                waiting_at.append(queue_depth(redis_client, queue))
            yield {"id": f"j{i}", "type": "summarize", "text": f"Text {i}."}

    # When they are submitted
    batch = client.submit_many(jobs())

    # Then the first jobs were in the queue before the 100th was even read, and all arrive
    assert waiting_at[0] >= 32, waiting_at
    assert queue_depth(redis_client, queue) == 2000
    assert batch.status().total == 2000
    redis_client.delete(*lists)


def test_a_resubmitted_input_sends_only_what_is_not_queued_yet(redis_client: redis.Redis) -> None:
    # Given a batch of 10 jobs in the queue, no worker taking them
    from producer import Client
    from protocol.wire import queue_depth, queue_keys

    queue = f"vqtest-{RUN}-again"
    client = Client(make_settings(queue))
    lists = queue_keys(queue)

    def jobs(n: int) -> list[dict[str, str]]:
        return [{"id": f"j{i}", "type": "summarize", "text": f"Text {i}."} for i in range(n)]

    try:
        client.submit_many(jobs(10), batch="again")
        # When the same input, grown by 2 lines, is submitted to the batch again
        again = client.submit_many(jobs(12), batch="again")
        # Then only the 2 new jobs are sent: the 10 are queued already, and running them twice
        # at once would waste the work
        assert (again.queued_before, again.skipped) == (10, 0)
        assert queue_depth(redis_client, queue) == 12
        assert again.status().total == 12
        # while jobs known to be lost on the way are sent again, whole
        assert client.resend(jobs(12), "again") == 12
        assert queue_depth(redis_client, queue) == 24
    finally:
        redis_client.delete(*lists)
        client.store.delete("again")


def test_a_batch_of_known_size_keeps_its_done_marks_compact_and_each_path_reads_them(
    redis_client: redis.Redis,
) -> None:
    # Given the same 2,000 jobs sent to two batches, one made with its size known (as
    # `vqueue submit FILE`, `vqueue serve` and a Client given a list make theirs) and one
    # without (a Client given an iterator)
    from producer import Client
    from protocol.store import MARKS_PER_SHARD
    from protocol.wire import queue_keys
    from schemas import JobResult, Timings

    queue = f"vqtest-{RUN}-marks"
    client = Client(make_settings(queue))
    store, lists = client.store, queue_keys(queue)
    jobs = [{"id": f"job-{i:06d}", "type": "summarize", "text": f"Text {i}."} for i in range(2000)]
    sized, plain = f"sized-{RUN}", f"plain-{RUN}"

    def done(batch: str, ident: str) -> bool:
        res = JobResult(id=ident, batch=batch, type="summarize", status="completed", text="ok",
                        timings=Timings(enqueued_at=1.0))  # fmt: skip
        return store.record(res)

    try:
        client.submit_many(jobs, batch=sized)
        client.submit_many(iter(jobs), batch=plain)
        for batch in (sized, plain):
            for i in range(0, 2000, 2):
                assert done(batch, f"job-{i:06d}")
        # Then the sized batch's marks lie in parts Redis keeps as compact listpacks, in well
        # under half the memory of the one hash, and each mark where the scripts look for it
        parts = store.mark_keys(sized)
        assert len(parts) == 2000 // MARKS_PER_SHARD + 1
        assert {redis_client.object("encoding", k) for k in parts} == {"listpack"}
        assert store.mark_keys(plain) == [store.key(plain, "done")]
        store.create(plain, "vqueue", expected=2000)  # made again: its marks stay where they are
        assert store.shards(plain) == 1
        assert redis_client.object("encoding", store.key(plain, "done")) == "hashtable"
        used = {
            b: sum(redis_client.memory_usage(k) for k in store.mark_keys(b)) for b in (sized, plain)
        }
        assert used[sized] < used[plain] / 2, used
        assert all(redis_client.ttl(k) > 0 for k in parts)
        for batch in (sized, plain):
            # a finished job's copy is a lookup, an unfinished one's delivery is counted
            assert store.start(batch, "job-000000")[:2] == (True, 0)
            assert store.start(batch, "job-000001")[:2] == (False, 1)
            assert not done(batch, "job-000000")  # one result per job
            assert store.result(batch, "job-000000") is not None
            by_id = [(i, None) for i in ("job-000002", "job-000003", "nope")]
            assert store.marks(batch, by_id)[1:] == ["", None]
            # a forced re-run withdraws a result, and the id counts once however often sent
            assert store.forget(batch, "job-000000") and store.result(batch, "job-000000") is None
            by_id = [(i, None) for i in ("job-000000", "job-000002", "job-999999")]
            assert store.claim(batch, by_id) == [0, -1, 1]
            assert store.status(batch).total == 2001  # type: ignore[union-attr]
            # and a withdrawn batch closes each of its jobs that has no result, once
            store.withdraw(batch, "cancelled")
            assert store.close_unstarted(batch) == 1002
            assert store.status(batch).done == 2001  # type: ignore[union-attr]
        store.delete(sized)
        assert not any(redis_client.exists(k) for k in parts)
    finally:
        redis_client.delete(*lists)
        store.delete(sized)
        store.delete(plain)


def test_jobs_known_by_their_input_line_leave_one_bit_each_once_done_and_each_path_reads_them(
    redis_client: redis.Redis,
) -> None:
    # Given 2,000 jobs fed with their input lines, as `vqueue submit FILE` and `vqueue serve`
    # feed a batch's own file, half of them done
    from producer import Client
    from producer.client import _job_adapter
    from protocol.wire import queue_keys
    from schemas import Envelope, JobResult, Timings

    queue = f"vqtest-{RUN}-lines"
    client = Client(make_settings(queue))
    store, lists = client.store, queue_keys(queue)
    batch = f"lines-{RUN}"

    def env(i: int) -> Envelope:
        job = _job_adapter.validate_python(
            {"id": f"job-{i:06d}", "type": "summarize", "text": f"Text {i}."}
        )
        return Envelope(job=job, batch=batch, enqueued_at=1.0, line=i + 1)

    def done(i: int) -> bool:
        res = JobResult(id=f"job-{i:06d}", batch=batch, type="summarize", status="completed",
                        text="ok", line=i + 1, timings=Timings(enqueued_at=1.0))  # fmt: skip
        return store.record(res)

    try:
        client.submit_many([env(i) for i in range(2000)], batch=batch)
        assert all(done(i) for i in range(0, 2000, 2))
        # Then no mark is kept under any id: a bit per line, and the ids still open
        assert not any(redis_client.exists(k) for k in store.mark_keys(batch))
        assert redis_client.hlen(store.key(batch, "done:open")) == 1000
        assert redis_client.strlen(store.key(batch, "done:lines")) == 2000 // 8  # bits 0-1999
        assert redis_client.ttl(store.key(batch, "done:lines")) > 0
        # a finished job's copy is a lookup, an unfinished one's delivery is counted
        assert store.start(batch, "job-000000", 1)[:2] == (True, 0)
        assert store.start(batch, "job-000001", 2)[:2] == (False, 1)
        assert not done(0)  # one result per job
        got = store.result(batch, "job-000000")  # found by reading the batch's results
        assert got is not None and got.line == 1
        # and one asked again reads only the results that came since
        assert store.find(batch, "job-001999")[0] is None
        assert done(1999) and client.batch(batch).result("job-001999", timeout=5).line == 2000
        assert store.marks(batch, [("job-000000", 1), ("job-000001", 2), ("nope", 9999)]) == [
            "done", "", None
        ]  # fmt: skip
        # a forced re-run withdraws a result, and a line counts once however often sent
        assert store.forget_many(batch, [("job-000000", 1), ("job-000001", 2)]) == [True, False]
        assert store.result(batch, "job-000000") is None
        assert store.status(batch).completed == 1000  # type: ignore[union-attr]
        jobs = [("job-000000", 1), ("job-000002", 3), ("job-999999", 10**6)]
        assert store.claim(batch, jobs) == [0, -1, 1]
        assert store.status(batch).total == 2001  # type: ignore[union-attr]
        # once its results are taken, a finished job leaves only its bit behind
        last = store.read(batch)[-1][0]
        store.take(batch, last)
        assert redis_client.xlen(store.key(batch, "results")) == 0
        # and a withdrawn batch closes each of its jobs that has no result, once, by line
        store.withdraw(batch, "cancelled")
        assert store.close_unstarted(batch) == 1001
        assert store.close_unstarted(batch) == 0
        assert store.status(batch).done == 2001  # type: ignore[union-attr]
        closed = {r.id: r.line for _, r in store.read(batch)}
        assert closed["job-000001"] == 2 and closed["job-999999"] == 10**6
        assert not redis_client.exists(store.key(batch, "done:open"))
        store.delete(batch)
        assert not redis_client.exists(store.key(batch, "done:lines"))
    finally:
        redis_client.delete(*lists)
        store.delete(batch)


@pytest.mark.unit
def test_a_files_size_is_known_before_its_first_job_without_reading_a_big_one_twice(
    tmp_path: Path,
) -> None:
    from producer.inputs import COUNTED_BYTES, expected_lines

    # Given a small input file, and one past the size that is counted
    small, big = tmp_path / "small.jsonl", tmp_path / "big.jsonl"
    small.write_bytes(b'{"type": "summarize", "text": "x"}\n' * 1000)
    line = b'{"type": "summarize", "text": "' + b"y" * 200 + b'"}\n'
    n = COUNTED_BYTES // len(line) + 1000
    big.write_bytes(line * n)
    # Then the small one's lines are counted (a last line without its newline counts too), and
    # the big one's are estimated from its head, never below what it holds
    assert 1000 <= expected_lines(str(small)) <= 1001
    assert n <= expected_lines(str(big)) <= 2 * n
