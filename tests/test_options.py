"""The speed and safety options (docs/configuration.md), each with the real worker and model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis

from producer import Client
from producer.errors import Refused
from schemas import JobResult

from .conftest import KEY_PREFIX, RUN, Procs, WorkerProc, make_settings, run_cli, wait_for

pytestmark = pytest.mark.engine

DOC = (
    "The city council met on Tuesday to discuss the new bus routes. Residents asked for later "
    "evening service, and the transport office promised a trial in the spring. "
) * 20  # about 600 tokens


def _run(client: Client, *jobs: dict[str, Any]) -> dict[str, JobResult]:
    batch = client.submit_many(list(jobs))
    return {r.id: r for r in batch.results(timeout=300)}


def test_system_prompt_per_job_per_batch_or_none(client: Client, tmp_path: Path) -> None:
    # Given the same job with the default system prompt, none, and a verbose one
    base = {"type": "summarize", "text": "Bees make honey.", "max_tokens": 8}
    verbose = "You are a meticulous, experienced assistant. " * 8
    got = _run(
        client,
        {**base, "id": "default"},
        {**base, "id": "none", "system": ""},
        {**base, "id": "verbose", "system": verbose},
    )
    n = {k: r.usage.prompt_tokens for k, r in got.items()}
    # Then no system turn is the shortest prompt and the verbose one the longest
    assert all(r.status == "completed" for r in got.values())
    assert n["none"] < n["default"] < n["verbose"]
    # and `vqueue submit --system` applies to the lines that set none
    src = tmp_path / "jobs.jsonl"
    src.write_text(
        '{"id": "a", "type": "summarize", "text": "Bees make honey.", "max_tokens": 8}\n'
    )
    proc = run_cli("submit", str(src), "--wait", "--json", "-q", "--system", "")
    summary = json.loads(proc.stdout.decode().strip().splitlines()[-1])
    res = client.batch(summary["batch"]).result("a", timeout=60)
    assert res.usage.prompt_tokens == n["none"]


def test_seeded_jobs_among_long_prompts_leave_the_cpu_engine_running(client: Client) -> None:
    # Given sampled jobs with a seed whose prompts together fill several engine steps (on a CPU,
    # a prefill split over steps would make vLLM rewind a generator that cannot rewind)
    text = " ".join(
        f"The river rose {i} metres overnight; the bridge was closed." for i in range(90)
    )
    jobs = [{"id": f"seeded-{i}", "type": "summarize", "text": f"{RUN} {i}: {text}", "seed": 7,
             "temperature": 0.8, "max_tokens": 8} for i in range(10)]  # fmt: skip
    # Then every one is answered, by the same engine
    got = list(client.submit_many(jobs).results(timeout=600))
    assert [r.status for r in got] == ["completed"] * 10, [(r.id, r.error) for r in got]
    assert all(r.usage.prompt_tokens > 1000 for r in got), [r.usage.prompt_tokens for r in got]


def test_input_hygiene_strips_and_counts(client: Client) -> None:
    # Given a text with zero-width characters, a BOM, control characters and pasted spacing
    dirty = "\ufeffBees\u200b make\u00a0\u00a0honey.\x07\x1b  They   live\u200d in hives.\r\n"
    clean = "Bees make honey. They live in hives.\n"
    got = _run(client, {"id": "h", "type": "summarize", "text": dirty, "max_tokens": 8})["h"]
    ref = _run(client, {"id": "c", "type": "summarize", "text": clean, "max_tokens": 8})["c"]
    # Then the job runs on the clean text, and says how much was removed
    assert got.status == "completed" and got.input_chars_cleaned == len(dirty) - len(clean)
    assert got.usage.prompt_tokens == ref.usage.prompt_tokens and ref.input_chars_cleaned == 0
    # while code keeps its indentation and blank lines
    code = "def f(x):\n\n\n    return  x\u200b\n"
    c = _run(
        client,
        {"id": "k", "type": "codegen", "instruction": "Add a docstring.", "context": code,
         "max_tokens": 8},
    )["k"]  # fmt: skip
    assert c.input_chars_cleaned == 1
    # and so does code inside an instruction, indented or fenced, while its prose is cleaned
    signature = 'from typing import List\n\n\ndef f(xs: List[int]) -> int:\n    """Sum  them."""\n'
    fenced = "Make  it faster:  \n```python\ndef g(n):\n\n\n    return  n\n```\n"
    i = _run(
        client,
        {"id": "s", "type": "codegen", "instruction": signature, "max_tokens": 8},
        {"id": "f", "type": "codegen", "instruction": fenced, "max_tokens": 8},
    )
    assert i["s"].input_chars_cleaned == 0
    assert i["f"].input_chars_cleaned == len(" ") + len("  ")  # "Make it faster:\n" only


def test_context_limits_and_truncation_policies(client: Client) -> None:
    # Given one ~600-token document under each policy with a 100-token input limit
    job = {"type": "summarize", "text": DOC, "max_tokens": 8, "max_input_tokens": 100}
    got = _run(
        client,
        {**job, "id": "head", "truncation": "head"},
        {**job, "id": "tail", "truncation": "tail"},
        {**job, "id": "both", "truncation": "head_tail"},
        {**job, "id": "reject", "truncation": "reject"},
        {"type": "summarize", "id": "whole", "text": DOC, "max_tokens": 8},
    )
    # Then the cut ones run on at most 100 document tokens and say how many were cut
    whole = got["whole"]
    assert whole.status == "completed" and whole.input_tokens_truncated == 0
    for k in ("head", "tail", "both"):
        r = got[k]
        assert r.status == "completed", r.error
        assert r.input_tokens_truncated > 400
        assert r.usage.prompt_tokens <= whole.usage.prompt_tokens - r.input_tokens_truncated + 8
    # and reject fails the job by name
    assert got["reject"].error and got["reject"].error.type == "input_too_long"
    assert "limit is 100" in got["reject"].error.message
    # a document longer than the context is cut to fit by the type's default (head_tail)
    huge = _run(client, {"id": "huge", "type": "summarize", "text": DOC * 6, "max_tokens": 8})
    assert huge["huge"].status == "completed" and huge["huge"].input_tokens_truncated > 1000
    assert huge["huge"].usage.prompt_tokens + 8 <= 2048
    # a chat over its limit is refused, never cut
    chat = {"type": "chat", "id": "chat", "messages": [{"role": "user", "content": DOC}]}
    r = _run(client, {**chat, "max_input_tokens": 50, "max_tokens": 8})["chat"]
    assert r.error and r.error.type == "input_too_long"


def test_truncation_keeps_the_end_it_names() -> None:
    # Given a document whose beginning, middle and end say different things, 100 tokens allowed,
    # cut with the worker's own code and the embedded model's tokenizer
    from transformers import AutoTokenizer

    from schemas import Settings, SummarizeJob
    from worker.budget import fit_input
    from worker.models import prepare_embedded
    from worker.prompts import PromptTokenizer

    tok = PromptTokenizer(AutoTokenizer.from_pretrained(prepare_embedded()))
    start = "ALPHA opens the report. " * 10
    middle = "Nothing of note happened in the middle weeks. " * 20
    end = "OMEGA closes the report. " * 10
    settings = Settings(_env_file=None)
    kept = {}
    for policy in ("head", "tail", "head_tail"):
        job = SummarizeJob(type="summarize", text=start + middle + end, max_input_tokens=100,
                           truncation=policy)  # fmt: skip
        cut, removed, known = fit_input(job, tok, settings, 8)
        kept[policy] = cut.text
        assert removed > 100 and len(tok.encode(cut.text)) <= 100
        assert known is not None and known[0] == cut.text and len(known[1]) <= 100
    # Then head keeps the beginning, tail the end, head_tail both ends and not the middle
    assert "ALPHA" in kept["head"] and "OMEGA" not in kept["head"]
    assert "OMEGA" in kept["tail"] and "ALPHA" not in kept["tail"]
    both = kept["head_tail"]
    assert both.startswith("ALPHA") and both.rstrip().endswith("report.") and "OMEGA" in both
    assert "[...]" in both and "middle weeks" not in both.split("[...]")[0][-60:]


def test_rate_limit_per_tenant(worker: WorkerProc, redis_client: redis.Redis) -> None:
    # Given two tenants with a burst of 5 each: team-a limited to 20 jobs/s, team-b to one job
    # every two seconds (so that its bucket cannot refill between two calls on a slow host)
    limits = {"team-a": 20.0, "team-b": 0.5}
    s = make_settings(worker.queue, tenant="team-a", rate_limits=limits, rate_limit_burst=5)
    waits: list[str] = []
    client = Client(s, on_wait=waits.append)
    jobs = [{"type": "summarize", "text": f"Item {i}.", "max_tokens": 4} for i in range(25)]
    # When team-a submits 25 jobs
    batch = client.submit_many(jobs)
    # Then submission was held to its rate (20 jobs past its burst), saying why, and every
    # job ran
    assert waits and "team-a" in waits[0] and "20 jobs/s" in waits[0]
    assert batch.wait(timeout=300).completed == 25
    # and with on_limit=refuse its next submission is refused at once
    refusing = Client(s.model_copy(update={"on_limit": "refuse"}))
    with pytest.raises(Refused, match="team-a"):
        refusing.submit_many(jobs)
    # while team-b, whose own bucket is full, still gets its burst of 5 at once ...
    other = Client(s.model_copy(update={"tenant": "team-b", "on_limit": "refuse"}))
    burst = other.submit_many(jobs[:5])
    # ... and is held to its own limit right after it
    with pytest.raises(Refused, match="team-b"):
        other.submit_many(jobs[:5])
    assert burst.wait(timeout=300).completed == 5


def test_the_token_bucket_on_a_fake_clock(redis_client: redis.Redis) -> None:
    # Given a tenant's bucket at 20 jobs/s with a burst of 5, on a clock the test sets
    from protocol.store import BatchStore

    store = BatchStore(redis_client, KEY_PREFIX)
    tenant, t = f"clock-{RUN}", 1000.0

    def take(n: int, at: float) -> float:
        return store.take_tokens(tenant, n, rate=20.0, burst=5, now=at)

    # When the burst is taken at once, then one more
    assert take(5, t) == 0
    # Then the next job waits exactly one token's time (1/20 s), and nothing was taken
    assert take(1, t) == pytest.approx(0.05, abs=0.002)
    assert take(1, t + 0.049) == pytest.approx(0.001, abs=0.002)
    # once that time has passed it goes, and a long pause refills only up to the burst
    assert take(1, t + 0.06) == 0
    assert take(6, t + 100) == pytest.approx(0.05, abs=0.002)
    assert take(5, t + 100) == 0


def test_max_queue_depth_refuses_or_waits(redis_client: redis.Redis, tmp_path: Path) -> None:
    # Given a queue nobody consumes, limited to 10 waiting jobs
    q = f"vqtest-{RUN}-nobody"
    src = tmp_path / "jobs.jsonl"
    src.write_text("".join(f'{{"type": "summarize", "text": "x{i}"}}\n' for i in range(30)))
    env_limit = {"VQUEUE_MAX_QUEUE_DEPTH": "10", "VQUEUE_ON_LIMIT": "refuse"}
    # When a file of 30 jobs is submitted with on_limit=refuse
    proc = run_cli("--queue", q, "submit", str(src), **env_limit)
    # Then the CLI refuses with exit code 7, saying why
    assert proc.returncode == 7, proc.stderr
    assert "VQUEUE_MAX_QUEUE_DEPTH=10" in proc.stderr.decode()
    assert Client(make_settings(q)).queue_depth() <= 10
    # and with on_limit=wait it waits, saying so, until the queue drains
    from .conftest import WORKDIR, worker_env

    proc2 = subprocess.Popen(
        [sys.executable, "-m", "producer.cli", "--queue", q, "submit", str(src), "-q"],
        cwd=WORKDIR, env=worker_env(q, VQUEUE_MAX_QUEUE_DEPTH="10"), stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        wait_for(lambda: Client(make_settings(q)).queue_depth() >= 10, 60, "a full queue")
        assert proc2.poll() is None  # waiting for room
        keys = [f"{q}:{i}" if i else q for i in range(10)]

        def drained() -> bool:  # a stand-in consumer empties the queue until submit is done
            redis_client.delete(*keys)
            return proc2.poll() is not None

        wait_for(drained, 60, "submit to finish as the queue drains", interval=0.5)
        assert proc2.returncode == 0
        assert b"waiting: queue" in (proc2.stderr.read() if proc2.stderr else b"")
    finally:
        proc2.kill()


def test_max_queue_depth_counts_the_queues_of_routed_workers(redis_client: redis.Redis) -> None:
    # Given a live worker that producers route jobs to (its heartbeat in the registry; the test
    # stands in for it so that nothing consumes its own queue) and a depth limit of 10
    from protocol.store import BatchStore

    q = f"vqtest-{RUN}-routed"
    store = BatchStore(redis_client, KEY_PREFIX)
    name = f"routed-{RUN}@test"
    store.heartbeat(name, {"name": name, "queue": q, "routed": True, "concurrency": 100}, 60)
    client = Client(make_settings(q, max_queue_depth=10, on_limit="refuse"))
    # When 10 jobs are submitted, they go to that worker's own queue, not the shared one
    client.submit_many([{"type": "summarize", "text": f"x{i}"} for i in range(10)])
    assert client.queue_depth() == 0 and client.queue_depth(f"{q}@{name}") == 10
    # Then the limit still counts them: the next job is refused
    assert client.waiting() == 10
    with pytest.raises(Refused, match="VQUEUE_MAX_QUEUE_DEPTH=10"):
        client.submit_many([{"type": "summarize", "text": "one more"}])
    store.forget_worker(name)


def test_invalid_engine_settings_fail_at_start(procs: Procs) -> None:
    # A value no setting takes: the CLI names the env var, exit 2, before anything starts
    proc = run_cli("worker", VQUEUE_DTYPE="float8", timeout=120)
    assert proc.returncode == 2 and b"VQUEUE_DTYPE" in proc.stderr
    assert b"Traceback" not in proc.stderr
    # A combination this host cannot run: the worker exits 10 (CONFIG) with the reason, before
    # loading anything
    w = procs.worker("badcfg", f"vqtest-{RUN}-badcfg", VQUEUE_QUANTIZATION="awq",
                     VQUEUE_TENSOR_PARALLEL_SIZE="2")  # fmt: skip
    assert w.proc.wait(120) == 10
    log = w.log_path.read_text()
    assert "VQUEUE_QUANTIZATION=awq needs a CUDA GPU" in log
    assert "VQUEUE_TENSOR_PARALLEL_SIZE > 1 needs GPUs" in log
    # and `vqueue worker --check` says the same, with the same exit code
    check = run_cli("worker", "--check", VQUEUE_QUANTIZATION="awq", timeout=300)
    assert check.returncode == 10 and b"needs a CUDA GPU" in check.stderr, check.stderr


def test_gguf_model_file_loads(procs: Procs, redis_client: redis.Redis) -> None:
    # Given the embedded model's own GGUF file as VQUEUE_MODEL
    from worker.models import embedded_gguf

    gguf = embedded_gguf()
    q = f"vqtest-{RUN}-gguf"
    w = procs.worker("gguf", q, VQUEUE_MODEL=str(gguf))
    w.wait_ready(redis_client)
    client = Client(make_settings(q))
    # When a job runs on it
    res = _run(client, {"id": "g", "type": "summarize", "text": "Bees make honey.",
                        "max_tokens": 8})["g"]  # fmt: skip
    w.stop()
    # Then it is served from the converted file, under the file's path as the model name
    assert res.status == "completed" and res.text
    assert res.model == str(gguf)


def test_output_budgets_and_stop_sequences(client: Client) -> None:
    # Given a summary with no max_tokens that would never stop by itself, and one with a stop
    endless = {"id": "budget", "type": "summarize", "text": "Bees make honey.", "ignore_eos": True}
    stopped = {"id": "stop", "type": "summarize", "text": DOC, "max_tokens": 64, "stop": [" the"]}
    got = _run(client, endless, stopped)
    # Then the first ends at the per-type budget (VQUEUE_MAX_TOKENS_SUMMARIZE, 256) ...
    assert got["budget"].usage.completion_tokens == 256
    assert got["budget"].finish_reason == "length"
    # ... and the second at its stop sequence, which is not in the text
    s = got["stop"]
    assert s.finish_reason == "stop" and " the" not in (s.text or "")
    assert s.usage.completion_tokens < 64


def test_logit_bias_and_penalties_reach_the_engine(client: Client) -> None:
    from transformers import AutoTokenizer

    from worker.models import prepare_embedded

    # Given a chat line biased +100 toward one token, as an OpenAI body writes it (token ids of
    # the model that answers, as keys), with OpenAI's penalties beside it
    tok = AutoTokenizer.from_pretrained(prepare_embedded())
    token = tok.encode(" honey")[0]
    line = {"custom_id": "bias", "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "Say anything."}],
                     "max_completion_tokens": 4, "logit_bias": {str(token): 100},
                     "presence_penalty": 0.0, "frequency_penalty": 0.0}}  # fmt: skip
    from producer.inputs import parse_line

    job = parse_line(1, json.dumps(line).encode()).job
    # and one biased toward a token id the model does not have
    outside = {**job.model_dump(), "id": "outside", "logit_bias": {10**8: 5}}
    # When they run, Then every token of the first is that one: the bias reached vLLM's sampler
    got = _run(client, job.model_dump(), outside)
    assert got["bias"].status == "completed" and got["bias"].usage.completion_tokens == 4
    assert got["bias"].text == tok.decode([token]) * 4, got["bias"].text
    # and vLLM refused the second, which failed alone, saying why
    refused = got["outside"]
    assert refused.status == "failed" and refused.error is not None, refused
    assert refused.error.type == "engine_error" and "out-of-vocab" in refused.error.message


def test_a_long_document_is_encoded_once_and_its_prompt_says_the_same() -> None:
    # Given a summarize job whose document is too long to pass the byte check (it must be
    # encoded to be measured), and the embedded model's real tokenizer
    from transformers import AutoTokenizer

    from schemas import Settings, SummarizeJob
    from worker.budget import fit_input
    from worker.models import prepare_embedded
    from worker.prompts import PromptTokenizer, build_messages

    tok = PromptTokenizer(AutoTokenizer.from_pretrained(prepare_embedded()))
    settings = Settings(_env_file=None, max_model_len=2048)
    doc = "The committee met on Tuesday and approved the budget for the new bridge. " * 60
    job = SummarizeJob(type="summarize", text=doc)

    # When it is fitted and its prompt built from the ids the fit already made
    fitted, removed, known = fit_input(job, tok, settings, 128)
    assert removed == 0 and known is not None
    assert known == (doc, tok.encode(doc))  # the measuring encode, handed on
    messages = build_messages(fitted, settings)
    spliced = tok.chat_prompt(messages, known)
    whole = tok.chat_prompt(messages)

    # Then the prompt reads exactly the same text, and tokenizes to the same length give or
    # take the one boundary encoded apart
    assert tok.decode(spliced) == tok.decode(whole)
    assert abs(len(spliced) - len(whole)) <= 1
    n = len(known[1])  # and the document's ids are in it as they were, in one run
    assert any(spliced[i : i + n] == known[1] for i in range(len(spliced) - n + 1))


def test_cleaning_skips_documents_with_nothing_to_clean_and_only_those() -> None:
    # Given random texts over an alphabet of everything clean() removes or folds, and plain text
    import random
    import re

    from worker import prompts

    def slow(text: str, prose: bool) -> str:  # the seven passes, unconditionally
        text = prompts._CONTROL.sub("", prompts._INVISIBLE.sub("", text.replace("\r\n", "\n")))
        if prose:
            text = prompts._SPACES.sub(" ", text)
            text = prompts._BLANK_LINES.sub(
                "\n\n", prompts._TRAILING.sub("\n", prompts._RUNS.sub(" ", text))
            )
        return text

    rng = random.Random(7)
    alphabet = "ab .\n\t\r\x00\x07\x7f\x85\u200b\u00ad\u00a0\u3000é中"
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12))) for _ in range(3000)]
    texts += ["Plain text.\n\nA second paragraph, ASCII only.", "x" * 10_000]
    # When each is cleaned, as prose and as code
    for text in texts:
        for prose in (True, False):
            # Then the result is what the full passes give, fast path or not
            assert prompts.clean(text, prose) == slow(text, prose), repr(text)
    assert prompts._clean_already(texts[-2]) and not re.search("  ", texts[-2])


def test_tokenizer_threads_are_bounded() -> None:
    from worker.prompts import tokenizer_threads

    assert 2 <= tokenizer_threads(0) <= 8
    assert tokenizer_threads(3) == 3


FLOOD_ZH = (
    "受持续强降雨影响，本市多条河流水位上涨，防汛部门已启动三级应急响应。市气象台预计未来三天仍有大到"
    "暴雨，请市民减少外出，注意防范山洪和城市内涝。目前已转移群众一千二百余人，暂无人员伤亡报告。"
)


def _han_share(text: str) -> float:
    letters = [c for c in text if c.isalpha()]
    return sum("\u4e00" <= c <= "\u9fff" for c in letters) / max(len(letters), 1)


def test_a_chinese_document_is_summarized_in_chinese(client: Client) -> None:
    # Given a Chinese news paragraph sent as a summarize job, with no language named, and the
    # same paragraph with English asked for
    jobs = [
        {"id": "auto", "type": "summarize", "text": FLOOD_ZH, "max_tokens": 80},
        {"id": "en", "type": "summarize", "text": FLOOD_ZH, "max_tokens": 80, "language": "en"},
    ]
    # When the embedded model answers
    out = _run(client, *jobs)
    # Then the first summary is mostly Chinese (it came back in English before: the instruction
    # and system prompt are English), and the second follows the job's language
    assert out["auto"].status == "completed" and out["auto"].text
    assert _han_share(out["auto"].text) > 0.5, out["auto"].text
    assert out["en"].status == "completed" and _han_share(out["en"].text) < 0.5, out["en"].text


def test_the_answer_language_comes_from_the_job_or_the_document_script() -> None:
    from schemas import ExtractJob, Settings, SummarizeJob
    from worker.prompts import build_messages, script_language

    assert script_language(FLOOD_ZH) == "Chinese"
    assert script_language("東京は雨です。明日も雨でしょう。") == "Japanese"  # kana: not Chinese
    assert script_language("서울에 비가 옵니다") == "Korean"
    # Latin and Cyrillic scripts are shared by many languages: not named
    assert script_language("Le conseil a voté le budget.") is None
    assert script_language("Совет утвердил бюджет.") is None
    assert script_language("Q3 report: revenue in 中国 grew") is None  # a few Han words
    s = Settings(_env_file=None)
    user = build_messages(SummarizeJob(type="summarize", text=FLOOD_ZH), s)[1]["content"]
    assert user.endswith("\n\nWrite the summary in Chinese.")
    user = build_messages(SummarizeJob(type="summarize", text="Hi.", language="fr"), s)[1]
    assert user["content"].endswith("Write the summary in French.")
    user = build_messages(SummarizeJob(type="summarize", text="Hi."), s)[1]["content"]
    assert "Write the summary" not in user  # English stays as it was: no prompt change
    ex = ExtractJob(type="extract", text=FLOOD_ZH, json_schema={"type": "object"})
    assert build_messages(ex, s)[1]["content"].endswith("Write text values in Chinese.")


_VLLM_TEXTS = r"""
import json, sys
from vllm import LLM, SamplingParams

