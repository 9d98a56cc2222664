"""The producer writes Celery's protocol-v2 messages itself; they must equal Celery's own."""

from __future__ import annotations

import json

import redis

from producer.publish import queue_key, task_message
from schemas import Envelope, SummarizeJob
from worker.app import create_app

from .conftest import make_settings


def test_message_matches_what_celery_and_kombu_write(redis_client: redis.Redis) -> None:
    # Given one envelope, sent once by Celery itself and once written by us
    queue = "vqtest-wire"
    app = create_app(make_settings(queue))
    job = SummarizeJob(type="summarize", id="a1", text="Some text.", priority=7)
    env = Envelope(job=job, batch="b1", enqueued_at=1.0)
    argsrepr = f"summarize id=a1 batch=b1 prefix={env.prefix_key}"
    app.send_task(
        "vqueue.summarize",
        args=[env.model_dump(mode="json")],
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
