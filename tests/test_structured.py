"""JSON extraction that never returns invalid JSON: the real worker, engine and model
(docs/structured-outputs.md)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from producer import Client
from schemas import ExtractJob, JobResult
from schemas.templates import BUILTIN

from .conftest import ARTIFACTS, RUN, WorkerProc, run_cli, wait_for
from .structured_cases import cases

pytestmark = pytest.mark.engine

# what a job that did not complete may end with: guided decoding makes every finished output
# valid, so only a cut-off one fails, or one that looped in every attempt
# (docs/structured-outputs.md promises no other)
JSON_ERRORS = {"schema_incomplete", "loop"}


def _run(client: Client, jobs: list[dict[str, Any]]) -> dict[str, JobResult]:
    return {r.id: r for r in client.submit_many(jobs).results(timeout=900)}


def _valid(schema: dict[str, Any], data: Any) -> bool:
    cls = jsonschema.validators.validator_for(schema)
    return not list(cls(schema, format_checker=cls.FORMAT_CHECKER).iter_errors(data))


def test_fifty_schemas_completed_means_valid(client: Client) -> None:
    # Given 50 schemas (nested objects, bounded arrays, enums, numbers, integers, booleans,
    # nullable and optional fields, $defs/$ref, string formats) over ten realistic texts
    jobs = cases()
    got = _run(client, jobs)
    counts: Counter[str] = Counter()
    outcomes = {}
    for job in jobs:
        r = got[job["id"]]
        outcomes[job["id"]] = r.error.type if r.error else r.status
        if r.status == "completed":
            # Then every completed result parses and satisfies its schema, formats included
            assert _valid(job["json_schema"], r.data), (job["id"], r.text)
            assert r.data == json.loads(r.text or "")
            counts["completed"] += 1
        else:
            # and every other job ends with an error that names its cause, its output kept
            assert r.error is not None and r.error.type in JSON_ERRORS, (job["id"], r.error)
            assert r.text is not None
            counts[r.error.type] += 1
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    report = {
        "counts": dict(counts),
        "jobs": outcomes,
        "texts": {k: got[k].text for k, v in outcomes.items() if v != "completed"},
    }
    (ARTIFACTS / "structured-50.json").write_text(json.dumps(report, indent=2) + "\n")
    assert counts["completed"] >= 30, counts  # 36 of 50 with the embedded 135M model


def test_cut_off_json_is_retried_once_then_incomplete_with_its_text(client: Client) -> None:
    # Given an extraction whose answer cannot fit in 6 tokens, nor in 12
    schema = {"type": "object", "properties": {"summary": {"type": "string", "minLength": 200}},
              "required": ["summary"]}  # fmt: skip
    job = {"id": "cut", "type": "extract", "text": "A long story. " * 20, "json_schema": schema,
           "max_tokens": 6}  # fmt: skip
    r = _run(client, [job])["cut"]
    # Then it was retried with twice the room, and failed as schema_incomplete, never
    # completed, with the partial JSON attached and the first run's tokens counted as waste
    assert r.status == "failed" and r.error and r.error.type == "schema_incomplete"
    assert "max_tokens=12" in r.error.message and "at 6 tokens the first time" in r.error.message
    assert r.text and r.text.startswith('{"summary":"') and r.usage.wasted_tokens == 6
    assert r.data is None


def test_schema_derived_max_tokens(client: Client) -> None:
    # Given a small schema and no max_tokens
    from worker.structured import schema_token_budget

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                               "year": {"type": "integer"}},
              "required": ["city", "year"]}  # fmt: skip
    budget = schema_token_budget(schema, 512)
    assert 32 <= budget < 100
    job = {"type": "extract", "text": "Founded in Oslo in 1624.", "json_schema": schema}
    r = _run(client, [{**job, "id": "s"}])["s"]
    # Then the output budget came from the schema and was enough
    assert r.status == "completed" and r.data["year"] == 1624
    assert r.finish_reason == "stop" and r.usage.completion_tokens <= budget
    # and it is what the engine was given: a job that never stops (ignore_eos) is cut at that
    # budget, then at twice it
    r = _run(client, [{**job, "id": "e", "ignore_eos": True}])["e"]
    assert r.error is not None and r.error.type == "schema_incomplete", r
    assert f"max_tokens={2 * budget}, and at {budget} tokens the first time" in r.error.message


def test_templates_builtin_registered_and_unknown(client: Client, tmp_path: Path) -> None:
    name = f"colour-{RUN}"
    # Given a job naming the built-in "contact" template, with neither schema nor instruction
    text = "Best regards, Priya Natarajan, CFO, Orbit Logistics (priya@orbit.example)"
    r = _run(client, [{"id": "t", "type": "extract", "text": text, "template": "contact"}])["t"]
    # Then it completes against the template's schema, as its examples show
    assert r.status == "completed", r.error
    assert _valid(BUILTIN["contact"].json_schema, r.data) and r.data["name"] == "Priya Natarajan"
    # Given a template a user registers with the CLI
    mine = {
        "name": name, "instruction": "Name the colour the text mentions.",
        "json_schema": {"type": "object", "properties": {"colour": {"type": "string", "enum":
                        ["red", "green", "blue"]}}, "required": ["colour"]},
        "examples": [{"text": "The sky was blue.", "output": {"colour": "blue"}},
                     {"text": "A red car.", "output": {"colour": "red"}}],
    }  # fmt: skip
    path = tmp_path / "colour.json"
    path.write_text(json.dumps(mine))
    add = run_cli("templates", "add", str(path))
    assert add.returncode == 0, add.stderr
    listed = run_cli("templates", "list", "--json")
    names = {json.loads(line)["name"] for line in listed.stdout.decode().splitlines()}
    assert {"contact", "invoice", "event", name} <= names
    r = _run(client, [{"id": "c", "type": "extract", "text": "Green leaves.", "template": name}])
    assert r["c"].status == "completed" and r["c"].data == {"colour": "green"}
    # once removed, a job submitted while it existed fails at the worker as unknown_template
    # (the worker reads templates again at most every 10 s: a name it never loaded is used here)
    from schemas import Envelope

    gone = f"gone-{RUN}"
    path.write_text(json.dumps(dict(mine, name=gone)))
    assert run_cli("templates", "add", str(path)).returncode == 0
    assert run_cli("templates", "remove", gone).returncode == 0
    assert run_cli("templates", "remove", gone).returncode == 5
    job = ExtractJob.model_validate({"id": "g", "type": "extract", "text": "Red.",
                                     "template": gone})  # fmt: skip
    env = Envelope(job=job, batch="made-earlier", enqueued_at=0.0)  # submit_many sets its own
    r = _run(client, [env])
    assert r["g"].error is not None and r["g"].error.type == "unknown_template"
    # and a template whose example breaks its own schema, or an unknown one, is refused
    bad = dict(mine, name="broken", examples=[{"text": "x", "output": {"colour": "pink"}}])
    path.write_text(json.dumps(bad))
    refused = run_cli("templates", "add", str(path))
    assert refused.returncode == 3 and b"example 1's output does not fit" in refused.stderr
    src = tmp_path / "jobs.jsonl"
    src.write_text(json.dumps({"type": "extract", "text": "x", "template": "nope"}) + "\n")
    sub = run_cli("submit", str(src), "-q")
    assert sub.returncode == 3 and b"unknown template 'nope'" in sub.stderr


def test_a_template_is_its_tenants_unless_shared(client: Client, tmp_path: Path) -> None:
    from .conftest import make_settings

    def template(name: str, secret: str) -> Path:
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({
            "name": name, "instruction": "Name the code word.",
            "json_schema": {"type": "object", "properties": {"word": {"type": "string"}},
                            "required": ["word"]},
            "examples": [{"text": f"The code word is {secret}.", "output": {"word": secret}}],
        }))  # fmt: skip
        return path

    own, common = f"own-{RUN}", f"common-{RUN}"
    # Given a template tenant a registers, its example holding a's data, and a shared one
    assert (
        run_cli("--tenant", "tpl-a", "templates", "add", str(template(own, "ORCHID"))).returncode
        == 0
    )
    added = run_cli("templates", "add", "--shared", str(template(common, "TULIP")))
    assert added.returncode == 0 and b"every tenant" in added.stderr, added.stderr

    def run(tenant: str, name: str) -> JobResult:
        c = Client(make_settings(client.settings.queue, tenant=tenant))
        job = {"id": "t", "type": "extract", "text": "The code word is ROSE.", "template": name,
               "max_tokens": 24}  # fmt: skip
        return next(c.submit_many([job]).results(timeout=300))

    # When tenant b names a's template, Then b's submit refuses it as unknown, and a job that
    # reaches a worker anyway fails there as unknown_template: b never sees a's example
    b = Client(make_settings(client.settings.queue, tenant="tpl-b"))
    with pytest.raises(ValueError, match="unknown template"):
        b.submit_many([{"type": "extract", "text": "x", "template": own}])
    listed = run_cli("--tenant", "tpl-b", "templates", "list", "--json").stdout.decode()
    names = {json.loads(x)["name"]: json.loads(x)["origin"] for x in listed.splitlines()}
    assert own not in names and names[common] == "shared"
    from schemas import Envelope

    job = ExtractJob.model_validate({"id": "t", "type": "extract", "text": "x", "template": own})
    forged = Envelope(job=job, batch=f"forged-{RUN}", enqueued_at=0.0, tenant="tpl-b")
    stolen = next(b.submit_many([forged], batch=f"forged-{RUN}").results(timeout=300))
    assert stolen.error is not None and stolen.error.type == "unknown_template"
    # while a's own job and both tenants' shared ones run with the template
    assert run("tpl-a", own).status == "completed"
    assert run("tpl-b", common).status == "completed"


BAD_SCHEMAS = {
    "invalid": ({"type": "strng"}, "is not a valid JSON Schema"),
    "huge": ({"type": "object", "properties": {f"f{i}": {"type": "string", "description": "x" * 60}
                                               for i in range(1200)}}, "the limit is 64000"),
    "deep": (None, "nests more than 32 levels deep"),
    "not": ({"type": "object", "not": {"required": ["a"]}}, 'Unimplemented keys: ["not"]'),
    "unique": ({"type": "array", "uniqueItems": True}, 'Unimplemented keys: ["uniqueItems"]'),
    "if-then": ({"if": {"type": "string"}, "then": {"minLength": 2}}, '["if", "then"]'),
    "format": ({"type": "string", "format": "regex"}, "Unknown format: regex"),
    "lookahead": ({"type": "string", "pattern": "^(?=a)"}, "look-around"),
    "remote-ref": ({"$ref": "https://example.com/s.json"}, "not present in a registry"),
}  # fmt: skip


def test_bad_schemas_each_get_their_own_error(tmp_path: Path) -> None:
    deep: dict[str, Any] = {"type": "string"}
    for _ in range(60):
        deep = {"type": "object", "properties": {"x": deep}}
    lines = []
    for name, (schema, _) in BAD_SCHEMAS.items():
        lines.append({"id": name, "type": "extract", "text": "x",
                      "json_schema": deep if schema is None else schema})  # fmt: skip
    src, errors = tmp_path / "bad.jsonl", tmp_path / "errors.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    # When they are submitted together, nothing is enqueued and each line's error names its
    # problem, with the job id
    proc = run_cli("submit", str(src), "-q", "--errors", str(errors), "--wait")
    assert proc.returncode == 3
    # (in the errors file as the vqueue lines they are: failed results, as a worker writes)
    written = [json.loads(x) for x in errors.read_text().splitlines()]
    assert all(x["status"] == "failed" and x["error"]["type"] == "invalid_job" for x in written)
    got = {x["id"]: x["error"]["message"] for x in written}
    for name, (_, expected) in BAD_SCHEMAS.items():
        assert expected in got[name], (name, got[name])
    # the same checks hold for the Python API
    with pytest.raises(ValueError, match="Unimplemented keys"):
        ExtractJob(type="extract", text="x", json_schema=BAD_SCHEMAS["not"][0])


def test_grammar_compilation_is_bounded_and_remembered() -> None:
    # Given the worker's grammar check on the real tokenizer, with a limit no compile can meet
    from transformers import AutoTokenizer

    from worker.errors import JobFailed
    from worker.models import resolve_model
    from worker.structured import GrammarCheck

    tok = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct"))
    check = GrammarCheck(tok, timeout_s=1e-9)
    slow = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^[a-z]{3,9}$"}}}
    with pytest.raises(JobFailed) as first:
        check.check(slow)
    # Then the job fails with schema_compile_timeout, and the schema's next job fails at once
    # from the cache (the worker is never held up by it)
    assert first.value.type == "schema_compile_timeout"
    with pytest.raises(JobFailed, match="did not compile within"):
        check.check(dict(slow))
    # while a check with room, warmed as a starting worker's is, compiles a schema once and
    # remembers it compiles (the room is wide: a loaded two-core host runs the first check's
    # abandoned compilation beside this one, and the limit is not what is tested here)
    ok = GrammarCheck(tok, timeout_s=300)
    ok.warm()
    ok.check(slow)
    ok.check(slow)
    assert list(ok._seen.values()) == [None]


def test_the_grammar_check_builds_its_tokenizer_at_start() -> None:
    # Given the worker's grammar check, warmed as a starting worker does (app._build_engine)
    from transformers import AutoTokenizer

    from worker.models import resolve_model
    from worker.structured import GrammarCheck

    tok = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct"))
    check = GrammarCheck(tok, timeout_s=30)
    check.warm()
    built = check._ll
    # Then llguidance's tokenizer (a second of held GIL on a large vocabulary) exists before
    # any job, and the first schema's check uses it rather than building another
    assert built is not None
    check.check({"type": "object", "properties": {"a": {"type": "integer"}}})
    assert check._ll is built
    # and a check without a tokenizer (a stand-in engine) warms to nothing, quietly
    GrammarCheck(None, timeout_s=30).warm()


def test_budget_and_grammar_schema_follow_the_schema() -> None:
    from worker.structured import NUMBER_BOUND, generation_schema, schema_token_budget

    small = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}}}
    # Given schemas of very different sizes, their budgets differ accordingly, within the cap
    assert 32 <= schema_token_budget(small, cap=512) < 64
    big = {"type": "object", "properties": {f"f{i}": {"type": "string"} for i in range(40)}}
    assert schema_token_budget(big, cap=512) == 512
    assert schema_token_budget({"enum": ["a" * 300]}, cap=4096) > 100
    # and the grammar's schema bounds open numbers only, leaving the job's schema as it was
    sch = {"type": "object", "properties": {"n": {"type": ["integer", "null"]},
                                            "x": {"type": "number", "minimum": 0}}}  # fmt: skip
    bounded = generation_schema(sch)
    assert bounded["properties"]["n"]["maximum"] == NUMBER_BOUND
    assert bounded["properties"]["x"] == {"type": "number", "minimum": 0, "maximum": NUMBER_BOUND}
    assert "maximum" not in sch["properties"]["n"]


# arrays without maxItems, where the embedded model repeats an item (benchmarks/quality.py)
LOOPING = {
    "attendees-zh": ("项目周会纪要。出席：张伟、刘洋、陈静。张伟汇报了进度，刘洋提出了测试计划。",
                     {"topic": {"type": "string"}, "attendees": {"type": "array",
                                                                 "items": {"type": "string"}}}),
    "ingredients": ("Tomato soup: soften an onion in butter, add two cans of tomatoes and a litre "
                    "of stock, simmer, then blend with a little cream and salt.",
                    {"dish": {"type": "string"}, "ingredients": {"type": "array",
                                                                 "items": {"type": "string"}}}),
    "medications": ("Discharge note for Mr. Alan Reyes: continue metformin 500 mg twice daily and "
                    "lisinopril 10 mg once daily; start atorvastatin 20 mg at night.",
                    {"patient": {"type": "string"}, "medications": {"type": "array", "items": {
                        "type": "object", "properties": {"name": {"type": "string"},
                                                         "dose": {"type": "string"}},
                        "required": ["name", "dose"], "additionalProperties": False}}}),
    # a cycle of about 55 tokens: longer than vLLM's own check is given (docs/quality.md)
    "tickets": ("Support queue for the billing team. BILL-101 'Invoice total wrong' reported by "
                "Ana Silva, high priority, open: the total omits the shipping line. BILL-102 "
                "'Duplicate charge' reported by Ken Ito, urgent, in progress: the card was charged "
                "twice for one order. BILL-103 'Refund missing' reported by Lea Roy, medium, "
                "waiting: a refund approved last week has not arrived.",
                {"team": {"type": "string"}, "tickets": {"type": "array", "items": {
                    "type": "object", "properties": {k: {"type": "string"} for k in (
                        "id", "title", "reporter", "priority", "status", "summary")},
                    "required": ["id", "title", "reporter", "priority", "status", "summary"],
                    "additionalProperties": False}}}),
}  # fmt: skip


def test_a_looping_extraction_is_ended_at_the_loop_and_retried(
    worker: WorkerProc, client: Client
) -> None:
    from .test_early_stop import _scrape

    before = _scrape(worker.metrics_port)
    # Given extraction jobs with unbounded arrays, which the embedded model, greedy, fills with
    # one item over and over, and room for 512 tokens
    jobs: list[dict[str, Any]] = [{"id": k, "type": "extract", "text": text, "max_tokens": 512,
             "json_schema": {"type": "object", "properties": props, "required": list(props),
                             "additionalProperties": False}}
            for k, (text, props) in LOOPING.items()]  # fmt: skip
    got = _run(client, jobs)
    looped = [r for r in got.values() if r.attempts and r.attempts[0].reason == "loop"]
    # Then the engine ended at least one of them at its loop, long before its 512 tokens
    assert looped, {k: (r.status, r.text) for k, r in got.items()}
    # the long cycle among them (vqueue's loop check in the engine: worker/vllm_ext/loops.py)
    tickets = got["tickets"].attempts
    assert tickets and tickets[0].reason == "loop" and tickets[0].tokens < 300, tickets
    for r in looped:
        first = r.attempts[0]
        assert 3 * 17 <= first.tokens < 300 and first.frequency_penalty == 0.0, r.attempts
        # and ran it once more with a frequency penalty on its own tokens, the first run's
        # tokens counted as waste
        assert len(r.attempts) == 2 and r.attempts[1].frequency_penalty == 0.5, r.attempts
        # (when the retry loops too, it is still the answer: its tokens are not waste)
        assert r.attempts[1].tokens == r.usage.completion_tokens
        assert r.usage.wasted_tokens == first.tokens
        if r.attempts[1].reason == "loop":  # looped again: failed, saying so, its text kept
            assert r.status == "failed" and r.error and r.error.type == "loop" and r.text
        else:  # else a valid object, which guided decoding and the schema check guarantee
            schema = next(j["json_schema"] for j in jobs if j["id"] == r.id)
            assert r.status == "completed" and _valid(schema, r.data), r
    # and the worker's metrics count the loops and their tokens
    want = {
        "vqueue_loops_total": sum(a.reason == "loop" for r in looped for a in r.attempts),
        "vqueue_loop_wasted_tokens_total": sum(r.attempts[0].tokens for r in looped),
    }

    def deltas() -> dict[str, float]:
        after = _scrape(worker.metrics_port)
        keys = {n: f'{n}{{type="extract"}}' for n in want}
        return {n: after.get(k, 0.0) - before.get(k, 0.0) for n, k in keys.items()}

    wait_for(lambda: deltas() == want, 15, f"the metrics to count the loops: {want}")


def test_a_json_job_that_loops_every_time_fails_as_loop_with_its_text() -> None:
    # Given the last attempt of an extraction ended by the engine's loop check
    from schemas import Envelope, ExtractJob, JobResult, Timings
    from worker.answers import _read_output
    from worker.errors import JobFailed

    job = ExtractJob(type="extract", text="t", json_schema={"type": "object"})
    env = Envelope(job=job, batch="b", enqueued_at=0.0)
    result = JobResult(id=job.id, batch=env.batch, type="extract", status="completed",
                       timings=Timings(enqueued_at=0.0))  # fmt: skip
    # Then reading its output fails the job as a loop, which a result can carry
    with pytest.raises(JobFailed) as failed:
        _read_output(job, '{"a":["x","x","x"', "repetition", result)
    assert failed.value.type == "loop"
    from schemas import JobError

    assert JobError(type=failed.value.type, message=failed.value.message).type == "loop"


def test_a_schema_the_engine_cannot_enforce_fails_its_job_at_the_worker(client: Client) -> None:
    # Given a job whose schema guided decoding cannot enforce (`not`), made past the producer's
    # own check (a producer without it, or a message written by hand)
    from schemas import Envelope
    from schemas.jobs import CHECKED

    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "not": {"required": ["a"]}}
    job = ExtractJob.model_validate(
        {"id": "u", "type": "extract", "text": "x", "json_schema": schema}, context=CHECKED
    )
    env = Envelope(job=job, batch=f"unenforceable-{RUN}", enqueued_at=0.0)
    # When it runs, Then the worker's own compile refuses it: the job fails alone, saying why
    r = next(client.submit_many([env], batch=env.batch).results(timeout=300))
    assert r.status == "failed" and r.error is not None, r
    assert r.error.type == "schema_unsupported" and "not" in r.error.message, r.error


def test_output_the_grammar_allows_but_the_schema_refuses_fails_as_schema_validation(
    client: Client,
) -> None:
    # Given a schema whose one allowed value breaks its own format: guided decoding follows the
    # const (the grammar allows "2023-02-29" alone), and a date checker refuses a day 2023
    # never had
    schema = {
        "type": "object",
        "required": ["due"],
        "properties": {"due": {"type": "string", "format": "date", "const": "2023-02-29"}},
    }
    job = {"id": "leap", "type": "extract", "text": "Payment is due on 2023-02-29.",
           "json_schema": schema, "max_tokens": 40}  # fmt: skip
    r = _run(client, [job])["leap"]
    # Then the job fails as schema_validation, naming where and why, its output kept
    assert r.status == "failed" and r.error is not None, r
    assert r.error.type == "schema_validation", r.error
    assert r.error.message.startswith("at due: ") and "'date'" in r.error.message, r.error
    assert r.text is not None and json.loads(r.text) == {"due": "2023-02-29"}
    assert r.data is None
