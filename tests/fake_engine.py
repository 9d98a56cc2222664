"""FAKE ENGINE, for tests that isolate queue mechanics (worker kill -9, SIGTERM drain, Redis
restarts, dead letters), where restarting a real engine many times would only add minutes.

It generates nothing: each job sleeps ``VQUEUE_TEST_FAKE_DELAY_S`` and answers a fixed text,
with token ids made up from the prompt's length. A job whose text contains ``KILL-THE-WORKER`` kills
the worker process (SIGKILL), to make a poison job; one whose text contains ``RAISE-IN-WORKER``
raises an exception nobody expects in the per-job path (a bug of ours, say). Used as
``VQUEUE_ENGINE_CLASS=tests.fake_engine:FakeEngine``; tests that use it say so. Every other test
runs the real engine.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import numpy as np

from schemas import Settings
from schemas.results import TokenLogprob, TopLogprob
from worker.engine import Embedding, Generation
from worker.metrics import EngineStats

POISON = "KILL-THE-WORKER"
BUG = "RAISE-IN-WORKER"


def _logprobs(k: int | None) -> list[TokenLogprob] | None:
    """The fixed answer's two tokens, each the likeliest, when a request asks for logprobs."""
    if k is None:
        return None
    tokens = []
    for text in ("stub", " output"):
        alts = [TopLogprob(token=text, logprob=-0.1, bytes=list(text.encode()))]
        alts += [TopLogprob(token=f"alt{i}", logprob=-5.0 - i, bytes=list(f"alt{i}".encode()))
                 for i in range(1, k)]  # fmt: skip
        tokens.append(TokenLogprob(token=text, logprob=-0.1, bytes=list(text.encode()),
                                   top_logprobs=alts[:k]))  # fmt: skip
    return tokens


class FakeEngine:
    def __init__(self, settings: Settings) -> None:
        # what the real engine host has imported before its first job (the jobs' sampling
        # parameters are vLLM's): not on the first job, whose time it would take
        import vllm.sampling_params  # noqa: F401

        self.settings = settings
        self.tokenizer = None  # no special tokens to keep out of tools
        self.tool_calls = None  # no tool-call parser
        # "fake" unless the test names it (VQUEUE_SERVED_MODEL_NAME), as a real worker's names
        self.model_names = settings.served_names() if settings.served_model_name else ["fake"]
        self.model_name = self.model_names[0]
        self.model_path = self.model_name  # no weights: its name stands in for the cache's key
        self.adapters: dict[str, tuple[str, int, str]] = {}  # no LoRA
        self.plan = None  # no vLLM engine, so none of vqueue's optimizations in one
        self.delay = float(os.environ.get("VQUEUE_TEST_FAKE_DELAY_S", "0.2"))
        self.in_flight = self.max_in_flight = self.jobs_done = 0
        self.started_at = time.time()
        self.stats = EngineStats()
        self._lock = threading.Lock()
        # "pooling" when the test or benchmark sets VQUEUE_RUNNER so: embed jobs alone
        self.runner = "generate" if settings.runner == "auto" else settings.runner
        self.max_model_len = settings.max_model_len
        self.matryoshka = True  # any dimensions: its vectors are made up

    def chat_prompt(
        self, messages: list[dict[str, str]], known: Any = None, tools: Any = None
    ) -> list[int]:
        if any(POISON in m["content"] for m in messages):
            os.kill(os.getpid(), signal.SIGKILL)
        if any(BUG in m["content"] for m in messages):
            raise ZeroDivisionError("injected into the per-job path by the test")
        # about four characters a token, like a real tokenizer on English
        return [0] * max(1, sum(len(m["content"]) for m in messages) // 4)

    def completion_prompt(self, text: str) -> list[int]:
        return [0] * max(1, len(text) // 4)

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]  # a character a token

    def decode(self, ids: list[int]) -> str:
        return "".join(map(chr, ids))

    def generate(
        self,
        prompt_ids: list[int],
        params: Any,
        timeout_s: Any = None,
        prefix_key: Any = None,
        monitor: Any = None,
        priority: int = 0,
        batch: str | None = None,
        salt: str | None = None,
        lora: Any = None,
    ) -> Generation:
        with self._lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            # finish on the next multiple of the delay: jobs started together end together, the
            # way a continuous batch hands back many outputs in one engine step
            time.sleep(self.delay - time.time() % self.delay)
            return Generation(
                text="stub output",
                finish_reason="stop",
                prompt_tokens=len(prompt_ids),
                completion_tokens=2,
                first_token_at=time.time(),
                logprobs=_logprobs(params.logprobs),
            )
        finally:
            with self._lock:
                self.in_flight -= 1
                self.jobs_done += 1

    def embed_prompt(self, text: str) -> list[int]:
        return [ord(c) for c in text]  # a character a token

    def embed(
        self,
        inputs: list[list[int]],
        dimensions: int | None = None,
        timeout_s: Any = None,
        priority: int = 0,
        batch: str | None = None,
        salt: str | None = None,
    ) -> list[Embedding]:
        # a fixed unit vector per input, every one back at once as from one engine step
        return [
            Embedding(np.eye(1, dimensions or 8, dtype=np.float32)[0], len(ids)) for ids in inputs
        ]

    def active_batches(self) -> list[str]:
        return []  # nothing to abort: a fake job is a sleep

    def abort_batch(self, batch: str, reason: str) -> int:
        return 0

    def on_death(self, callback: Any) -> None:
        pass  # it never dies; a test that kills the engine kills the worker

    def close(self) -> None:
        pass
