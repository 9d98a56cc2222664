"""An instant stand-in for the vLLM engine, for measuring the queue's own cost and nothing else.

STUB: it generates nothing. ``VQUEUE_ENGINE_CLASS=benchmarks.stub_engine:StubEngine`` makes a
worker use it; ``benchmarks/queue_cpu.py``, ``investigations/gil_switch.py``, ``tenants.py`` and
``http_path.py --stub`` do, and their reports say so.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np

from schemas import Settings
from worker.engine import Embedding, Generation


class StubEngine:
    def __init__(self, settings: Settings) -> None:
        # what the real engine host has imported before its first job (the jobs' sampling
        # parameters are vLLM's); else the first 256 jobs queue on Python's import lock
        import vllm.sampling_params  # noqa: F401

        self.settings = settings
        self.model_name = "stub"
        self.model_names = [self.model_name]
        self.model_path = self.model_name  # no weights: its name stands in for the cache's key
        self.adapters: dict[str, tuple[str, int, str]] = {}  # no LoRA
        self.tokenizer = None  # nothing tokenized for real: no schema compiled on it
        self.tool_calls = None  # no tool-call parser
        self.stats = None  # no engine numbers to report
        self.plan = None  # no vLLM engine, so none of vqueue's optimizations in one
        self.in_flight = self.max_in_flight = self.jobs_done = 0
        self.started_at = time.time()
        self._lock = threading.Lock()
        # "pooling" when the test or benchmark sets VQUEUE_RUNNER so: embed jobs alone
        self.runner = "generate" if settings.runner == "auto" else settings.runner
        self.max_model_len = settings.max_model_len
        self.matryoshka = True  # any dimensions: its vectors are made up

    def chat_prompt(
        self, messages: list[dict[str, str]], known: Any = None, tools: Any = None
    ) -> list[int]:
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
            self.jobs_done += 1
        return Generation(
            text="stub output",
            finish_reason="stop",
            prompt_tokens=len(prompt_ids),
            completion_tokens=2,
            first_token_at=time.time(),
        )

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
        return []  # a stub job ends as it starts: none is ever running to abort

    def abort_batch(self, batch: str, reason: str) -> int:
        return 0

    def on_death(self, callback: Any) -> None:
        pass  # it never dies

    def close(self) -> None:
        pass
