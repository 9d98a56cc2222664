"""Canary-gated batches (``vqueue submit --canary``): a sample spread over the input runs first,
through the real command, the session's real worker and engine; a batch whose canary fails
pauses until ``vqueue resume`` or ``vqueue cancel`` (producer/canary.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from producer.canary import count_lines, first_owners, judge, lower_bound, pick, script, spacing
from producer.inputs import Parsed, parse_line
from protocol.exits import RET_NOT_FOUND, RET_PAUSED, RET_STALLED, RET_USAGE
from schemas import Envelope, JobError, JobResult, Settings, Timings, Usage
from schemas.jobs import SummarizeJob

from .conftest import RUN, WorkerProc, run_cli

NAME = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}},
        "required": ["name"]}  # fmt: skip


def _write(path: Path, jobs: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(j) + "\n" for j in jobs))
    return path


def _status(batch: str) -> dict[str, Any]:
    proc = run_cli("status", batch, "--json")
    assert proc.returncode == 0, proc.stderr
    return dict(json.loads(proc.stdout))


def _until_done(batch: str, total: int) -> dict[str, Any]:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        st = _status(batch)
        if st["sealed"] and st["done"] >= total:
            return st
        time.sleep(0.5)
    raise AssertionError(f"batch {batch} did not finish: {st}")


def _runaway(path: Path, n: int) -> Path:
    """Every answer runs to its max_tokens, as a template that leaves no room for the answer
    makes a whole batch's do: a summary in 4 tokens."""
    text = "The river rose two metres overnight; the bridge was closed and the school shut."
    return _write(path, [{"id": f"r{i}", "type": "summarize", "text": f"{RUN} {i}: {text}",
                          "max_tokens": 4} for i in range(n)])  # fmt: skip


@pytest.mark.engine
def test_a_canary_that_passes_sends_the_rest_and_each_job_runs_once(
    worker: WorkerProc, tmp_path: Path
) -> None:
    # Given 30 extraction lines whose answers are short and valid
    src = _write(tmp_path / "good.jsonl", [
        {"id": f"g{i}", "type": "extract", "text": f"{RUN}: my name is Ana, order {i}.",
         "json_schema": NAME, "max_tokens": 64} for i in range(30)])  # fmt: skip
    # When they are submitted behind a 10% canary (at least 10 lines: every third)
    proc = run_cli("submit", str(src), "--canary", "10%", "--wait", "-q", "--json")
    # Then the canary passes, the other 20 are sent, and every line has one result
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.decode().splitlines()[-1])
    assert (summary["enqueued"], summary["completed"]) == (20, 30), summary
    assert b"canary passed" in proc.stderr and b"and 10 in its canary" in proc.stderr
    st = _status(summary["batch"])
    assert st["canary"]["jobs"] == 10 and st["canary"]["reasons"] == [] and not st["paused"]
    assert st["total"] == 30
    shown = run_cli("status", summary["batch"]).stdout.decode()
    assert "canary passed: 10 jobs" in shown, shown


@pytest.mark.engine
def test_a_canary_that_picks_a_duplicate_line_runs_its_ids_first_line(
    worker: WorkerProc, tmp_path: Path
) -> None:
    # Given 30 lines, one id on two of them: an earlier summary the canary does not pick and a
    # later extraction it does (its picks follow from the batch id)
    batch = f"{RUN}-dup"
    picked = list(pick(range(30), 0.1, 10, 30, batch))
    later = next(m for m in picked if m > 0 and m - 1 not in picked)
    lines: list[dict[str, Any]] = [
        {"id": f"d{i}", "type": "extract", "text": f"{RUN}: my name is Ana, order {i}.",
         "json_schema": NAME, "max_tokens": 64} for i in range(30)]  # fmt: skip
    lines[later - 1] = {"id": "dup", "type": "summarize", "text": f"{RUN}: the bridge closed.",
                        "max_tokens": 16}  # fmt: skip
    lines[later]["id"] = "dup"
    src = _write(tmp_path / "dup.jsonl", lines)
    # When they are submitted behind a canary
    errors = tmp_path / "errors.jsonl"
    proc = run_cli("submit", str(src), "--batch", batch, "--canary", "10%", "--wait", "-q",
                   "--errors", str(errors))  # fmt: skip
    # Then "dup" is answered once, for its first line, and the later line is the duplicate
    assert proc.returncode == 0, proc.stderr
    results = [json.loads(x) for x in run_cli("results", batch).stdout.decode().splitlines()]
    dup = [r for r in results if r["id"] == "dup"]
    assert len(results) == 29 and len(dup) == 1 and dup[0]["type"] == "summarize", dup
    assert b"1 lines rejected" in proc.stderr, proc.stderr


