"""One embedding job: its inputs tokenized and fitted to the model's length, every one pooled in
the engine at once, the vectors written as the job asked (floats, or base64 float32).

The result cache covers these jobs as it does a greedy generation: an embedding is determined by
the weights and the input's token ids, so its key is theirs (``ResultCache.key``).
"""

from __future__ import annotations

import base64
import time
from typing import Any

from schemas import EmbedJob, Envelope, JobResult, Settings

from .cache import ResultCache, answered_from_cache
from .engine import Embedding, Engine
from .errors import JobFailed

# between two inputs' ids in the result cache's key: above every token id (ids are < 2**31)
_SEPARATOR = 2**32 - 1


def run_embed(
    env: Envelope,
    engine: Engine,
    settings: Settings,
    deadline: float,
    result: JobResult,
    cache: ResultCache | None = None,
) -> None:
    """Fill ``result`` with ``env``'s embeddings; a job that cannot run raises ``JobFailed``."""
    job: EmbedJob = env.job  # type: ignore[assignment]
    if job.dimensions is not None and not engine.matryoshka:
        raise JobFailed(
            "unsupported_parameter",
            f"dimensions: the model `{engine.model_name}` is not a Matryoshka model, so its "
            "vectors cannot be cut (an operator may declare its dimensions: VQUEUE_HF_OVERRIDES)",
        )  # fmt: skip
    inputs, cut = fit_inputs(job, engine, settings)
    result.input_tokens_truncated = cut
    key = ""
    if cache is not None and env.cache and job.cache:
        flat = [t for ids in inputs for t in (*ids, _SEPARATOR)]
        key = cache.key(job, result.model or "", env.format, flat, 0)
        if answered_from_cache(cache, env.tenant, key, deadline, result, job.type):
            return
    try:
        vectors = engine.embed(
            inputs,
            dimensions=job.dimensions,
            timeout_s=max(deadline - time.monotonic(), 0.001),
            priority=job.priority,
            batch=env.batch,
            salt=env.tenant,
        )  # fmt: skip
        result.embeddings = encoded(vectors, job.encoding_format)
        result.usage.prompt_tokens = sum(v.prompt_tokens for v in vectors)
        result.finish_reason = "stop"
        if key and cache is not None:
            cache.put(env.tenant, key, result)
    finally:
        if key and cache is not None:
            cache.release(env.tenant, key)


def fit_inputs(job: EmbedJob, engine: Engine, settings: Settings) -> tuple[list[list[int]], int]:
    """Each input's token ids within the model's length and the job's limit, by its truncation
    policy (a text's own special tokens are kept at its ends); with the tokens cut. ``reject``
    fails the job naming the first input too long."""
    limit = min(job.max_input_tokens or settings.max_input_tokens("embed"), engine.max_model_len)
    policy = job.truncation or settings.truncation("embed")
    special = set(getattr(engine.tokenizer, "all_special_ids", None) or ())
    out: list[list[int]] = []
    cut = 0
    for i, given in enumerate(job.inputs()):
        ids = engine.embed_prompt(given) if isinstance(given, str) else list(given)
        if len(ids) > limit:
            if policy == "reject":
                which = f"input {i}" if isinstance(job.input, list) else "the input"
                raise JobFailed(
                    "input_too_long",
                    f"{which} is {len(ids)} tokens; the limit is {limit} (the model's "
                    "length, or the job's max_input_tokens)",
                )  # fmt: skip
            cut += len(ids) - limit
            ids = _cut(ids, limit, policy, special)
        out.append(ids)
    return out, cut


def _cut(ids: list[int], limit: int, policy: str, special: set[int]) -> list[int]:
    """``ids`` cut to ``limit`` by ``policy``, the special tokens at either end kept where
    they are: ``head`` keeps the beginning, ``tail`` the end, ``head_tail`` both halves."""
    lead = 0
    while lead < len(ids) and ids[lead] in special and lead < limit // 2:
        lead += 1
    trail = 0
    while trail < len(ids) - lead and ids[-1 - trail] in special and trail < limit // 2:
        trail += 1
    body = ids[lead : len(ids) - trail]
    room = max(limit - lead - trail, 0)
    if policy == "head":
        kept = body[:room]
    elif policy == "tail":
        kept = body[len(body) - room :] if room else []
    else:
        half = room // 2
        kept = body[:half] + (body[len(body) - (room - half) :] if room - half else [])
    return ids[:lead] + kept + ids[len(ids) - trail :]


def encoded(vectors: list[Embedding], encoding_format: str) -> list[Any]:
    """The vectors as the job asked for them: floats, or each one's little-endian float32
    bytes in base64 (OpenAI's ``encoding_format: base64``)."""
    if encoding_format == "base64":
        return [base64.b64encode(v.vector.astype("<f4").tobytes()).decode() for v in vectors]
    return [v.vector.tolist() for v in vectors]
