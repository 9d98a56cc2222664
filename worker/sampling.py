"""How a job samples: vLLM's ``SamplingParams`` for one attempt, the early-stop policy it runs
under, and what each retry changes (a new seed, a lower temperature)."""

from __future__ import annotations

import hashlib
import random
from typing import Any

from schemas import (
    ChatJob,
    EarlyStop,
    Settings,
)

from .answers import _schema_of
from .cache import IDENTITY_FIELDS
from .structured import (
    generation_schema,
)


def retry_seed(job: Any, k: int) -> int:
    """The seed of a job's ``k``-th run after its first (early stop, a loop, failed tests): its
    own seed plus ``k`` when it set one; for a greedy job, one drawn from its content, so the
    same job retries the same way each time it runs (its answer stays determined, which the
    result cache relies on); a sampled job without a seed draws at random."""
    if job.seed is not None:
        return job.seed + k if job.seed + k < 2**63 else job.seed - k
    if job.temperature == 0:
        content = job.model_dump_json(exclude=IDENTITY_FIELDS).encode()
        return (int.from_bytes(hashlib.sha256(content).digest()[:4], "little") >> 1) + k
    return random.randrange(2**31)


def early_stop_policy(job: Any, settings: Settings) -> EarlyStop | None:
    """The job's early-stop policy: its type's, changed by the job's ``early_stop``; None when
    off (by either, or because the worker runs without the monitor)."""
    if not settings.confidence_monitor or job.early_stop is False:
        return None
    if isinstance(job, ChatJob) and job.logprobs is not None:
        return None  # the answer's log probabilities are those it was sampled with, unretried
    policy = settings.early_stop(job.type)
    if job.early_stop is True:
        policy = policy.model_copy(update={"enabled": True})
    elif job.early_stop is not None:
        policy = job.early_stop.over(policy)
    return policy if policy.enabled else None


def retry_sampling(job: Any, policy: EarlyStop, k: int) -> tuple[float, int | None]:
    """Temperature and seed of attempt ``k`` (0: the job's own). Retries take a new seed (the
    job's seed plus k when it set one, so a rerun repeats them) and a lower temperature; a
    greedy job's retries sample, since greedy would walk into the same abort; the last attempt
    is greedy when ``greedy_last``."""
    if k == 0:
        return job.temperature, job.seed
    seed = retry_seed(job, k)
    if k == policy.max_retries and policy.greedy_last:
        return 0.0, seed
    if job.temperature > 0:
        return job.temperature * policy.retry_temperature_scale**k, seed
    return policy.greedy_retry_temperature, seed


def sampling_params(
    job: Any,
    max_tokens: int,
    temperature: float | None = None,
    seed: int | None = None,
    grammar: dict[str, Any] | None = None,
    loops: Any = None,
    frequency_penalty: float = 0.0,
) -> Any:
    # from its module, not ``vllm``'s lazy top level, which imports anew at every call
    from vllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

    structured = None
    schema = _schema_of(job)
    if schema is not None:
        structured = StructuredOutputsParams(json=grammar or generation_schema(schema))
    elif isinstance(job, ChatJob) and job.json_object:
        structured = StructuredOutputsParams(json_object=True)
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=job.temperature if temperature is None else temperature,
        top_p=job.top_p,
        seed=job.seed if seed is None else seed,
        stop=job.stop or None,
        min_tokens=min(job.min_tokens, max_tokens),
        ignore_eos=job.ignore_eos,
        # 0 and -1 both mean every token; vLLM releases differ on which they take
        **({"top_k": job.top_k} if job.top_k > 0 else {}),
        min_p=job.min_p,
        repetition_penalty=job.repetition_penalty,
        stop_token_ids=job.stop_token_ids or None,
        structured_outputs=structured,
        **({"repetition_detection": loops} if loops is not None else {}),
        # a retry after a loop penalizes repeats at least as much as the job asked
        frequency_penalty=(
            max(frequency_penalty, job.frequency_penalty)
            if frequency_penalty
            else job.frequency_penalty
        ),
        presence_penalty=job.presence_penalty,
        logit_bias=job.logit_bias or None,
        logprobs=job.logprobs if isinstance(job, ChatJob) else None,
        # Only the final output crosses back to the task thread: no per-token work in Python.
        output_kind=RequestOutputKind.FINAL_ONLY,
    )
