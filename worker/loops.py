"""Loops in an answer: vLLM's repetition check for a job (``loop_detection``), and a repeating
tail found in an answer that ran to ``max_tokens`` (``repeats_at_end``), so that it is retried
as a loop (docs/quality.md)."""

from __future__ import annotations

import dataclasses
import functools
import logging
import re
from typing import Any

from schemas import Settings

from .answers import _wants_json
from .engine import Generation
from .vllm_ext.compat import LOOP_FALLBACK_TOKENS, Plan

log = logging.getLogger(__name__)

# the shortest pattern a loop check tries: shorter cycles count as their multiples
SHORTEST_PATTERN = 17

_DIGITS = re.compile(r"\d+")


# a tail of at least REPEAT_COPIES copies of one chunk of REPEAT_MIN_CHARS to REPEAT_MAX_CHARS
REPEAT_COPIES = 3


REPEAT_MIN_CHARS = 16


REPEAT_MAX_CHARS = 1500


def repeats_at_end(text: str) -> bool:
    """Whether ``text`` ends in one chunk repeated over and over, its numbers aside: a JSON
    array cycling through the same items (``{"item": "flour"}, {"item": "milk"}, ...``, however
    many tokens one cycle takes), or a numbered list repeating one line ("13. 注意防范山洪
    14. 注意防范山洪 ..."). The engine's loop check stops cycles of up to
    ``VQUEUE_LOOP_MAX_CYCLE_TOKENS`` tokens of identical ids as they happen; this reads an
    answer that ran to ``max_tokens`` for the rest, so that it is retried as a loop (a
    frequency penalty) rather than given more room to loop in. Characters, not tokens: one
    cycle ends where ``max_tokens`` cut it, anywhere in its text, which periodicity does not
    mind."""
    tail = _DIGITS.sub("#", text[-REPEAT_COPIES * REPEAT_MAX_CHARS * 2 :])
    for p in range(REPEAT_MIN_CHARS, min(REPEAT_MAX_CHARS, len(tail) // REPEAT_COPIES) + 1):
        w = tail[-REPEAT_COPIES * p :]
        if w[:-p] == w[p:] and w[:p].strip():
            return True
    return False


def _as_loop(gen: Generation, loops: Any) -> Generation:
    """A generation cut off at ``max_tokens`` in a repeating tail (``repeats_at_end``), where
    loops are watched, ends as a loop, as if the engine had stopped it."""
    if gen.finish_reason == "length" and loops is not None and repeats_at_end(gen.text):
        return dataclasses.replace(gen, finish_reason="repetition")
    return gen


def loop_detection(job: Any, settings: Settings, plan: Plan | None = None) -> Any:
    """vLLM's ``RepetitionDetectionParams`` for the job, or None where loops are not watched.
    Pattern sizes up to the longest cycle, from half of it but at most ``SHORTEST_PATTERN``: a
    cycle of ``c`` tokens repeats as every multiple of ``c``, and that range holds one for every
    ``c`` up to the longest, so a short cycle counts only once its copies span a few dozen
    tokens ("-----", "0, 0, 0" are text, not loops). Where the plan has no ``loop-check``
    (``worker.vllm_ext.loops``), vLLM's own check runs, whose cost grows with the range: the
    default then covers cycles of up to ``LOOP_FALLBACK_TOKENS``, and a value set on purpose
    is kept."""
    mode = settings.loop_detection
    if mode == "off" or job.ignore_eos or (mode == "json" and not _wants_json(job)):
        return None
    longest = settings.loop_max_cycle_tokens
    own = plan is not None and plan.loop_check
    if not own and "loop_max_cycle_tokens" not in settings.model_fields_set:
        longest = min(longest, LOOP_FALLBACK_TOKENS)
    try:
        shortest = min(longest // 2 + 1, SHORTEST_PATTERN)
        return _repetition_params(longest, shortest, settings.loop_min_repeats)
    except ImportError:  # vLLM before 0.26: jobs run as they did, loops and all
        _warn_once("this vLLM has no repetition detection: loops are not caught")
        return None


@functools.cache
def _repetition_params(longest: int, shortest: int, repeats: int) -> Any:
    """One ``RepetitionDetectionParams`` for every job that watches the same loops: vLLM
    reads it and never changes it, and building one runs pydantic's checks."""
    from vllm.sampling_params import RepetitionDetectionParams

    return RepetitionDetectionParams(
        max_pattern_size=longest, min_pattern_size=shortest, min_count=repeats
    )


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning(message)
