"""Putting envelopes on the Celery queue: Celery's message protocol v2, written directly.

``app.send_task`` costs about a millisecond a job (a sent event, a result-backend subscription,
a queue declaration and a Redis round trip each). Writing the same message kombu's Redis
transport would write, and pushing a thousand of them per pipelined round trip, costs a few
tens of microseconds. ``tests/test_publish.py`` checks the message against the one Celery and
kombu produce themselves, and the pipeline tests have real workers consume it.
"""

from __future__ import annotations

import json
import os
import socket
import uuid
from typing import Any

import redis

from schemas import Envelope

# kombu's Redis transport keeps one list per priority step: ``queue`` for step 0, else
# ``queue<SEP><step>``. The worker's broker_transport_options must use the same separator.
PRIORITY_SEP = ":"
PRIORITY_STEPS = list(range(10))
_EMBED = '{"callbacks": null, "errbacks": null, "chain": null, "chord": null}'
_ORIGIN = f"gen{os.getpid()}@{socket.gethostname()}"


def task_name(job_type: str) -> str:
    """One Celery task per job type, so Flower and metrics read ``vqueue.extract`` etc."""
    return f"vqueue.{job_type}"


def redis_priority(priority: int) -> int:
    """Job priority is 'higher runs first'; kombu's Redis lists are consumed lowest step first."""
    return 9 - priority


def queue_key(queue: str, step: int) -> str:
    return f"{queue}{PRIORITY_SEP}{step}" if step else queue


def queue_keys(queue: str) -> list[str]:
    return [queue_key(queue, p) for p in PRIORITY_STEPS]


def task_message(env: Envelope, queue: str) -> tuple[str, str]:
    """(Redis list, message JSON) for one envelope, as kombu's Redis transport stores it."""
    job = env.job
    task_id = f"{env.batch}:{job.id}"  # unique per job, readable in Flower, stable on re-send
    step = redis_priority(job.priority)
    headers: dict[str, Any] = {
        "lang": "py",
        "task": task_name(job.type),
        "id": task_id,
        "shadow": None,
        "eta": None,
        "expires": None,
        "group": None,
        "group_index": None,
        "retries": 0,
        "timelimit": [None, None],
        "root_id": task_id,
        "parent_id": None,
        # what Flower shows instead of the whole prompt
        "argsrepr": f"{job.type} id={job.id} batch={env.batch} prefix={env.prefix_key}",
        "kwargsrepr": "{}",
        "origin": _ORIGIN,
        "ignore_result": True,
        "replaced_task_nesting": 0,
        "stamped_headers": None,
        "stamps": {},
    }
    message = {
        # protocol v2 body: [args, kwargs, embed]; plain JSON (no body_encoding) decodes as is
        "body": f"[[{env.wire()}], {{}}, {_EMBED}]",
        "content-encoding": "utf-8",
        "content-type": "application/json",
        "headers": headers,
        "properties": {
            "correlation_id": task_id,
            "reply_to": "",
            "delivery_mode": 2,
            "delivery_info": {"exchange": "", "routing_key": queue},
            "priority": step,
            "delivery_tag": str(uuid.uuid4()),
        },
    }
    return queue_key(queue, step), json.dumps(message, separators=(",", ":"))


def send_envelopes(broker: redis.Redis, envelopes: list[Envelope], queue: str) -> None:
    """Push ``envelopes`` in one pipelined round trip."""
    pipe = broker.pipeline(transaction=False)
    for env in envelopes:
        pipe.lpush(*task_message(env, queue))
    pipe.execute()


def queue_depth(client: redis.Redis, queue: str) -> int:
    """Jobs waiting in ``queue`` (not those a worker has reserved)."""
    pipe = client.pipeline(transaction=False)
    for key in queue_keys(queue):
        pipe.llen(key)
    counts: list[Any] = pipe.execute()
    return int(sum(counts))
