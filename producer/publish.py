"""Putting envelopes on the Celery queue, many per Redis round trip.

``apply_async`` one job at a time costs a round trip each (a few thousand jobs/s at best).
kombu's ``Producer.batch()`` buffers the LPUSHes (and Flower's task-sent events) in one
non-transactional pipeline, so a chunk of a thousand jobs costs one round trip.
"""

from __future__ import annotations

from typing import Any

import redis
from celery import Celery

from schemas import Envelope
from worker.app import redis_priority, task_name


def send_envelopes(app: Celery, envelopes: list[Envelope], queue: str) -> None:
    with app.producer_or_acquire() as producer, producer.batch(max_size=4 * len(envelopes) + 8):
        for env in envelopes:
            job = env.job
            app.send_task(
                task_name(job.type),
                args=[env.model_dump(mode="json")],
                # batch:id is unique per job and readable in Flower; a re-sent job keeps it
                task_id=f"{env.batch}:{job.id}",
                queue=queue,
                priority=redis_priority(job.priority),
                producer=producer,
                # what Flower shows instead of the whole prompt
                argsrepr=f"{job.type} id={job.id} batch={env.batch}",
                kwargsrepr="{}",
            )


def queue_keys(queue: str) -> list[str]:
    """kombu's Redis list per priority step: ``queue`` for 0, ``queue:N`` for N (sep ':')."""
    return [queue] + [f"{queue}:{p}" for p in range(1, 10)]


def queue_depth(client: redis.Redis, queue: str) -> int:
    """Jobs waiting in ``queue`` (not those a worker has reserved)."""
    pipe = client.pipeline(transaction=False)
    for key in queue_keys(queue):
        pipe.llen(key)
    counts: list[Any] = pipe.execute()
    return int(sum(counts))
