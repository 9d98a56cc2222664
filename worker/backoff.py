"""Waiting while Redis refuses writes at ``maxmemory``: a worker's writes (its jobs' records,
acknowledgements) wait for room rather than fail a job that ran."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from redis.exceptions import RedisError

from protocol.store import refused_for_memory

log = logging.getLogger(__name__)
T = TypeVar("T")

FULL_BACKOFF_S = (0.1, 5.0)  # the first wait for room in a full Redis, and the longest


def while_full(op: str, call: Callable[[], T]) -> T:
    """``call()``, waiting while Redis refuses writes at ``maxmemory`` (noeviction): the job
    stays unacknowledged meanwhile, so a worker stopped while it waits hands it back after the
    visibility timeout, and its result, if computed, is recorded once room comes. Each refusal
    counts in ``vqueue_redis_full_waits_total{op}``. Any other error is raised."""

    def once(_: list[Any]) -> list[Any]:
        try:
            return [call()]
        except RedisError as exc:
            if refused_for_memory(exc):
                return [exc]
            raise

    done: T = while_full_each(op, once, [None])[0]
    return done


def while_full_each(op: str, call: Callable[[list[Any]], list[Any]], items: list[Any]) -> list[Any]:
    """``while_full`` for a call that answers each of ``items`` in order, a refused item's
    error in its place (a pipeline, ``BatchStore.start_many``): the items Redis refused for
    memory are called again, alone, until room comes, with the same waits and counts; any
    other error stays in its place for the caller."""
    from . import metrics

    answers: list[Any] = [None] * len(items)
    todo = list(range(len(items)))
    wait, longest = FULL_BACKOFF_S
    refused = 0
    while True:
        again = []
        for i, answer in zip(todo, call([items[i] for i in todo]), strict=True):
            if isinstance(answer, RedisError) and refused_for_memory(answer):
                again.append(i)
            else:
                answers[i] = answer
        if not again:
            if refused:
                log.warning("Redis has room again: %s went through after %d refusals", op, refused)
            return answers
        metrics.REDIS_FULL_WAITS.labels(op).inc()
        if not refused:
            log.error("Redis is full (maxmemory): %s waits for room", op)
        refused += 1
        todo = again
        time.sleep(wait)
        wait = min(wait * 2, longest)