@pytest.mark.engine
def test_a_failing_canary_pauses_the_batch_until_it_is_resumed(
    worker: WorkerProc, tmp_path: Path
) -> None:
    # Given 20 lines whose answers all run to max_tokens
    src = _runaway(tmp_path / "bad.jsonl", 20)
    # When they are submitted behind a canary
    proc = run_cli("submit", str(src), "--canary", "5%", "-q")
    # Then only the canary ran (10 lines, the minimum), and the batch is paused, saying why
    assert proc.returncode == RET_PAUSED, proc.stderr
    batch = proc.stdout.decode().split()[0]
    assert b"of max_tokens on average, over 90% (VQUEUE_CANARY_MAX_LENGTH)" in proc.stderr
    st = _status(batch)
    assert st["paused"] and (st["total"], st["done"], st["sealed"]) == (10, 10, False), st
    assert st["canary"]["length"] == 1.0
    shown = run_cli("status", batch).stdout.decode()
    assert "paused: its canary failed" in shown and f"vqueue resume {batch}" in shown, shown
    # and waiting on it ends at once instead of waiting for lines that were never sent
    waited = run_cli("results", batch, "--wait")
    assert waited.returncode == RET_STALLED and b"is paused" in waited.stderr, waited.stderr
    # When it is resumed
    resumed = run_cli("resume", batch, "-q")
    # Then the rest of the file is sent, with the options it was submitted with, once each
    assert resumed.returncode == 0, resumed.stderr
    assert b"10 jobs enqueued" in resumed.stderr, resumed.stderr
    st = _until_done(batch, 20)
    assert (st["total"], st["completed"], st["paused"]) == (20, 20, False), st
    assert run_cli("status", batch).stdout.decode().count("canary failed, then resumed") == 1
    results = run_cli("results", batch).stdout.decode().splitlines()
    assert sorted(json.loads(x)["id"] for x in results) == sorted(f"r{i}" for i in range(20))
    # and a batch that is not paused cannot be resumed
    again = run_cli("resume", batch)
    assert again.returncode == RET_USAGE and b"not paused" in again.stderr


@pytest.mark.engine
def test_cancelling_a_paused_batch_ends_it_with_what_ran(
    worker: WorkerProc, tmp_path: Path
) -> None:
    src = _runaway(tmp_path / "bad.jsonl", 30)
    proc = run_cli("submit", str(src), "--canary", "10%", "-q", "--json")
    assert proc.returncode == RET_PAUSED, proc.stderr
    paused = json.loads(proc.stdout)
    batch = paused["batch"]
    assert paused["paused"] and paused["canary"]["jobs"] == 10, paused
    # When it is cancelled, Then it is whole: its canary's 10 results, nothing else sent
    assert run_cli("cancel", batch).returncode == 0
    st = _status(batch)
    assert (st["sealed"], st["paused"], st["total"], st["remaining"]) == (True, False, 10, 0), st
    assert run_cli("results", batch, "--wait").returncode == 0


@pytest.mark.integration
def test_a_canary_needs_a_file_and_a_share(tmp_path: Path) -> None:
    src = _runaway(tmp_path / "bad.jsonl", 3)
    for share in ("0%", "150%", "half"):
        proc = run_cli("submit", str(src), "--canary", share)
        assert proc.returncode == RET_USAGE and b"--canary" in proc.stderr, (share, proc.stderr)
    piped = run_cli("submit", "-", "--canary", "2%", input=src.read_bytes())
    assert piped.returncode == RET_USAGE and b"needs a file" in piped.stderr
    gone = run_cli("resume", "no-such-batch")
    assert gone.returncode == RET_NOT_FOUND, gone.stderr


# ------------------------------------------------------------------------------- the judge


def _env(ident: str, text: str, **extra: Any) -> Envelope:
    job = SummarizeJob(type="summarize", id=ident, text=text, max_tokens=100, **extra)
    return Envelope(job=job, batch="b", enqueued_at=0.0)


def _res(ident: str, text: str, tokens: int, status: str = "completed", **extra: Any) -> JobResult:
    return JobResult(id=ident, batch="b", type="summarize", status=status, text=text,
                     usage=Usage(completion_tokens=tokens), timings=Timings(enqueued_at=0.0),
                     **extra)  # fmt: skip


