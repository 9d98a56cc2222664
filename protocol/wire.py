"""Putting envelopes on the Celery queue: Celery's message protocol v2, written directly.

``app.send_task`` costs about a millisecond a job (a sent event, a result-backend subscription,
a queue declaration and a Redis round trip each). Writing the same message kombu's Redis
transport would write, and pushing a thousand of them per pipelined round trip, costs a few
tens of microseconds. ``tests/test_publish.py`` checks the message against the one Celery and
kombu produce themselves, and the pipeline tests have real workers consume it.

A message may carry several jobs (a pack, ``Settings.jobs_per_message``): Celery's consumer
costs a worker about as much CPU per message whatever the message holds.
"""

from __future__ import annotations

import json
import os
import socket
import uuid
from typing import Any

import redis

from schemas import Envelope

from .scripts import source

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


# stands where a message's envelopes go while its frame is written; JSON escapes it unchanged
_SLOT = "@vqueue-envelopes@"

# a message as (Redis list, its JSON before its envelopes, after them,
# [(job id, its input line or None, piece)])
Frame = tuple[str, str, str, list[tuple[str, int | None, str]]]


def envelope_piece(env: Envelope) -> str:
    """What the envelope's JSON becomes inside the message's ``body`` string (a JSON string in
    a JSON string), so that any subset of a pack's pieces joins with "," into its message."""
    return json.dumps(env.wire())[1:-1]


def message_frame(envelopes: list[Envelope], queue: str) -> tuple[str, str, str]:
    """(Redis list, the message's JSON up to its envelopes, the JSON after them) for a message
    carrying ``envelopes``, as kombu's Redis transport stores a Celery protocol v2 message.
    One envelope is the task's argument itself; more are a pack, one list argument, which
    a worker runs at once (``Settings.jobs_per_message``). A pack's envelopes share a type
    and a priority (one task name, one list), so the frame fits any subset of them."""
    first, n = envelopes[0], len(envelopes)
    job = first.job
    task_id = f"{first.batch}:{job.id}"  # unique per job, readable in Flower, stable on re-send
    what = f"{job.type} id={job.id}"
    args = f"[{_SLOT}]"
    if n > 1:  # Celery allows one id per message: the first job's, marked as a pack's
        task_id += f"+{n - 1}"
        what = f"{n} {job.type} jobs ids={pack_ids(envelopes)}"
        args = f"[[{_SLOT}]]"
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
        "argsrepr": f"{what} batch={first.batch} prefix={first.prefix_key}",
        "kwargsrepr": "{}",
        "origin": _ORIGIN,
        "ignore_result": True,
        "replaced_task_nesting": 0,
        "stamped_headers": None,
        "stamps": {},
    }
    message = {
        # protocol v2 body: [args, kwargs, embed]; plain JSON (no body_encoding) decodes as is
        "body": f"[{args}, {{}}, {_EMBED}]",
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
    head, tail = json.dumps(message, separators=(",", ":")).split(_SLOT)
    return queue_key(queue, step), head, tail


def pack_ids(envelopes: list[Envelope], room: int = 160) -> str:
    """A pack's job ids as Flower shows them in its args: all that fit in ``room`` characters,
    then how many more (a revoke names the rest: ``worker.tasks`` reads the pack itself)."""
    out = ""
    for i, env in enumerate(envelopes):
        piece = env.job.id if not out else f",{env.job.id}"
        if len(out) + len(piece) > room:
            return f"{out},+{len(envelopes) - i} more"
        out += piece
    return out


def frames(envelopes: list[Envelope], queue: str, per_message: int = 1) -> list[Frame]:
    """``envelopes`` as messages of at most ``per_message`` each, in their order: (Redis list,
    head, tail, [(job id, input line, piece)]); a message's JSON is head + ",".join(pieces) +
    tail. Only neighbours of one type and priority share a message, so a prefix group sorted
    together travels together."""
    out: list[Frame] = []
    run: list[Envelope] = []

    def close() -> None:
        if run:
            key, head, tail = message_frame(run, queue)
            out.append((key, head, tail, [(e.job.id, e.line, envelope_piece(e)) for e in run]))
            run.clear()

    for env in envelopes:
        if run and (
            len(run) >= per_message
            or env.job.type != run[0].job.type
            or env.job.priority != run[0].job.priority
        ):
            close()
        run.append(env)
    close()
    return out


def task_message(env: Envelope, queue: str) -> tuple[str, str]:
    """(Redis list, message JSON) for one envelope."""
    key, head, tail = message_frame([env], queue)
    return key, head + envelope_piece(env) + tail


def push(broker: redis.Redis, messages: list[Frame]) -> None:
    """Push ``messages`` whole, in one pipelined round trip."""
    pipe = broker.pipeline(transaction=False)
    for key, head, tail, pieces in messages:
        pipe.lpush(key, head + ",".join(p for _, _, p in pieces) + tail)
    pipe.execute()


def send_envelopes(broker: redis.Redis, envelopes: list[Envelope], queue: str) -> None:
    """Push ``envelopes``, one to a message, in one pipelined round trip."""
    push(broker, frames(envelopes, queue))


# the depth.lua script counts a queue's jobs
DEPTH_READ = 256  # messages a list read at most; a longer one's count is an estimate


def queue_depth(client: redis.Redis, queue: str) -> int:
    """Jobs waiting in ``queue`` (not those a worker has reserved), packs counted by their
    jobs: exact up to ``DEPTH_READ`` messages a priority list, then estimated."""
    return int(client.eval(source("depth"), len(PRIORITY_STEPS), *queue_keys(queue), DEPTH_READ))
