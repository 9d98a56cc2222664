"""The one settings object, read from ``VQUEUE_*`` environment variables (and ``.env``).

Producers read the broker and queue; workers read the rest. CLI options default to these values.
"""

from __future__ import annotations

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="VQUEUE_", env_file=".env", extra="ignore")

    # -- where jobs and results live
    broker_url: str = "redis://127.0.0.1:6379/0"
    # defaults to broker_url; Celery's own result backend (Flower, AsyncResult)
    result_backend: str | None = None
    queue: str = "vqueue"  # the Celery queue jobs go to and workers consume
    key_prefix: str = "vqueue"  # prefix of the Redis keys holding batches and results
    result_ttl_s: int = 7 * 24 * 3600  # batches and their results expire after a week
    # Redis redelivers an unacknowledged job after this; must exceed job_timeout_s
    visibility_timeout_s: int = 3600
    # a job still generating after this is aborted in the engine and fails with "timeout"
    job_timeout_s: float = Field(default=900.0, gt=0)
    # a job whose worker died this many times while running it is dead-lettered, not run again
    max_deliveries: int = Field(default=3, ge=1)
    # clients retry a lost Redis connection (restart, AOF reload) for about this long
    redis_retry_s: float = Field(default=120.0, ge=0)

    # -- the model and the engine (worker side)
    model: str = "smollm2-135m-instruct"  # the embedded default; else any HF id or local path
    served_model_name: str | None = None  # name reported in results; defaults to model
    max_model_len: int = 4096
    gpu_memory_utilization: float = Field(default=0.9, gt=0.0, le=1.0)
    # KV cache size in bytes; overrides gpu_memory_utilization (on CPU it is what to set)
    kv_cache_memory_bytes: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    dtype: str = "auto"
    tensor_parallel_size: int = 1  # `vqueue worker --gpus 0,1` sets it from the GPU count
    # None: auto. Eager on CPU hosts (compiling costs minutes per start there), compiled with
    # CUDA graphs on GPUs. True/False force it.
    enforce_eager: bool | None = None
    enable_prefix_caching: bool = True
    seed: int = 0
    # guided decoding backend: llguidance covers the widest JSON Schema subset and compiles
    # grammars lazily; "xgrammar" is the alternative
    structured_outputs_backend: str = "guidance"

    # -- worker process
    # import path of the engine host; benchmarks/stub_engine.py swaps in an instant stub to
    # measure the queue alone (never for real work)
    engine_class: str = "worker.engine:EngineHost"
    # Celery threads; 0 means 2 * max_num_seqs, so the engine always has its next batch queued
    concurrency: int = 0
    gpus: str | None = None  # CUDA_VISIBLE_DEVICES for this worker
    heartbeat_s: float = 5.0  # how often a worker refreshes its liveness key
    log_stats_s: float = 10.0  # how often the engine logs vLLM's stats line; 0 turns it off
    # Prometheus /metrics (vqueue_* and vLLM's vllm:*); 0 turns it off. `vqueue worker --gpus N`
    # adds N, so one worker per GPU on a host gets its own port.
    metrics_port: int = Field(default=9808, ge=0, le=65535)
    metrics_host: str = "0.0.0.0"

    # -- per-type output budgets when a job sets no max_tokens
    max_tokens_summarize: int = 256
    max_tokens_extract: int = 512
    max_tokens_codegen: int = 512
    max_tokens_chat: int = 512

    @model_validator(mode="after")
    def _check(self) -> Settings:
        if self.visibility_timeout_s <= self.job_timeout_s:
            raise ValueError(
                f"VQUEUE_VISIBILITY_TIMEOUT_S ({self.visibility_timeout_s}) must exceed "
                f"VQUEUE_JOB_TIMEOUT_S ({self.job_timeout_s}): Redis would hand a running job "
                "to a second worker"
            )
        return self

    def backend_url(self) -> str:
        return self.result_backend or self.broker_url

    def worker_concurrency(self) -> int:
        return self.concurrency or 2 * self.max_num_seqs

    def default_max_tokens(self, job_type: str) -> int:
        return int(getattr(self, f"max_tokens_{job_type}"))


def get_settings() -> Settings:
    return Settings()
