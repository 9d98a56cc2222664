"""One job, start to finish: prompt, sampling, generation, checking the output, the result.

Everything that can go wrong with one job ends as a failed ``JobResult`` naming the cause; only
a broken engine or lost Redis escapes as an exception (and then the task is redelivered).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time
from typing import Any

from schemas import (
    Attempt,
    ChatJob,
    Choice,
    CodegenJob,
    EarlyStop,
    EmbedJob,
    Envelope,
    ExtractJob,
    JobError,
    JobResult,
    Settings,
    Timings,
    Usage,
)
from schemas.results import TestAttempt, TestReport

from .answers import _read_output, _schema_of, _tool_calls, _wants_json
from .budget import MIN_ANSWER_TOKENS, clean_job, fit_input
from .cache import ResultCache, answered_from_cache, determined
from .confidence import Monitor
from .embeddings import run_embed
from .engine import Engine, Generation
from .errors import EngineError, JobFailed, JobTimeout, JobWithdrawn
from .loops import (
    _as_loop,
    loop_detection,
)
from .prompts import build_messages, special_token_in
from .sampling import early_stop_policy, retry_sampling, retry_seed, sampling_params
from .sandbox import run_tests, sandbox_problem
from .structured import (
    GrammarCheck,
    Templates,
    apply_template,
    generation_schema,
    schema_token_budget,
)

log = logging.getLogger(__name__)

# Failures that are the answer itself, which the same job run again repeats (the result cache
# keeps them); a time-out, an engine error or a withdrawn batch say nothing of the answer.
REPEATED_FAILURES = {
    "schema_incomplete",
    "schema_validation",
    "invalid_json",
    "loop",
    "tests_failed",
}


def run_job(
    env: Envelope,
    engine: Engine,
    settings: Settings,
    worker: str,
    templates: Templates | None = None,
    cache: ResultCache | None = None,
) -> JobResult:
    job = env.job
    started = time.time()
    # One deadline for the whole job, every attempt included (early-stop retries, a cut-off JSON
    # run again with more room): the job can never outlive VQUEUE_JOB_TIMEOUT_S, which the
    # settings keep below the visibility timeout, so Redis never hands it to a second worker.
    deadline = time.monotonic() + min(
        job.timeout_s or settings.job_timeout_s, settings.job_timeout_s
    )
    result = JobResult(
        id=job.id,
        batch=env.batch,
        type=job.type,
        status="completed",
        line=env.line,
        timings=Timings(enqueued_at=env.enqueued_at, started_at=started),
        worker=worker,
        metadata=job.metadata,
        format=env.format,
        # its reported name, whichever of its names the line gave; an adapter's own
        model=env.model if env.model in engine.adapters else engine.model_name,
        prefix_key=env.prefix_key,
    )
    refused = _refused(env, engine, settings)
    if refused is not None:  # the request fails alone, before the engine sees it
        result.status, result.error = "failed", refused
        result.timings.finished_at = time.time()
        return result
    try:
        if isinstance(job, EmbedJob):
            run_embed(env, engine, settings, deadline, result, cache)
            result.timings.finished_at = time.time()
            return result
        plan = plan_job(env, engine, settings, deadline, result, templates)
        job = plan.job
        key = ""  # the job's result-cache key, when it has one
        if cache is not None and env.cache and job.cache and determined(job):
            key = cache.key(job, result.model or "", env.format, plan.prompt, plan.max_tokens)
            if answered_from_cache(cache, env.tenant, key, deadline, result, job.type):
                result.timings.finished_at = time.time()
                return result
        _run_kept(plan, result, cache if key else None, env.tenant, key)
    except JobFailed as exc:
        result.status = "failed"
        result.error = JobError(type=exc.type, message=exc.message)
    except EngineError as exc:
        result.status = "failed"
        result.error = JobError(type="engine_error", message=str(exc))
    except JobTimeout as exc:
        result.status = "failed"
        result.error = JobError(type="timeout", message=_timed_out(env, settings, result, exc))
    except JobWithdrawn as exc:
        result.status = "failed"
        result.error = JobError(type=exc.reason, message=str(exc))  # type: ignore[arg-type]
    result.timings.finished_at = time.time()
    return result


@dataclasses.dataclass(frozen=True)
class JobPlan:
    """What every run of one job shares, decided once before the first: the job as it goes to
    the engine (cleaned, templated, fitted), its prompt's token ids, its answer's budget, its
    grammar, deadline and early-stop and loop policies. A later run changes only what it must
    (``then``): more room for a cut-off JSON answer, a new seed for a retry, no
    prefix key once the first run has placed the prefix."""

    job: Any
    engine: Engine
    settings: Settings
    prompt: list[int]
    max_tokens: int
    room: int  # the context left after the prompt: the most any answer may take
    grammar: dict[str, Any] | None  # the schema guided decoding compiles
    deadline: float  # monotonic: every run of the job ends by it
    prefix_key: str | None  # the first run's, for the engine's prefix grouping
    salt: str | None  # the tenant: vLLM's ``cache_salt``
    batch: str
    lora: Any
    policy: EarlyStop | None  # None: the job is not monitored
    loops: Any  # vLLM's ``RepetitionDetectionParams``, None where loops are not watched

    def then(self, **changes: Any) -> JobPlan:
        """The plan of a later run: no prefix key (the first run placed it), and ``changes``."""
        return dataclasses.replace(self, prefix_key=None, **changes)


def plan_job(
    env: Envelope,
    engine: Engine,
    settings: Settings,
    deadline: float,
    result: JobResult,
    templates: Templates | None = None,
) -> JobPlan:
    """The job as its runs will share it: its text cleaned, its template applied, its schema's
    grammar checked, its input fitted to the budget, its prompt rendered to token ids; what was
    cut or cleaned is noted in ``result``. A job that cannot run raises ``JobFailed`` before
    the engine sees it."""
    job = env.job
    assert not isinstance(job, EmbedJob), "an embed job is pooled, not planned (run_embed)"
    if settings.clean_input:
        job, result.input_chars_cleaned = clean_job(job)
    examples: list[Any] = []
    if isinstance(job, ExtractJob):
        job, examples = apply_template(job, templates, env.tenant)
    schema = _schema_of(job)
    grammar = generation_schema(schema) if schema is not None else None
    if grammar is not None and _grammar_checked(engine, settings):
        _grammar_check(engine, settings).check(grammar)
    want = job.max_tokens or (
        schema_token_budget(schema, settings.default_max_tokens(job.type))
        if schema is not None
        else settings.default_max_tokens(job.type)
    )
    job, result.input_tokens_truncated, known = fit_input(job, engine, settings, want)
    if isinstance(job, ChatJob) and job.prompt is not None:
        prompt = engine.completion_prompt(job.prompt)
    else:
        messages = build_messages(job, settings, examples)
        tools = _template_tools(job, engine)
        # a long document was encoded to measure it: its ids go into the prompt as they are
        prompt = engine.chat_prompt(messages, known, tools)
    if isinstance(job, ChatJob):  # a conversation fits its limit or is refused, never cut
        limit = job.max_input_tokens or settings.max_input_tokens(job.type)
        if len(prompt) > limit:
            raise JobFailed(
                "input_too_long", f"the chat is {len(prompt)} tokens; the limit is {limit}"
            )
    room = settings.max_model_len - len(prompt)
    if room < MIN_ANSWER_TOKENS:
        raise JobFailed(
            "prompt_too_long",
            f"the prompt is {len(prompt)} tokens; the model's context is "
            f"{settings.max_model_len} and the answer needs at least {MIN_ANSWER_TOKENS}",
        )
    return JobPlan(
        job=job, engine=engine, settings=settings, prompt=prompt, max_tokens=min(want, room),
        room=room, grammar=grammar, deadline=deadline, prefix_key=env.prefix_key,
        salt=env.tenant, batch=env.batch, lora=engine.adapters.get(result.model or ""),
        policy=early_stop_policy(job, settings), loops=loop_detection(job, settings, engine.plan),
    )  # fmt: skip


def _refused(env: Envelope, engine: Engine, settings: Settings) -> JobError | None:
    """Why the request cannot run here at all (a parameter this engine does not take, a model
    it does not serve), or None."""
    job = env.job
    if isinstance(job, ChatJob | EmbedJob) and job.unsupported is not None:
        u = job.unsupported
        return JobError(type="unsupported_parameter", message=u.message, param=u.param)
    if (
        env.model is not None
        and env.model not in engine.model_names
        and settings.unserved_model != "default"  # else it runs on the served model
    ):
        names = ", ".join(f"`{n}`" for n in engine.model_names)
        return JobError(type="model_not_found", param="model", message=(
            f"The model `{env.model}` does not exist. This queue's workers serve {names} "
            "(VQUEUE_SERVED_MODEL_NAME)."))  # fmt: skip
    if (job.type == "embed") != (engine.runner == "pooling"):  # routed by its model's name
        what = "embeddings" if job.type == "embed" else f"{job.type} jobs"
        kind = "an embedding (pooling)" if engine.runner == "pooling" else "a generating"
        return JobError(type="wrong_model_kind", param="model", message=(
            f"The model `{engine.model_name}` does not support {what}: it is {kind} model. "
            "Name a model that a worker of the other kind serves."))  # fmt: skip
    return None


def _run_kept(
    plan: JobPlan, result: JobResult, keeper: ResultCache | None, tenant: str | None, key: str
) -> None:
    """Run the plan; a completed answer, or a failure that is the answer itself, goes to
    ``keeper`` (the result cache that holds the job's claim), whose claim is let go."""
    try:
        _run(plan, result)
    except JobFailed as exc:
        if keeper is not None and exc.type in REPEATED_FAILURES:  # its answer, failed
            result.status = "failed"
            result.error = JobError(type=exc.type, message=exc.message)  # type: ignore[arg-type]
            keeper.put(tenant, key, result)
        raise
    else:
        if keeper is not None and result.status == "completed":
            keeper.put(tenant, key, result)
    finally:
        if keeper is not None:
            keeper.release(tenant, key)


def _run(plan: JobPlan, result: JobResult) -> None:
    """Generate and check the job's answer into ``result`` (a failure raises)."""
    job = plan.job
    if isinstance(job, ChatJob) and job.n > 1:
        _choices(plan, result)
    elif isinstance(job, CodegenJob) and job.tests is not None:
        _tested(plan, result)
    else:
        _answer(plan, result)
    engine = plan.engine
    if isinstance(job, ChatJob) and (
        job.forces_call() or (job.tools and job.tool_choice != "none" and engine.tool_calls)
    ):
        _tool_calls(job, engine.tool_calls, result)


def _timed_out(env: Envelope, settings: Settings, result: JobResult, exc: JobTimeout) -> str:
    """What a timeout came to, in the terms a user reads it in: the budget is the whole job's
    at this worker (every attempt, and the wait in the engine's queue behind the worker's
    other jobs), counted from its start here, not from its submission."""
    now = time.time()
    budget = min(env.job.timeout_s or settings.job_timeout_s, settings.job_timeout_s)
    ran = now - (result.timings.started_at or now)
    attempts = max(len(result.attempts), 1)
    age = f", {now - env.enqueued_at:.0f}s after it was submitted" if env.enqueued_at else ""
    return (
        f"the job's {budget:g}s budget (its timeout_s, at most VQUEUE_JOB_TIMEOUT_S) ran out "
        f"{ran:.1f}s into its run at this worker{age}, after {attempts} attempt(s), waits in the "
        f"engine's queue included: {exc}"
    )


def _template_tools(job: Any, engine: Engine) -> list[dict[str, Any]] | None:
    """A chat job's tools as its chat template takes them. A tool, or an earlier turn's tool
    call, that spells one of the model's special tokens fails the job: the template writes
    both into its own text (``prompts.special_token_in``: why)."""
    if not isinstance(job, ChatJob):
        return None
    tools = [t.model_dump(exclude_none=True) for t in job.tools or []]
    calls = [c.model_dump() for m in job.messages for c in m.tool_calls or []]
    if not tools and not calls:
        return None
    found = special_token_in(engine.tokenizer, [tools, calls])
    if found:
        raise JobFailed("invalid_job", f"tools: a tool or tool call spells the model's special "
                        f"token {found!r}")  # fmt: skip
    return tools or None


def _answer(plan: JobPlan, result: JobResult) -> None:
    """The job's answer into ``result``: generated, run once more if its JSON was cut off with
    room left, and checked (``_read_output``); a failure raises ``JobFailed``."""
    gen = generate(plan, result)
    cut, max_tokens = 0, plan.max_tokens
    if _wants_json(plan.job) and gen.finish_reason == "length" and plan.room > max_tokens:
        # JSON cut off: once more with twice the room; what the first run wrote is lost
        cut = gen.completion_tokens
        max_tokens = min(2 * max_tokens, plan.room)
        result.timings.previous_finished_at = gen.finished_at
        gen = generate(plan.then(max_tokens=max_tokens), result)
    result.text = gen.text
    result.finish_reason = gen.finish_reason
    result.logprobs = gen.logprobs
    thrown = [a.tokens for a in result.attempts if a.reason in ("low_confidence", "loop")]
    if result.attempts and result.attempts[-1].reason == "loop":
        thrown.pop()  # every run looped: the last is the answer (its text kept), not waste
    result.usage = Usage(
        prompt_tokens=gen.prompt_tokens,
        completion_tokens=gen.completion_tokens,
        cached_tokens=gen.cached_tokens,
        wasted_tokens=cut + sum(thrown),
    )
    t = result.timings
    t.sent_at, t.submitted_at, t.scheduled_at = gen.sent_at, gen.submitted_at, gen.scheduled_at
    t.first_token_at, t.preemptions = gen.first_token_at, gen.preemptions
    _read_output(plan.job, gen.text, gen.finish_reason, result, max_tokens, cut)


def _tested(plan: JobPlan, result: JobResult) -> None:
    """A codegen job with tests: answer, run the answer's code against the tests in the
    sandbox, and answer again (a new seed; a greedy job samples at
    ``codegen_retry_temperature``) until one passes or ``max_attempts`` have run. The result
    holds the passing answer, or the last, and every run in ``result.tests``; the tokens of
    answers thrown away count as wasted."""
    problem = sandbox_problem()
    if problem is not None:
        raise JobFailed("sandbox_unavailable", f"this worker cannot run tests: {problem}")
    job, settings = plan.job, plan.settings
    result.tests = report = TestReport(passed=False, attempts=[])
    thrown = 0
    for k in range(job.max_attempts):
        run = plan
        if k:
            thrown += result.usage.completion_tokens + result.usage.wasted_tokens
            result.timings.previous_finished_at = time.time()
            seed = retry_seed(job, k)
            temperature = job.temperature or settings.codegen_retry_temperature
            run = plan.then(job=job.model_copy(update={"seed": seed, "temperature": temperature}))
        _answer(run, result)
        outcome = run_tests(result.code or "", job.tests or "", job.entry_point, settings)
        report.attempts.append(TestAttempt(
            n=k + 1, outcome=outcome.outcome, detail=outcome.detail, seconds=outcome.seconds,
            tokens=result.usage.completion_tokens, temperature=run.job.temperature,
            seed=run.job.seed,
        ))  # fmt: skip
        if outcome.outcome == "passed":
            report.passed = True
            break
    result.usage.wasted_tokens += thrown
    if not report.passed:
        last = report.attempts[-1]
        raise JobFailed("tests_failed", f"no answer passed its tests in {len(report.attempts)} "
                        f"attempt(s); the last {last.outcome}"
                        + (f": {last.detail}" if last.detail else ""))  # fmt: skip


# Threads for a chat job's choices after its first, shared by the worker process's jobs: a job's
# first choice runs in its own task thread, the rest queue here, so n adds requests to the
# engine, never an unbounded number of threads.
_choice_pool: concurrent.futures.ThreadPoolExecutor | None = None
_choice_pool_lock = threading.Lock()


def _choice_threads(settings: Settings) -> concurrent.futures.ThreadPoolExecutor:
    global _choice_pool
    with _choice_pool_lock:
        if _choice_pool is None:
            _choice_pool = concurrent.futures.ThreadPoolExecutor(
                max(4, settings.worker_concurrency()), thread_name_prefix="vqueue-choice"
            )
        return _choice_pool


def _choices(plan: JobPlan, result: JobResult) -> None:
    """OpenAI's ``n``: the prompt answered ``n`` times at once, each its own request (its
    prefix cached after the first) read as a job's one answer is. The first answer is the
    result's own ``text``; all of them are in ``choices``. One choice failing fails the job,
    naming the choice."""
    job = plan.job
    runs = [result] + [result.model_copy(deep=True) for _ in range(job.n - 1)]

    def one(k: int) -> None:
        run = plan if k == 0 else plan.then()
        if job.seed is not None:  # the k-th answer's seed, kept within vLLM's 64 bits
            seed = job.seed + k if job.seed + k < 2**63 else job.seed - k
            run = dataclasses.replace(run, job=job.model_copy(update={"seed": seed}))
        try:
            _answer(run, runs[k])
        except JobFailed as exc:
            raise JobFailed(exc.type, f"choice {k}: {exc.message}") from None

    pool = _choice_threads(plan.settings)
    rest = [pool.submit(one, k) for k in range(1, job.n)]
    try:
        one(0)
    finally:
        concurrent.futures.wait(rest)  # each ends by the job's deadline
    for f in rest:
        f.result()  # the first of the others to fail fails the job
    result.choices = [
        Choice(
            index=k, text=r.text, data=r.data, finish_reason=r.finish_reason, logprobs=r.logprobs
        )
        for k, r in enumerate(runs)
    ]
    result.attempts += [a for r in runs[1:] for a in r.attempts]
    result.low_confidence = any(r.low_confidence for r in runs)
    result.usage = Usage(
        prompt_tokens=result.usage.prompt_tokens,
        cached_tokens=result.usage.cached_tokens,
        completion_tokens=sum(r.usage.completion_tokens for r in runs),
        wasted_tokens=sum(r.usage.wasted_tokens for r in runs),
    )


def generate(plan: JobPlan, result: JobResult) -> Generation:
    """Generate the job's answer. The engine ends a generation that loops (``plan.loops``);
    the job then runs again with a frequency penalty on its own tokens, at most ``loop_retries``
    times, every run recorded in ``result.attempts``; a job that looped in an earlier call (its
    cut-off JSON run again with more room) starts with the penalty, or it loops again from the
    same start. Under early stop each run is itself attempt after attempt until one is not
    aborted. All of them end by ``plan.deadline``."""
    settings = plan.settings
    looped = any(a.reason == "loop" for a in result.attempts)
    penalty = settings.loop_retry_frequency_penalty if looped else 0.0
    run = plan
    for _ in range(settings.loop_retries + 1):
        gen = _attempts(run, result, penalty)
        if gen.finish_reason != "repetition":
            return gen
        penalty = settings.loop_retry_frequency_penalty
        result.timings.previous_finished_at = gen.finished_at
        run = plan.then()
    return gen  # every run looped: the caller reports it


def _attempts(plan: JobPlan, result: JobResult, penalty: float) -> Generation:
    """One run of the job: a single generation, or under early stop attempts until one is not
    aborted. A run is recorded in ``result.attempts`` when the job is monitored, when it
    looped, or when it is the retry after a loop."""
    job, engine, policy = plan.job, plan.engine, plan.policy

    def once(temperature: float, seed: int | None, key: str | None, monitor: Any) -> Generation:
        params = sampling_params(
            job, plan.max_tokens, temperature, seed, plan.grammar, plan.loops, penalty
        )
        return _as_loop(engine.generate(
            plan.prompt, params, _left(plan.deadline), key, monitor, priority=job.priority,
            batch=plan.batch, salt=plan.salt, lora=plan.lora,
        ), plan.loops)  # fmt: skip

    if policy is None:
        temperature, seed = job.temperature, job.seed
        if penalty and job.temperature > 0:  # a sampled job retries with a new seed too
            seed = retry_seed(job, 1)
        gen = once(temperature, seed, plan.prefix_key, None)
        if penalty or gen.finish_reason == "repetition":
            result.attempts.append(_attempt(result, gen, temperature, seed, penalty))
        return gen
    last = policy.max_retries
    for k in range(last + 1):
        temperature, seed = retry_sampling(job, policy, k)
        # vLLM does not stop a request short of min_tokens: no abort before them either
        grace = max(policy.grace_tokens, job.min_tokens)
        monitor = Monitor(policy.threshold, policy.window, grace, abort=k < last)
        gen = once(temperature, seed, plan.prefix_key if k == 0 else None, monitor)
        result.attempts.append(_attempt(result, gen, temperature, seed, penalty))
        if not gen.aborted:
            result.low_confidence = result.attempts[-1].low_confidence
            return gen
        result.timings.previous_finished_at = gen.finished_at
    raise AssertionError("the last attempt is never aborted")  # pragma: no cover


def _attempt(
    result: JobResult, gen: Generation, temperature: float, seed: int | None, penalty: float
) -> Attempt:
    reading = gen.confidence
    reason = gen.finish_reason
    if gen.aborted:
        reason = "low_confidence"
    elif reason == "repetition":
        reason = "loop"
    return Attempt(
        n=len(result.attempts) + 1,
        reason=reason,
        tokens=gen.completion_tokens,
        min_logprob=reading.min_logprob if reading else None,
        mean_logprob=reading.mean_logprob if reading else None,
        temperature=temperature,
        seed=seed,
        low_confidence=bool(reading and reading.fired),
        frequency_penalty=penalty,
    )


def _left(deadline: float) -> float:
    """Seconds until ``deadline``; none left is a timeout before the engine sees the request."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise JobTimeout("the job's time ran out before its next attempt")
    return left


_grammar: GrammarCheck | None = None


def _grammar_checked(engine: Engine, settings: Settings) -> bool:
    """The worker's own compilation is llguidance's, which is what the guidance backend runs,
    on the engine's tokenizer (an engine stub has none to compile against)."""
    return settings.structured_outputs_backend == "guidance" and engine.tokenizer is not None


def warm_grammar_check(engine: Engine, settings: Settings) -> None:
    """At worker start: the schema check's tokenizer, built before the first JSON job needs it
    (``GrammarCheck.warm``)."""
    if engine.runner == "generate" and _grammar_checked(engine, settings):
        _grammar_check(engine, settings).warm()


def _grammar_check(engine: Engine, settings: Settings) -> GrammarCheck:
    """One per worker process, on the engine's tokenizer (built as the process starts)."""
    global _grammar
    if _grammar is None:
        _grammar = GrammarCheck(engine.tokenizer, settings.schema_compile_timeout_s)
    return _grammar
