"""The one settings object, read from ``VQUEUE_*`` environment variables (and ``.env``).

Producers read the broker and queue; workers read the rest. CLI options default to these values.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

# Queue names become Redis keys: the batch id's characters, and never ``<queue>.urgent`` or
# ``<queue>@<worker>`` (protocol/routing.py), which would push into another queue's lists.
QUEUE_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$"

# What to do with a document longer than its type's input limit: keep its beginning, its end,
# both ends (the middle goes), or fail the job with ``input_too_long``.
Truncation = Literal["head", "tail", "head_tail", "reject"]


class EarlyStop(BaseModel):
    """Logprob early stop (worker/confidence.py): abort a generation whose top-1 token logprob
    stays under ``threshold`` for ``window`` consecutive tokens after the first ``grace_tokens``,
    and run it again with changed sampling, at most ``max_retries`` times.

    Retry k samples at the job's temperature times ``retry_temperature_scale**k`` with a new
    seed; a greedy job retries at ``greedy_retry_temperature`` instead, since greedy decoding
    would repeat the same tokens into the same abort. The last attempt (greedy when
    ``greedy_last``) is never aborted: its output is returned, flagged ``low_confidence`` if
    the rule held on it.
    """

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    threshold: float = Field(default=-3.0, lt=0.0)
    window: int = Field(default=2, ge=1, le=64)
    grace_tokens: int = Field(default=4, ge=0, le=4096)
    max_retries: int = Field(default=2, ge=0, le=5)
    retry_temperature_scale: float = Field(default=0.5, ge=0.0, le=1.0)
    greedy_retry_temperature: float = Field(default=0.7, gt=0.0, le=2.0)
    greedy_last: bool = True


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="VQUEUE_", env_file=".env", extra="ignore")

    # -- where jobs and results live
    broker_url: str = "redis://127.0.0.1:6379/0"
    # defaults to broker_url; Celery's own result backend (Flower, AsyncResult)
    result_backend: str | None = None
    # the Celery queue jobs go to and workers consume (QUEUE_PATTERN: a name, never another
    # queue's urgent or per-worker list)
    queue: str = Field(default="vqueue", pattern=QUEUE_PATTERN)
    key_prefix: str = "vqueue"  # prefix of the Redis keys holding batches and results
    result_ttl_s: int = 7 * 24 * 3600  # batches and their results expire after a week
    # -- the result cache (worker/cache.py): a greedy or seeded job whose answer is already
    # known, for the same tenant, model, prompt and parameters, is answered without the engine
    result_cache: bool = True
    result_cache_ttl_s: int = Field(default=7 * 24 * 3600, ge=1)
    # the cache's own bound in bytes (the queue's Redis runs noeviction): past it, new answers
    # are not stored until old ones expire
    result_cache_max_bytes: int = Field(default=1 << 30, ge=0)
    # a Redis of its own for the cache; "": the result backend's
    result_cache_url: str = ""
    # Redis redelivers an unacknowledged job after this; must exceed job_timeout_s
    visibility_timeout_s: int = 3600
    # a batch sealed and not complete, with nothing queued or running and no new result for
    # the visibility timeout and this long, has lost jobs (a worker killed as it took one off
    # its list): a follower with its input (`vqueue submit --wait`, `vqueue serve`) sends
    # those again
    lost_job_grace_s: float = Field(default=60.0, ge=0)
    # a job still generating after this is aborted in the engine and fails with "timeout"
    job_timeout_s: float = Field(default=900.0, gt=0)
    # a job whose worker died this many times while running it is dead-lettered, not run again
    max_deliveries: int = Field(default=3, ge=1)
    # clients retry a lost Redis connection (restart, AOF reload) for about this long
    redis_retry_s: float = Field(default=120.0, ge=0)

    # -- the model and the engine (worker side)
    model: str = "smollm2-135m-instruct"  # the embedded default; else any HF id or local path
    # the names requests may give this model, comma-separated, as vLLM's --served-model-name:
    # the first is the one results report; unset, the model itself (``served_names``)
    served_model_name: str | None = None
    # what the model does: "generate" text (summarize, extract, codegen, chat jobs) or "pooling"
    # (embed jobs), as vLLM's --runner; "auto": from the model's architecture, as vLLM decides
    # (worker/models.py: model_runner). A pooling worker serves embed jobs only
    runner: Literal["auto", "generate", "pooling"] = "auto"
    # changes to the model's Hugging Face config, as vLLM's --hf-overrides (JSON):
    # '{"matryoshka_dimensions": [768, 256]}' lets embed jobs ask for those dimensions
    hf_overrides: dict[str, Any] = Field(default_factory=dict)
    # LoRA adapters this worker serves beside its model, `name=path` comma-separated (a local
    # directory as peft saves one); a job naming an adapter is answered with it, and routed to
    # workers serving it. Empty: no LoRA (vLLM's enable_lora stays off)
    lora_adapters: str = ""
    max_loras: int = Field(default=4, ge=1, le=64)  # adapters in one engine step (vLLM's)
    max_lora_rank: int = Field(default=16, ge=1, le=512)  # the largest rank served (vLLM's)
    # vLLM's tool-call parser for chat jobs with tools and tool_choice auto (its
    # --tool-call-parser: hermes, llama3_json, mistral, ...); unset, such answers stay text
    tool_call_parser: str | None = None
    max_model_len: int = 4096
    gpu_memory_utilization: float = Field(default=0.9, gt=0.0, le=1.0)
    # KV cache size in bytes; overrides gpu_memory_utilization (on CPU it is what to set)
    kv_cache_memory_bytes: int | None = None
    # sequences per engine step; None: per device, vLLM's offline defaults, which is what a
    # batch system runs (worker/vllm_ext/configure.py: device_max_num_seqs): 1024 on GPUs of
    # 70 GiB and more except the A100, 256 elsewhere and on CPUs
    max_num_seqs: int | None = Field(default=None, ge=1)
    max_num_batched_tokens: int | None = None
    # the order vLLM's scheduler admits waiting requests in: "priority" by the job's priority
    # (9 first), then arrival; "fcfs" by arrival alone. Under KV-cache pressure "priority" also
    # preempts the lowest-priority running request (its tokens are recomputed later)
    scheduling_policy: Literal["priority", "fcfs"] = "priority"
    # how vLLM loads weights; "dummy" makes random ones from the config alone, which is how the
    # GPU benchmarks run a 7B-shaped model without its files (never for real work)
    load_format: Literal["auto", "dummy"] = "auto"
    dtype: Literal["auto", "float16", "bfloat16", "float32"] = "auto"
    # weights' quantization as vLLM names it (awq, gptq, fp8, bitsandbytes, ...); None: as the
    # checkpoint says. A .gguf VQUEUE_MODEL is dequantized on load instead (worker/models.py).
    quantization: str | None = None
    # the KV cache's element type: "auto" as the model computes; "fp8" (e4m3 on Hopper) halves
    # each token's cache, so twice the tokens fit in the same memory (CUDA GPUs)
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] = "auto"
    # vLLM's attention backend by its name (FLASH_ATTN, TRITON_ATTN, FLEX_ATTENTION, ...);
    # None: vLLM picks for the device
    attention_backend: str | None = None
    # GiB of weights kept in CPU memory and streamed to the GPU each step (a model too big for it)
    cpu_offload_gb: float = Field(default=0.0, ge=0)
    tensor_parallel_size: int = Field(default=1, ge=1)  # `--gpus 0,1` sets it from the GPU count
    # None: auto. Eager on CPU hosts (compiling costs minutes per start there), compiled with
    # CUDA graphs on GPUs. True/False force it.
    enforce_eager: bool | None = None
    enable_prefix_caching: bool = True
    seed: int = 0
    # the first job of a prefix group prefills alone; its siblings wait (at most this long) for
    # its first token, then find the prefix cached (worker/engine.py: EngineHost._gate). Off:
    # vLLM's V1 scheduler already shares a prefix among requests scheduled in one step
    prefix_gating: bool = False
    prefix_gate_timeout_s: float = Field(default=30.0, ge=0)
    # guided decoding backend: llguidance covers the widest JSON Schema subset and compiles
    # grammars lazily; "xgrammar" is the alternative
    structured_outputs_backend: str = "guidance"
    # each distinct JSON Schema is compiled once by the worker, bounded by this; a schema that
    # takes longer fails its jobs with schema_compile_timeout (worker/structured.py)
    schema_compile_timeout_s: float = Field(default=10.0, gt=0)
    # vqueue's vLLM plugin (worker/engine.py: vllm_plugin) batches guided decoding's per-request
    # work in the engine step: masks filled and matchers advanced by llguidance off the GIL,
    # mask rows put in batch order on the device; same tokens as vLLM's own path
    parallel_grammar_masks: bool = True
    # llguidance threads for those masks in the engine process, and the compiled matchers kept
    # per grammar (grammar_reuse); 0: half the cores this process may use, at most 8. Where
    # several workers share a host, about cores / (2 * workers).
    grammar_threads: int = Field(0, ge=0)
    # the plugin also compiles each distinct grammar once per vLLM process and hands each
    # request a copy, where vLLM compiles (and its frontend validates) one per request
    grammar_reuse: bool = True
    # vqueue's patches to vLLM's private internals (the three above, and vLLM 0.26's V2 monitor
    # hook), each installed only on the vLLM releases it was verified on (docs/vllm-compat.md);
    # false runs vLLM's own paths everywhere
    vllm_patches: bool = True

    # -- worker process
    # import path of the engine host; benchmarks/stub_engine.py swaps in an instant stub to
    # measure the queue alone (never for real work)
    engine_class: str = "worker.engine:EngineHost"
    # Celery threads; 0 means 2 * max_num_seqs, so the engine always has its next batch queued
    # (`vqueue worker` resolves an unset max_num_seqs for its device first)
    concurrency: int = 0
    # jobs at this priority or above are urgent: they wait in <queue>.urgent, which a worker
    # takes from beside its other queues, and its urgent process alone, with slots beyond the
    # worker's share of bulk jobs; 10: no job is urgent
    urgent_priority: int = Field(default=9, ge=0, le=10)
    # urgent jobs one worker takes in beyond its share (its urgent process's slots); 0: no
    # urgent process, an urgent job waits for a slot to free (docs/architecture.md)
    urgent_concurrency: int = Field(default=16, ge=0, le=1024)
    # an urgent job waiting in vLLM's line while every slot runs takes the place of a running
    # lower-priority one, which resumes later after recomputing (worker/vllm_ext/scheduler.py);
    # off: it waits for one to finish (with a full bulk batch, up to one answer's generation)
    urgent_preempt: bool = True
    # Celery processes a worker runs for its bulk jobs, each a client of its one engine core
    # (vLLM's client_count, as `vllm serve --api-server-count N`), the worker's concurrency
    # split among them. One process's consumer, chat templates, tokenizer calls and vLLM's
    # output loop share one GIL, and on a GPU short jobs outrun it (docs/benchmarks.md). Unset,
    # `vqueue worker` picks for its device (worker/vllm_ext/configure.py: device_bulk_processes):
    # 4 on a GPU host of 16 cores or more, a quarter of the cores on a smaller one, 1 on a CPU
    # (whose cores the engine needs). Where this vLLM cannot share its core (compat's
    # shared-core gate) one runs, with its share of the concurrency, and says so.
    bulk_processes: int | None = Field(default=None, ge=1, le=16)
    # set by a worker for each of its lanes (internal; worker.app.Lane): its engine core's
    # addresses for that client (worker.vllm_ext.client.CoreAddress), the worker's name, and
    # its pid (the lane exits when it is gone)
    engine_client: str = ""
    urgent_of: str = ""
    urgent_owner: int = 0
    lane: Literal["", "urgent", "bulk"] = ""  # which of its worker's lanes this process is
    gpus: str | None = None  # CUDA_VISIBLE_DEVICES for this worker
    heartbeat_s: float = 5.0  # how often a worker refreshes its liveness key
    log_stats_s: float = 10.0  # how often the engine logs vLLM's stats line; 0 turns it off
    # Prometheus /metrics (vqueue_* and vLLM's vllm:*); 0 turns it off. `vqueue worker --gpus N`
    # adds N, so one worker per GPU on a host gets its own port.
    metrics_port: int = Field(default=9808, ge=0, le=65535)
    # loopback: the metrics name batches, workers and load, for the operator's scraper alone;
    # 0.0.0.0 where the scraper is on another host or container (docker-compose.yml)
    metrics_host: str = "127.0.0.1"
    # Celery task events (received, started, succeeded) from the start. Off, a monitor turns
    # them on when it watches (Flower does every 5 s): each job's three events cost a large
    # share of a busy consumer thread (docs/benchmarks.md).
    task_events: bool = False

    # how often Python hands the GIL between the worker's threads (worker/app.py); Python's own
    # 5 ms makes every Redis round trip wait behind whichever thread computes
    gil_switch_ms: float = Field(default=0.25, gt=0, le=100)
    # task threads that may tokenize at once; 0: a quarter of the cores, 2 to 8 (prompts.py:
    # unbounded, hundreds of threads tokenizing long documents starve vLLM's own processes)
    tokenizer_threads: int = Field(default=0, ge=0)

    # -- prompts and inputs, per job type
    # system prompts: short, since every token of them is prefilled for every job; "" drops the
    # system turn (the job's instruction is in the user turn anyway). A job's `system` wins.
    system_summarize: str = "You summarize text accurately and concisely."
    system_extract: str = "You extract facts from text as JSON."
    system_codegen: str = "You write correct, complete code."
    # strip zero-width characters, BOMs, control characters and pasted styling before tokenizing
    clean_input: bool = True
    # the longest document (summarize/extract text, codegen context; chat: the whole prompt) a
    # job may bring, in the model's tokens; the seed notes' limits. max_model_len bounds it too.
    max_input_tokens_summarize: int = Field(default=32768, ge=1)
    max_input_tokens_extract: int = Field(default=65536, ge=1)
    max_input_tokens_codegen: int = Field(default=131072, ge=1)
    max_input_tokens_chat: int = Field(default=8192, ge=1)
    max_input_tokens_embed: int = Field(default=32768, ge=1)  # each text's; and the model's
    truncation_summarize: Truncation = "head_tail"
    truncation_extract: Truncation = "head"
    truncation_codegen: Truncation = "tail"
    truncation_chat: Literal["reject"] = "reject"  # a conversation is never cut
    # a text over the embedding model's length fails, as OpenAI's and vLLM's servers refuse it;
    # "head" embeds its beginning instead (a job's `truncation`, a line's truncate_prompt_tokens)
    truncation_embed: Truncation = "reject"

    # -- per-type output budgets when a job sets no max_tokens
    max_tokens_summarize: int = 256
    max_tokens_extract: int = 512
    max_tokens_codegen: int = 512
    max_tokens_chat: int = 512

    # -- codegen jobs with tests (worker/sandbox.py): each answer runs against its tests in a
    # bubblewrap sandbox with these limits; a failing answer is sampled again (a new seed, at
    # codegen_retry_temperature when the job is greedy) up to the job's max_attempts
    test_timeout_s: float = Field(default=10.0, gt=0, le=600)
    test_memory_mb: int = Field(default=512, ge=64)
    test_output_bytes: int = Field(default=65536, ge=1024)
    # programs run at once per worker process; 0: one per core
    test_concurrency: int = Field(default=0, ge=0)
    codegen_retry_temperature: float = Field(default=0.8, gt=0.0, le=2.0)

    # -- logprob early stop (worker/confidence.py; docs/early-stop.md)
    # load the in-engine confidence monitor; off: no job is monitored, whatever its policy
    confidence_monitor: bool = True
    # how monitored jobs are watched: "auto" the in-engine monitor where the installed vLLM
    # takes it, else vLLM's own logprobs; "logprobs" always the latter (portable, slower)
    early_stop_path: Literal["auto", "logprobs"] = "auto"
    # per-type policies, as JSON (VQUEUE_EARLY_STOP_CODEGEN='{"threshold": -4}'); a job's
    # early_stop field overrides them. Code has legitimately uncertain names, hence a longer
    # window there; extraction is held in shape by its grammar, so it is off unless asked for.
    early_stop_summarize: EarlyStop = EarlyStop()
    early_stop_extract: EarlyStop = EarlyStop(enabled=False)
    early_stop_codegen: EarlyStop = EarlyStop(window=3, grace_tokens=8)
    early_stop_chat: EarlyStop = EarlyStop()

    # -- loops (worker/loops.py; docs/quality.md): a generation whose last tokens repeat one
    # cycle of up to loop_max_cycle_tokens tokens loop_min_repeats times in a row (the same
    # array item again and again, one sentence over and over) is ended in the engine by vLLM's
    # repetition detection (answered by worker/vllm_ext/loops.py where docs/vllm-compat.md
    # lists it; elsewhere vLLM's own check covers cycles of up to 32 tokens unless this is set,
    # its cost growing with the range), and the job runs again with a frequency penalty on its
    # own tokens,
    # at most loop_retries times. A model is confident while it loops, so the logprob rule
    # does not see it. "json": only jobs that must return JSON; off: never. Jobs with
    # ignore_eos ask for a fixed length and are never cut.
    loop_detection: Literal["all", "json", "off"] = "all"
    loop_max_cycle_tokens: int = Field(default=256, ge=2, le=1024)
    loop_min_repeats: int = Field(default=3, ge=2, le=64)
    loop_retries: int = Field(default=1, ge=0, le=5)
    loop_retry_frequency_penalty: float = Field(default=0.5, gt=0.0, le=2.0)

    @field_validator("broker_url", "result_backend")
    @classmethod
    def _a_redis_url(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("redis://", "rediss://", "unix://")):
            scheme, sep, _ = v.partition("://")  # the rest may hold a password
            bare = v.rpartition("@")[2][:40]  # without what may be a user and password
            given = f"{scheme[:20]}://..." if sep else f"{bare!r}, which names no scheme"
            raise ValueError(f"must be a Redis URL (redis://, rediss://, unix://), not {given}")
        return v

    @field_validator("queue")
    @classmethod
    def _not_an_urgent_queue(cls, v: str) -> str:
        if v.endswith(".urgent"):
            raise ValueError(f"{v!r} is the urgent queue of {v.removesuffix('.urgent')!r}")
        return v

    @model_validator(mode="after")
    def _check(self) -> Settings:
        if self.visibility_timeout_s <= self.job_timeout_s:
            raise ValueError(
                f"VQUEUE_VISIBILITY_TIMEOUT_S ({self.visibility_timeout_s}) must exceed "
                f"VQUEUE_JOB_TIMEOUT_S ({self.job_timeout_s}): Redis would hand a running job "
                "to a second worker"
            )
        return self

    # -- admission at submit (producers)
    tenant: str = Field(default="default", min_length=1, max_length=128)  # whose jobs these are
    # jobs/s each tenant may submit (a token bucket in Redis shared by all its producers); 0: no
    # limit. Per-tenant values: VQUEUE_RATE_LIMITS='{"team-a": 500}'.
    rate_limit_per_s: float = Field(default=0.0, ge=0)
    rate_limit_burst: int = Field(default=5000, ge=1)
    rate_limits: dict[str, float] = Field(default_factory=dict)
    # jobs waiting in the queue beyond which submit waits for room (or refuses); 0: no limit
    max_queue_depth: int = Field(default=0, ge=0)
    # a batch's jobs in Redis at once (queued, reserved or running): a bigger input is fed as
    # workers finish jobs, the input file being the buffer, and its feed's place is kept in
    # Redis (a feed whose process died is resumed by submitting the same input again with the
    # batch id). 0: four times what the live workers hold in flight, at least 10,000.
    feed_window: int = Field(default=0, ge=0)
    # jobs one Celery message carries at most: a producer packs a batch's non-urgent jobs of
    # one type and priority up to this many to a message, never more than half the least
    # concurrency among the queue's live workers (``Client.jobs_per_message``), and a worker
    # runs a pack's jobs at once; one job is a pack of one. Celery's consumer spends about the
    # same CPU on a message whatever it carries, so packs take a bulk batch past one
    # consumer's messages a second (docs/reliability.md "Big batches"). A worker still runs,
    # and takes in, about its concurrency in jobs (worker/tasks.py counts its prefetch in jobs).
    jobs_per_message: int = Field(default=16, ge=1, le=256)
    # a canary (`vqueue submit --canary 2%`) runs at least this many lines (all, if fewer)
    canary_min_jobs: int = Field(default=10, ge=1)
    # a canary fails, and its batch pauses, when more of its jobs than this share failed,
    canary_max_failed: float = Field(default=0.10, ge=0, le=1)
    # ... ran away (ended `loop`, or `schema_incomplete`: out of tokens inside the JSON),
    canary_max_runaway: float = Field(default=0.05, ge=0, le=1)
    # ... answered in another script than their input's (Latin, CJK, Cyrillic, ...),
    canary_max_wrong_language: float = Field(default=0.20, ge=0, le=1)
    # ... held the output's low-confidence flag (docs/early-stop.md),
    canary_max_low_confidence: float = Field(default=0.20, ge=0, le=1)
    # or when answers average more than this share of their max_tokens
    canary_max_length: float = Field(default=0.90, ge=0, le=1)
    # send each job to the live worker its prefix key hashes to (rendezvous hashing), so a
    # prefix is computed on one GPU; a worker with this many jobs waiting in its own queue is
    # skipped for the least-loaded one (0: the worker's concurrency)
    prefix_routing: bool = True
    route_spill_depth: int = Field(default=0, ge=0)
    # a job naming a model no live worker serves: fail it (model_not_found, OpenAI's 404), let
    # it wait in the model's own queue (<queue>~<model>) for a worker serving it to start, or
    # run it on the worker's default model ("default": OpenAI batch files written for another
    # service, `"model": "gpt-4o-mini"` on every line, run unchanged; results name the model
    # that answered)
    unserved_model: Literal["fail", "wait", "default"] = "fail"
    # OpenAI lines may carry vLLM's own request fields (top_k, min_p, guided_json, ...; the
    # list is schemas/openai.py's VLLM_FIELDS), as vLLM's server takes them; true refuses
    # them as OpenAI's API does, each such request failing alone (unsupported_parameter)
    openai_strict: bool = False
    # what a producer does at a limit: wait (with a message on stderr) or refuse (exit 7)
    on_limit: Literal["wait", "refuse"] = "wait"
    # whether guided decoding can enforce a job's JSON Schema is asked of llguidance in child
    # processes (producer/grammar_check.py): this many at once per producer process, one tenant
    # holding at most half of them; each killed past the time limit, and aborted past the
    # memory limit (its address space). Either refuses the schema.
    schema_check_processes: int = Field(default=4, ge=1, le=64)
    schema_check_timeout_s: float = Field(default=5.0, gt=0)
    schema_check_memory_mb: int = Field(default=1024, ge=64)

    # -- waiting for results (`--wait`, Batch.results): give up, saying why (exit 8), when no
    # live worker has consumed the batch's queue for this long, or the batch has had no new
    # result for this long; 0: never. The jobs stay queued either way.
    wait_no_worker_s: float = Field(default=600.0, ge=0)
    wait_stall_s: float = Field(default=3600.0, ge=0)

    # -- the HTTP API (`vqueue serve`, producer/http/; docs/http-api.md)
    # where uploaded input files and written output files are kept ("" : the user cache)
    files_dir: str = ""
    # an upload past this many bytes is refused, and a batch over a file of more requests:
    # OpenAI's own limits by default (200 MB, 50,000), raised for bulk work
    max_file_bytes: int = Field(default=200 * 1024**2, ge=1)
    api_max_batch_requests: int = Field(default=50_000, ge=1)
    api_poll_s: float = Field(default=1.0, gt=0)  # how often open batches are moved along
    # a batch's output and error files are deleted this long after they are written, unless
    # the batch asks otherwise (``output_expires_after``); uploads keep until deleted unless
    # they ask (``expires_after``). OpenAI keeps batch outputs 30 days
    api_output_ttl_s: int = Field(default=30 * 24 * 3600, ge=3600)
    # one server process checks and submits a batch's input, holding a lease it renews; when
    # that process dies, another resumes the feed this long after, from where it stopped
    api_feed_lease_s: float = Field(default=30.0, ge=1)
    # each HTTP tenant's quotas: files kept and their bytes (uploads and outputs), batches not
    # yet ended, and jobs those batches have not finished. Past one, an upload or a batch is
    # refused (429 ``quota_exceeded``), or a batch that would pass the jobs' quota fails
    api_max_files: int = Field(default=1000, ge=1)
    api_max_stored_bytes: int = Field(default=20 * 1024**3, ge=1)
    api_max_open_batches: int = Field(default=100, ge=1)
    api_max_open_jobs: int = Field(default=1_000_000, ge=1)
    # the highest priority and the largest max_tokens an HTTP tenant's job may ask for (9 is
    # urgent: VQUEUE_URGENT_PRIORITY); a line past either is refused. Per tenant:
    # VQUEUE_API_PRIORITY_CEILINGS='{"ops": 9}', VQUEUE_API_TOKEN_BUDGETS='{"ops": 32768}'
    api_max_priority: int = Field(default=8, ge=0, le=9)
    api_max_tokens: int = Field(default=8192, ge=1)
    api_priority_ceilings: dict[str, int] = Field(default_factory=dict)
    api_token_budgets: dict[str, int] = Field(default_factory=dict)

    def backend_url(self) -> str:
        return self.result_backend or self.broker_url

    def served_names(self) -> list[str]:
        """The names a request's ``model`` may give this worker's model, the reported one first.
        As vLLM's server: the served names when set (the model's own id or path is then not one
        of them: a file written for another provider's model runs once its name is listed),
        else the model as configured."""
        names = [n.strip() for n in (self.served_model_name or "").split(",") if n.strip()]
        return names or [self.model]

    def adapters(self) -> dict[str, str]:
        """``lora_adapters`` as name -> path; ``ValueError`` naming the entry that is not
        ``name=path``, a name given twice, or a name the model itself is served as."""
        out: dict[str, str] = {}
        for entry in filter(None, (e.strip() for e in self.lora_adapters.split(","))):
            name, eq, path = (x.strip() for x in entry.partition("="))
            if not eq or not name or not path:
                raise ValueError(f"VQUEUE_LORA_ADAPTERS: {entry!r} is not name=path")
            if name in out or name in self.served_names():
                raise ValueError(f"VQUEUE_LORA_ADAPTERS: the name {name!r} is taken")
            out[name] = path
        return out

    def worker_concurrency(self) -> int:
        """Jobs the worker holds at once (its urgent process's slots are beyond these)."""
        return self.concurrency or 2 * (self.max_num_seqs or 256)

    def bulk_share(self) -> int:
        """Each bulk process's jobs at once: the worker's concurrency split among them."""
        return max(1, -(-self.worker_concurrency() // (self.bulk_processes or 1)))

    def default_max_tokens(self, job_type: str) -> int:
        return int(getattr(self, f"max_tokens_{job_type}"))

    def early_stop(self, job_type: str) -> EarlyStop:
        value: EarlyStop = getattr(self, f"early_stop_{job_type}")
        return value

    def system_prompt(self, job_type: str) -> str:
        return str(getattr(self, f"system_{job_type}", ""))

    def max_input_tokens(self, job_type: str) -> int:
        return int(getattr(self, f"max_input_tokens_{job_type}"))

    def truncation(self, job_type: str) -> Truncation:
        value: Truncation = getattr(self, f"truncation_{job_type}")
        return value

    def tenant_rate(self, tenant: str) -> float:
        return self.rate_limits.get(tenant, self.rate_limit_per_s)

    def priority_ceiling(self, tenant: str) -> int:
        return self.api_priority_ceilings.get(tenant, self.api_max_priority)

    def token_budget(self, tenant: str) -> int:
        return self.api_token_budgets.get(tenant, self.api_max_tokens)


def get_settings() -> Settings:
    return Settings()


def cache_dir() -> Path:
    """vqueue's cache (converted models, the HTTP API's files): ``$VQUEUE_CACHE_DIR`` or
    ``$XDG_CACHE_HOME/vqueue``."""
    root = os.environ.get("VQUEUE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "vqueue"
    )
    return Path(root)


# what a name-shaped setting may be, in words, where its pattern would say it in a regex
_PATTERN_WORDS = {
    "queue": "1 to 128 letters, digits, '_', '.' or '-', the first a letter or digit",
}


def describe_settings_error(exc: ValidationError, given: dict[str, str] | None = None) -> str:
    """``VQUEUE_DTYPE: Input should be ...; ...``: what to fix, named as the user set it: the
    env var, or the option in ``given`` (field -> ``--queue``) that carried the value."""
    parts = []
    for err in exc.errors(include_url=False):
        msg = err["msg"].removeprefix("Value error, ")
        field = str(err["loc"][0]) if err["loc"] else ""
        if err["type"] == "string_pattern_mismatch" and field in _PATTERN_WORDS:
            msg = f"must be {_PATTERN_WORDS[field]}, not {err['input']!r}"
        if err["loc"]:
            name = (given or {}).get(field) or "VQUEUE_" + "_".join(map(str, err["loc"])).upper()
            msg = f"{name}: {msg}"
        parts.append(msg)
    return "; ".join(parts)
