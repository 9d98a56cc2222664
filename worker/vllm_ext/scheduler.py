"""vLLM's scheduler with one change: an urgent request takes a running bulk request's place.

Under ``scheduling_policy="priority"`` vLLM admits waiting requests in priority order, but only
into a free slot: while ``max_num_seqs`` requests run, the most urgent waiting request waits for
one of them to finish, and a bulk batch of similar answers finishes in waves, about one answer's
generation apart. So an urgent job beside a full bulk batch can wait a whole bulk generation in
vLLM's waiting line, however early it left Redis.

Before each step is scheduled, while no slot is free and the head of the waiting line is urgent
(its vLLM priority at most the plan's ``urgent_order``) and outranks the lowest-ranked running
request, that request is preempted the way vLLM preempts under memory pressure: its KV blocks
freed (its prefix stays in the prefix cache until evicted), its tokens kept, and it goes back to
the waiting line to resume after a recompute. vLLM then schedules the step as always and the
urgent request takes the freed slot. Only strictly lower-ranked requests are preempted, at most
``MAX_PER_STEP`` a step, so bulk jobs of different priorities never preempt each other and a burst
of urgent jobs costs bulk a few recomputes.

Installed through vLLM's ``scheduler_cls`` option (``configure.py``) on the releases and source
``compat.py`` names (``urgent-preempt``); it calls the scheduler's private ``_preempt_request``.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler

from .plugin import PLAN_ENV

MAX_PER_STEP = 4  # urgent requests given a slot by preemption in one step


def _urgent_order() -> int | None:
    raw = os.environ.get(PLAN_ENV)
    order = json.loads(raw).get("urgent_order") if raw else None
    return int(order) if order is not None else None


class _UrgentFirst:
    """The change, over whichever scheduler vLLM would have used (async or not)."""

    running: list[Any]
    waiting: Any
    policy: SchedulingPolicy
    max_num_running_reqs: int

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        self.urgent_order = _urgent_order()

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        if self.urgent_order is not None and self.policy == SchedulingPolicy.PRIORITY:
            self._make_room()
        return super().schedule(*args, **kwargs)  # type: ignore[misc]

    def _make_room(self) -> None:
        if not self.waiting or len(self.running) < self.max_num_running_reqs:
            return  # a slot is free: vLLM admits the head of the line itself
        assert self.urgent_order is not None
        if self.waiting.peek_request().priority > self.urgent_order:
            return
        now = time.monotonic()
        for taken, request in enumerate(self.waiting):  # in priority order, over a copy
            if taken == MAX_PER_STEP or request.priority > self.urgent_order:
                return
            victim = max(self.running, key=lambda r: (r.priority, r.arrival_time))
            if victim.priority <= request.priority:
                return
            self.running.remove(victim)
            self._preempt_request(victim, now)  # type: ignore[attr-defined]


class UrgentFirstScheduler(_UrgentFirst, Scheduler):
    pass


class UrgentFirstAsyncScheduler(_UrgentFirst, AsyncScheduler):
    pass