if __name__ == "__main__":  # vLLM starts its engine core in a process of its own
    llm = LLM(model=sys.argv[1], max_model_len=1024, kv_cache_memory_bytes=256 * 1024**2, seed=0,
              enforce_eager=True)  # as the worker runs on a CPU: no compile to wait for
    tok = llm.get_tokenizer()
    asks = ["Write two lines about the sea in Chinese.", "Ecris une phrase sur le café.",
            "Напиши предложение о зиме.", "List three emoji and what they mean.",
            "Say hello.", "Describe a bee in one sentence."]
    period = tok.encode(".", add_special_tokens=False)[-1]
    prompts, params = [], []
    for i in range(36):
        msgs = [{"role": "user", "content": asks[i % len(asks)]}]
        prompts.append({"prompt_token_ids": tok.apply_chat_template(msgs, tokenize=True,
                        add_generation_prompt=True, return_dict=False)})
        # sampled hot, so that odd tokens (pieces of characters, rare scripts) come out
        params.append(SamplingParams(max_tokens=40, temperature=1.3 if i % 2 else 0.7, seed=i,
                                     stop_token_ids=[period] if i % 3 == 0 else None))
    outs = llm.generate(prompts, params, use_tqdm=False)
    with open(sys.argv[2], "w") as fh:  # vLLM logs on stdout
        json.dump([{"prompt": list(o.prompt_token_ids), "ids": list(o.outputs[0].token_ids),
                    "finish": o.outputs[0].finish_reason, "text": o.outputs[0].text}
                   for o in outs], fh)
"""


def test_the_worker_decodes_answers_to_the_text_vllm_would(tmp_path: Path) -> None:
    # Given answers generated by vLLM itself, which detokenized them as it went (a real engine
    # on the embedded model: ended by EOS, by a stop token id, and by max_tokens)
    from transformers import AutoTokenizer

    from worker.models import prepare_embedded
    from worker.prompts import PromptTokenizer

    model = str(prepare_embedded())
    script = tmp_path / "texts.py"
    script.write_text(_VLLM_TEXTS)
    out = tmp_path / "answers.json"
    proc = subprocess.run([sys.executable, str(script), model, str(out)], capture_output=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    answers = json.loads(out.read_text())
    # When the worker makes the text of the same token ids, as it does for every request it
    # sends with detokenize=False
    tok = PromptTokenizer(AutoTokenizer.from_pretrained(model))
    assert tok.decodes_outputs
    made = [tok.output_text(a["prompt"], a["ids"], a["finish"] == "stop") for a in answers]
    # Then every text is vLLM's, to the character
    assert made == [a["text"] for a in answers]
    assert {a["finish"] for a in answers} == {"stop", "length"}
    assert any(not a["text"].isascii() for a in answers)
