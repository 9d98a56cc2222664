"""vqueue's loop check (``worker/vllm_ext/loops.py``) against vLLM's own, which it stands in for
in the engine's scheduler: the same answer token by token, on looping and ordinary outputs."""

from __future__ import annotations

import random
from typing import Any

import pytest

pytestmark = pytest.mark.unit


def _params(lo: int, hi: int, count: int) -> Any:
    from vllm.sampling_params import RepetitionDetectionParams

    return RepetitionDetectionParams(max_pattern_size=hi, min_pattern_size=lo, min_count=count)


def test_the_check_answers_as_vllms_own_every_few_tokens() -> None:
    from vllm.v1.core.sched.utils import check_sequence_repetition as vllms
    from vllm.v1.utils import ConstantList

    from worker.vllm_ext.loops import EVERY
    from worker.vllm_ext.loops import check_sequence_repetition as ours

    rng = random.Random(7)
    fired = 0
    for _ in range(400):
        # Given a range of pattern sizes and an output that may fall into a cycle of up to 250
        # tokens (a small vocabulary makes chance repeats common too)
        lo = rng.choice([1, 2, 5, 17, 33])
        hi = lo + rng.choice([0, 3, 15, 60, 240])
        count = rng.choice([2, 3, 4])
        theirs_p, ours_p = _params(lo, hi, count), _params(lo, hi, count)
        vocab = rng.choice([2, 5, 1000])
        cycle = [rng.randrange(vocab) for _ in range(rng.randrange(1, 250))]
        start = rng.randrange(300)
        tokens: list[int] = []
        seen = ConstantList(tokens)  # the request's own list, as the scheduler passes it
        for i in range(rng.randrange(1, 900)):
            fresh = i < start or rng.random() < 0.002
            tokens.append(rng.randrange(vocab) if fresh else cycle[(i - start) % len(cycle)])
            # Then after every token the check answers as vLLM's where the output's length is
            # a multiple of EVERY, and says no loop elsewhere
            want = vllms(seen, theirs_p) if len(tokens) % EVERY == 0 else False
            assert ours(seen, ours_p) == want, (lo, hi, count, vocab, len(tokens))
            if want:
                fired += 1
                break
    assert fired > 80  # the loops ended, not only the ordinary outputs


@pytest.mark.parametrize("cycle", [5, 40, 60, 200])
def test_cycles_of_any_length_up_to_the_longest_end_after_three_copies(cycle: int) -> None:
    from worker.vllm_ext.loops import EVERY, check_sequence_repetition

    # Given the worker's range for the default longest cycle (loops.loop_detection: 17..256)
    params = _params(17, 256, 3)
    rng = random.Random(cycle)
    text = [rng.randrange(50_000) for _ in range(100)]
    unit = [rng.randrange(50_000) for _ in range(cycle)]
    tokens: list[int] = []
    ended_at = None
    for t in text + unit * 20:
        tokens.append(t)
        if check_sequence_repetition(tokens, params):
            ended_at = len(tokens)
            break
    # Then the loop ends at the first check after three copies of its cycle, or of the cycle's
    # smallest multiple of at least 17 tokens (a short cycle must run a few dozen tokens to
    # count)
    copies = len(text) + 3 * cycle * -(-17 // cycle)
    assert ended_at == EVERY * -(-copies // EVERY), (cycle, ended_at)


def test_a_cleared_output_is_read_afresh() -> None:
    from worker.vllm_ext.loops import check_sequence_repetition

    # Given a request whose output was checked, then cleared and refilled to the same length
    # (a streaming session's next turn, were vLLM to keep its params)
    params = _params(2, 8, 3)
    tokens = [1, 2] * 4
    assert check_sequence_repetition(tokens, params)
    tokens.clear()
    # Then what it generates next is judged alone, not against the tokens gone
    for t in range(1, 25):
        tokens.append(t)
        assert not check_sequence_repetition(tokens, params)


def test_a_cut_off_retry_after_a_loop_keeps_the_penalty() -> None:
    # Given an extraction whose first run loops, whose penalized retry is cut off at max_tokens
    # and whose run with more room finishes (a stand-in for the engine: what is tested is the
    # runner's choice of sampling parameters, not generation)
    from schemas import Envelope, Settings
    from worker.engine import Generation
    from worker.runner import run_job

    answers = [
        ("[1, 1, 1, 1", "repetition", 60),
        ('{"a": "', "length", 40),
        ('{"a": "b"}', "stop", 9),
    ]
    penalties: list[float] = []

    class Scripted:
        model_name = "stand-in"
        adapters: dict[str, Any] = {}
        plan = None
        tokenizer = None  # no schema compiled for it
        runner = "generate"

        def chat_prompt(self, messages: list[dict[str, str]], *_: Any, **__: Any) -> list[int]:
            return [1] * 20

        def generate(self, prompt: list[int], params: Any, *_: Any, **__: Any) -> Any:
            penalties.append(params.frequency_penalty)
            text, reason, tokens = answers[len(penalties) - 1]
            return Generation(text, reason, 20, tokens, None)

    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    job = {"type": "extract", "text": "x", "json_schema": schema, "max_tokens": 40}
    env = Envelope.model_validate({"job": job, "batch": "b", "enqueued_at": 0})
    # When it runs
    result = run_job(env, Scripted(), Settings(_env_file=None), "w")  # type: ignore[arg-type]
    # Then the run with more room keeps the penalty the loop earned (without it, it starts where
    # the loop started), and the looped and cut-off runs' tokens count as waste
    assert penalties == [0.0, 0.5, 0.5]
    assert result.status == "completed" and result.data == {"a": "b"}, result
    assert [a.reason for a in result.attempts] == ["loop", "length", "stop"]
    assert result.usage.wasted_tokens == 60 + 40