@pytest.mark.unit
def test_the_canary_spreads_over_the_input(tmp_path: Path) -> None:
    assert spacing(1000, 0.02, 10) == 50  # 20 lines, one in 50
    assert spacing(30, 0.02, 10) == 3  # the minimum of 10
    assert spacing(5, 0.02, 10) == 1  # fewer lines than that: all of them
    src = tmp_path / "in.jsonl"
    src.write_text("x\n\n" * 100)  # 100 lines and blank ones between them
    assert count_lines(str(src)) == 100
    parsed = [Parsed(line=n) for n in range(100)]
    picked = [p.line for p in pick(parsed, 0.1, 5, 100, "batch-1")]
    assert [n // 10 for n in picked] == list(range(10))  # one in each tenth of the input
    assert picked == [p.line for p in pick(parsed, 0.1, 5, 100, "batch-1")]  # the same again
    # of an input whose kinds take turns (summarize, extract, codegen, ...), more than one kind
    assert len({n % 3 for n in picked}) > 1, picked


@pytest.mark.unit
def test_a_canary_line_gives_way_to_the_first_valid_line_of_its_id() -> None:
    def line(ident: str, kind: str = "summarize") -> bytes:
        return json.dumps({"id": ident, "type": kind, "text": "t"}).encode()

    raws = [line("a"), b'{"id": "b", "type": "nope"}', line("b"), line("a"), line("b"),
            line("c"), line("c")]  # fmt: skip
    numbered = list(enumerate(raws, 1))
    chosen = {n: parse_line(n, raws[n - 1]) for n in (2, 4, 5, 6, 7)}
    owners = first_owners(chosen, numbered, parse_line)
    # "a" and "b" move to their first valid lines (line 2 is invalid: it owns nothing), "c"
    # keeps line 6, and line 2's error leaves the canary
    assert [p.line for p in owners] == [1, 3, 6]
    assert [p.job.id for p in owners if p.job] == ["a", "b", "c"]


@pytest.mark.unit
def test_the_script_of_an_answer_is_told_from_its_letters() -> None:
    assert script("The committee met twice and agreed on nothing at all.") == "LATIN"
    assert script("委员会开会两次，但在任何事情上都没有达成一致意见，这让大家很失望。") == "CJK"
    assert script("Комитет собирался дважды и ни о чём не договорился вообще.") == "CYRILLIC"
    assert script("OK, 42.") is None  # too few letters to tell
    assert script("The committee met twice 委员会开会两次，但在任何事情上都没有") is None  # mixed


@pytest.mark.unit
def test_the_judge_names_each_threshold_crossed() -> None:
    s = Settings(_env_file=None)  # type: ignore[call-arg]
    chinese = "委员会开会两次，但在任何事情上都没有达成一致意见，这让大家很失望。"
    english = "The committee met twice and agreed on nothing at all, to everyone's regret."
    jobs = [_env(f"j{i}", chinese) for i in range(10)]
    # answers short, in the input's language, all completed: it passes
    good = [_res(f"j{i}", chinese, tokens=20) for i in range(10)]
    report = judge(jobs, good, s)
    assert report.passed and report.jobs == 10 and report.length == pytest.approx(0.2), report
    # answered in English, three loops, one low in confidence, every answer at max_tokens
    loop = JobError(type="loop", message="repeats")
    bad = [_res(f"j{i}", english, tokens=100) for i in range(6)]
    bad += [_res("j6", english, tokens=100, low_confidence=True)]
    bad += [_res(f"j{i}", english, tokens=100, status="failed", error=loop) for i in (7, 8, 9)]
    report = judge(jobs, bad, s)
    shares = (report.failed, report.runaway, report.wrong_language, report.low_confidence)
    assert shares == pytest.approx((0.3, 0.3, 1.0, 0.1)) and report.length == 1.0, report
    words = " ".join(report.reasons)
    for env_var in ("FAILED", "RUNAWAY", "WRONG_LANGUAGE", "LENGTH"):
        assert f"VQUEUE_CANARY_MAX_{env_var}" in words, words
    assert "LOW_CONFIDENCE" not in words  # 10% is within its 20%
    assert "3 of 10 failed, at least 11% at 95% confidence" in words, words
    # one unlucky job in ten is not enough to pause a batch (at least 2%, under 5%)
    one = [_res(f"j{i}", chinese, tokens=20) for i in range(9)]
    one += [_res("j9", chinese, tokens=20, status="failed", error=loop)]
    assert judge(jobs, one, s).passed and lower_bound(1, 10) == pytest.approx(0.018, abs=1e-3)
    assert lower_bound(2, 10) > 0.05 and lower_bound(0, 10) == 0.0
    # answers that run to max_tokens because their jobs asked for it do not count
    long = [_env(f"j{i}", chinese, min_tokens=100) for i in range(5)]
    long += [_env(f"j{i}", chinese, ignore_eos=True) for i in range(5, 10)]
    asked = judge(long, [_res(f"j{i}", chinese, tokens=100) for i in range(10)], s)
    assert asked.passed and asked.length == 0.0, asked
    # and each threshold is the user's to set
    lenient = Settings(_env_file=None, canary_max_failed=0.5, canary_max_runaway=0.5,  # type: ignore[call-arg]
                       canary_max_wrong_language=1, canary_max_length=1)  # fmt: skip
    assert judge(jobs, bad, lenient).passed
