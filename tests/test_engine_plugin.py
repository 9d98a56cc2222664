"""vqueue's code inside vLLM (worker/vllm_ext): it changes how vLLM's engine step runs guided
decoding and the confidence monitor, never what it produces; it is installed only on the vLLM
releases it was verified on, and only in engines a vqueue worker starts.

The end-to-end check runs two real engines on the embedded model, one with vLLM's own guided
step and one with the plugin's, on the same extraction prompts, through the raw-vLLM benchmark
(``benchmarks/guided_raw.py``), and compares every token.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_the_plugin_is_registered_with_vllm() -> None:
    found = [e.value for e in entry_points(group="vllm.general_plugins") if e.name == "vqueue"]
    assert found == ["worker.vllm_ext.plugin:vllm_plugin"]


def test_every_vllm_symbol_an_optimization_touches_is_the_one_it_was_verified_on() -> None:
    # Each optimization names the vLLM releases it was verified on and the exact source of every
    # vLLM function or class it replaces, wraps or implements. On the vLLM installed here, every
    # one that lists this release finds the same source: an upgrade that changes one fails in CI
    # (here), not silently in production.
    from worker.vllm_ext.compat import (
        FINGERPRINTS,
        SYMBOLS,
        VERIFIED,
        fingerprint,
        release,
        vllm_version,
    )

    rel = release(vllm_version())
    assert rel in FINGERPRINTS, f"vLLM {vllm_version()} is not in the compatibility table"
    here = [name for name, versions in VERIFIED.items() if rel in versions]
    assert {
        "monitor-v1",
        "monitor-v2",
        "guided-batching",
        "grammar-reuse",
        "urgent-preempt",
        "loop-check",
    } <= set(here)
    for name in here:
        for module, qualname in SYMBOLS[name]:
            key = f"{module}:{qualname}"
            assert fingerprint(module, qualname) == FINGERPRINTS[rel][key], (name, key)
    # and the CPU engine in the tests takes every one of them
    from worker.vllm_ext.compat import plan

    p = plan(vllm_version(), v2=False)
    assert (p.monitor, p.guided_batching, p.grammar_reuse, p.mask_reorder) == ("v1", True, True,
                                                                             True)  # fmt: skip
    assert plan(vllm_version(), v2=True).monitor == "v2" and p.missing == {}
    # the loop check where loops are watched, never else
    assert p.loop_check and not plan(vllm_version(), v2=False, loops=False).loop_check
    # urgent preemption where the settings want it (urgent jobs at vLLM priority 0), never else
    assert plan(vllm_version(), v2=False, urgent_order=0).urgent_order == 0
    assert p.urgent_order is None
    assert plan(vllm_version(), v2=False, urgent_order=0, patches=False).urgent_order is None


def test_an_unknown_vllm_gets_none_of_it_and_an_error_for_each(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Given a vLLM release no optimization was verified on (the one pip would bring next)
    from worker.vllm_ext.compat import log_missing, plan

    for v2 in (False, True):
        p = plan("0.33.0", v2=v2, urgent_order=0)
        # Then nothing of vqueue's goes into it: early stop falls back to vLLM's own logprobs
        assert p.monitor == "logprobs"
        assert not (p.guided_batching or p.grammar_reuse or p.mask_reorder)
        assert p.urgent_order is None and not p.loop_check
        assert p.degraded
        # and the worker logs one ERROR per optimization, naming it, the version and the fallback
        caplog.clear()
        log_missing(p)
        errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
        assert len(errors) == 6, errors
        assert all("vLLM 0.33.0 is not a release it was verified on" in e for e in errors)
        assert any("monitor" in e and "vLLM's own logprobs" in e for e in errors)
        assert any("loop-check" in e and "cycles of up to 32 tokens" in e for e in errors)
    # and a changed function within a verified release is caught by its fingerprint, not trusted
    from worker.vllm_ext import compat

    key = "vllm.v1.structured_output:StructuredOutputManager.grammar_bitmask"
    saved = compat.FINGERPRINTS["0.32"][key]
    compat.FINGERPRINTS["0.32"][key] = "000000000000"
    try:
        reason = compat.why_not("guided-batching", "0.32.9") or ""
        assert "is not the source it was verified on" in reason
    finally:
        compat.FINGERPRINTS["0.32"][key] = saved


PLUGIN_CHECK = """
import json
from vllm.plugins import load_general_plugins
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.structured_output.backend_guidance import GuidanceBackend
from vllm.v1.core.sched import utils
load_general_plugins()
print(json.dumps({
    "batched": getattr(StructuredOutputManager.grammar_bitmask, "__vqueue__", False),
    "reuse": getattr(GuidanceBackend.compile_grammar, "__vqueue__", False),
    "loops": utils.check_sequence_repetition.__module__ == "worker.vllm_ext.loops",
}))
"""


def test_the_plugin_acts_only_in_engines_a_worker_starts() -> None:
    # Given a vLLM process in the same environment that no vqueue worker started (`vllm serve`)
    def run(env: dict[str, str]) -> dict[str, bool]:
        proc = subprocess.run([sys.executable, "-c", PLUGIN_CHECK], env=env, capture_output=True,
                              text=True, cwd=ROOT, timeout=300)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-2000:]
        return dict(json.loads(proc.stdout.strip().splitlines()[-1]))

    bare = {k: v for k, v in os.environ.items() if not k.startswith("VQUEUE_ENGINE")}
    # Then vLLM loads the plugin there, and it changes nothing
    assert run(bare) == {"batched": False, "reuse": False, "loops": False}
    # while in an engine a worker starts (its pid and plan in the environment) it installs
    # what the plan says
    from worker.vllm_ext.compat import plan, vllm_version

    p = plan(vllm_version(), v2=False)
    owned = dict(bare, VQUEUE_ENGINE_OWNER=str(os.getpid()),
                 VQUEUE_ENGINE_PLAN=json.dumps(p.as_dict()))  # fmt: skip
    assert run(owned) == {"batched": True, "reuse": True, "loops": True}


def test_the_v2_monitor_through_vllms_public_interface(tmp_path: Path) -> None:
    # Given vLLM's own Model Runner V2 interface for custom logits processors (0.32 on), its
    # request-state and batch-layout types, and the monitor implementing it
    from types import SimpleNamespace

    import torch
    from vllm.v1.worker.gpu.sample.logits_processor import (
        LogitsContext,
        LogitsProcessor,
        LogitsProcRequestState,
    )

    from worker.confidence import ConfidenceBoard, Monitor, request_args
    from worker.vllm_ext.monitor import V2Monitor

    assert issubclass(V2Monitor, LogitsProcessor)
    vocab, marker, slots = 50, 49, 4
    prefill = torch.full((slots,), 1, dtype=torch.int32)
    state = LogitsProcRequestState(
        device=torch.device("cpu"), max_num_reqs=slots, vocab_size=vocab, all_token_ids=None,
        prompt_len=None, prefill_len=SimpleNamespace(gpu=prefill), total_len=None,
    )  # type: ignore[arg-type]  # fmt: skip
    mon = V2Monitor(SimpleNamespace(), state)
    board = ConfidenceBoard(str(tmp_path))
    watched = board.slot()
    # When one request is watched (a threshold every token misses, window 2) and one is not
    args = request_args(board, watched, Monitor(0.0, 2, 0, True), marker)
    V2Monitor.validate_params(SimpleNamespace(extra_args=args))
    assert mon.add_request(1, SimpleNamespace(extra_args=args))
    assert not mon.add_request(3, SimpleNamespace(extra_args=None))
    forced = []
    for step in range(3):
        logits = torch.randn((2, vocab))
        rows = torch.tensor([3, 1], dtype=torch.int32)
        ctx = LogitsContext(
            expanded_idx_mapping=rows, idx_mapping=rows, idx_mapping_np=rows.numpy(),
            expanded_local_pos=torch.zeros(2, dtype=torch.int32), input_ids=torch.zeros(2),
            pos=torch.full((2,), 5 + step), seq_lens_upper_bound_np=np.full(2, 6 + step),
        )  # fmt: skip
        out = mon.apply(logits, ctx)
        forced.append((bool(out[0, marker] == 1e9), bool(out[1, marker] == 1e9)))
    # Then the watched row is forced to the marker from its second token on, the other never,
    # and its numbers are on the worker's board
    assert forced == [(False, False), (False, True), (False, True)]
    reading = board.read(watched, 3, wait_s=0)
    assert reading.tokens == 3 and reading.fired
    board.close()


@pytest.mark.parametrize("rows", [[3, 0, 5], list(range(7)), [6], [1, 2, 0, 4, 3, 6, 5]])
def test_masks_land_on_their_batch_rows(rows: list[int]) -> None:
    # Given a compact bitmask whose row i belongs to batch row rows[i]
    import torch

    from worker.vllm_ext.guided import _apply_in_batch_order

    rng = np.random.default_rng(len(rows))
    batch, vocab = 7, 1000
    words = (vocab + 31) // 32
    compact = rng.integers(-(2**31), 2**31 - 1, size=(len(rows), words), dtype=np.int64)
    compact = compact.astype(np.int32)
    logits = torch.randn(batch, vocab)
    # When it is applied
    _apply_in_batch_order(logits, compact, rows)
    # Then exactly the tokens whose bit is clear in that row's mask are ruled out, and rows
    # without a mask keep every token
    full = np.full((batch, words), -1, dtype=np.int32)
    for i, r in enumerate(rows):
        full[r] = compact[i]
    allowed = np.unpackbits(full.view(np.uint8), bitorder="little").reshape(batch, -1)[:, :vocab]
    assert np.array_equal(torch.isinf(logits).numpy(), allowed == 0)


@pytest.mark.engine
def test_batched_guided_step_gives_the_same_tokens(tmp_path: Path) -> None:
    # Given the same extraction prompts on two real engines: vLLM's guided step, and the plugin's
    # (batched, with grammar reuse)
    from worker.models import prepare_embedded

    model = prepare_embedded()
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.guided_raw",
            "--model",
            str(model),
            "--out",
            str(tmp_path),
            "--jobs",
            "8",
            "--max-tokens",
            "40",
            "--rounds",
            "1",
            "--variants",
            "stock,parallel",
            "--tokens-only",
        ],  # fmt: skip
        cwd=ROOT,
        env={**os.environ, "VLLM_LOGGING_LEVEL": "INFO"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    # Then the plugin was in the engine that was meant to have it, and only there: the stock
    # engine ran vLLM's own guided step
    logs = run.stdout + run.stderr
    assert logs.count("guided decoding's matchers and masks run batched") >= 1
    assert logs.count("requests share compiled grammars") >= 1  # 8 jobs over 4 schemas
    rows, plans = {}, {}
    for variant in ("stock", "parallel"):
        lines = [
            json.loads(x) for x in (tmp_path / f"guided-{variant}.jsonl").read_text().splitlines()
        ]
        rows[variant] = next(r for r in lines if r.get("run") == "guided")
        plans[variant] = next(r["plan"] for r in lines if "plan" in r)
    assert not plans["stock"]["guided_batching"] and not plans["stock"]["grammar_reuse"]
    assert plans["parallel"]["guided_batching"] and plans["parallel"]["grammar_reuse"]
    # and both generated the very same tokens, every one of them allowed by the job's grammar
    assert rows["stock"]["output_tokens"] > 8 * 10
    assert rows["parallel"]["digest"] == rows["stock"]["digest"]
    assert rows["stock"]["grammar_violations"] == rows["parallel"]["grammar_violations"] == 0


def test_requests_share_a_few_compiled_grammars_and_each_gets_a_matcher_of_its_own() -> None:
    # Given vLLM's guidance backend for the embedded model's tokenizer (the engine config it
    # reads is two flags), with the plugin's reuse around its own compile and validation
    from types import SimpleNamespace

    import llguidance
    from transformers import AutoTokenizer
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams
    from vllm.v1.structured_output import backend_guidance as bg
    from vllm.v1.structured_output.backend_types import StructuredOutputOptions
    from vllm.v1.structured_output.request import get_structured_output_key

    from worker.models import prepare_embedded
    from worker.vllm_ext.guided import _reused_grammars, _validated_once

    tok = AutoTokenizer.from_pretrained(prepare_embedded())
    flags = SimpleNamespace(disable_any_whitespace=True, disable_additional_properties=False)
    backend = bg.GuidanceBackend(
        vllm_config=SimpleNamespace(structured_outputs_config=flags),  # type: ignore[arg-type]
        tokenizer=tok,
        vocab_size=len(tok),
    )
    stock = getattr(bg.GuidanceBackend.compile_grammar, "__wrapped__", None)
    stock = stock or bg.GuidanceBackend.compile_grammar
    compile_ = _reused_grammars(stock, groups=2, entries=4)
    schema = json.dumps(
        {"type": "object", "properties": {"n": {"type": "integer"}, "tag": {"enum": ["a", "b"]}},
         "required": ["n", "tag"]}
    )  # fmt: skip
    text = '{"n":1234,"tag":"b"}'
    tokens = tok.encode(text, add_special_tokens=False)

    def walks_like_a_fresh_one(grammar: Any) -> None:
        fresh = stock(backend, StructuredOutputOptions.JSON, schema)
        for t in tokens:
            assert grammar.ll_matcher.compute_bitmask() == fresh.ll_matcher.compute_bitmask()
            assert grammar.ll_matcher.consume_token(t) and fresh.ll_matcher.consume_token(t)
        assert grammar.ll_matcher.is_accepting() and fresh.ll_matcher.is_accepting()

    # When requests bring the same schema, the first two (one per group) compile it, and the
    # earlier ones have taken tokens already when the later ones come
    first = compile_(backend, StructuredOutputOptions.JSON, schema)
    second = compile_(backend, StructuredOutputOptions.JSON, schema)
    assert first.ll_matcher.consume_tokens(tokens[:3])
    assert second.ll_matcher.consume_tokens(tokens[:2])
    later = [compile_(backend, StructuredOutputOptions.JSON, schema) for _ in range(3)]

    # Then each later one is a matcher of its own, at the start, and allows exactly what a
    # freshly compiled one allows at every step of a valid output
    matchers = [g.ll_matcher for g in (first, second, *later)]
    assert len({id(m) for m in matchers}) == 5
    for grammar in later:
        walks_like_a_fresh_one(grammar)
    # and the first two, whose groups the later ones share, go on from where they were
    assert first.ll_matcher.consume_tokens(tokens[3:]) and first.ll_matcher.is_accepting()
    assert second.ll_matcher.consume_tokens(tokens[2:]) and second.ll_matcher.is_accepting()
    # and a grammar that does not compile is never kept: each request gets vLLM's error
    for _ in range(3):
        broken = compile_(backend, StructuredOutputOptions.REGEX, "(")
        assert broken.ll_matcher.is_error()

    # When the frontend validates requests (vLLM's own check, counted)
    calls = []
    plain = getattr(bg.validate_guidance_grammar, "__wrapped__", bg.validate_guidance_grammar)

    def counted(params: SamplingParams, tokenizer: llguidance.LLTokenizer | None = None) -> None:
        calls.append(params)
        plain(params, tokenizer=tokenizer)

    validate = _validated_once(counted, get_structured_output_key, entries=4)
    good = SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(regex="("))
    for _ in range(3):
        validate(good)
    # Then a grammar is checked once, and a bad one each time it comes, with vLLM's error
    assert len(calls) == 1
    for _ in range(2):
        with pytest.raises(Exception, match="Grammar error"):  # ValueError in 0.26
            validate(bad)
    assert len(calls) == 3


KERNEL_CHECK = """
import torch
from worker.vllm_ext.monitor import _step, _triton_step

torch.manual_seed(0)
slots, vocab = 8, 1000
table = torch.zeros((slots, 9))
table[:, 7] = -1.0
for i in range(6):  # watched: on, threshold -2, window 2, grace 1, abort, marker 999; board 0
    table[i] = torch.tensor([1.0, -2.0, 2, 1, 1.0, 999, 0.0, 0, 2 * i])
table[2, 6] = 1.0  # fresh: its counters restart
table[1, 6] = 1.0  # fresh and, with lengths, still prefilling: zeroed, not counted
table[4, 4] = 0.0  # the last attempt: watched, never aborted
rows = torch.tensor([3, 0, -1, 5, 2, 1, 4, 6], dtype=torch.int32)  # row -> slot; slot 6 is off
lens = torch.tensor([9, 9, 9, 9, 9, 3, 9, 9])  # positions: row 5 (slot 1) is short of its
pre = torch.full((slots,), 5, dtype=torch.int32)  # prefill of 5 tokens
forced = 0
for has_lens in (False, True):
    state = torch.rand((slots, 5)) * 3
    state[:, 0] = torch.tensor([0, 3, 5, 1, 4, 2, 0, 0]).float()
    state[:, 3] = torch.tensor([0, 1, 1, 2, 1, 0, 0, 0]).float()
    state[:, 4] = 0.0
    x = torch.randn((8, vocab)) * 4
    x[1, :500] = float("-inf")  # a grammar mask
    x[0] = 0.0  # flat: top-1 logprob is -log(vocab)
    xk, xe, sk, se = x.clone(), x.clone(), state.clone(), state.clone()
    board = torch.zeros((16, 4))
    boards = torch.tensor([board.data_ptr()], dtype=torch.int64)
    ln, pr = (lens, pre) if has_lens else (rows, rows)
    _triton_step()[(8,)](
        xk, xk.stride(0), vocab, rows, ln, pr, sk, table, boards,
        HAS_LENS=has_lens, BOARDS=True, BLOCK=256,
    )
    _step(xe, rows, lens if has_lens else None, pre if has_lens else None, se, table)
    assert torch.allclose(sk, se, atol=1e-4), (has_lens, sk, se)
    assert torch.equal(xk, xe), has_lens
    for r, slot in enumerate(rows.tolist()):  # each counted row's numbers are on its board row
        if slot >= 0 and table[slot, 0] > 0:
            counted = not (has_lens and r == 5)
            want = se[slot][[0, 1, 2, 4]] if counted else torch.zeros(4)
            assert torch.allclose(board[2 * slot], want, atol=1e-4), (has_lens, r)
    assert has_lens or float(se[1, 0]) > 0
    assert not has_lens or float(se[1].abs().sum()) == 0  # zeroed, not counted
    forced += int((xk[:, 999] == 1e9).sum())
assert forced > 0
print("same", forced)
"""


def test_the_monitor_kernel_matches_the_eager_step() -> None:
    # Given the monitor's Triton kernel, run by Triton's interpreter on the CPU, and the eager
    # step the CPU engine uses, on the same rows: mapped to slots out of order, fresh, still
    # prefilling, masked with -inf, watched without abort, unwatched and switched off
    env = dict(os.environ, TRITON_INTERPRET="1")
    # When both take a step, without and with the rows' positions
    run = subprocess.run(
        [sys.executable, "-c", KERNEL_CHECK], cwd=ROOT, env=env, capture_output=True, text=True
    )
    # Then every slot has the same counters, every row the same logits (marker forced
    # included), and the kernel wrote each counted row's numbers into the board itself
    assert run.returncode == 0 and "same" in run.stdout, run.stderr[-3000:]


def test_the_v2_monitor_keeps_counters_by_slot_and_skips_prefill(tmp_path: Path) -> None:
    # Given the monitor as Model Runner V2 drives it: requests keyed by the slot they hold for
    # their whole stay, rows in any order, positions per row, each slot's prefill length
    from types import SimpleNamespace

    import torch

    from worker.confidence import ConfidenceBoard, Monitor, request_args
    from worker.vllm_ext.monitor import SlotMonitor

    vocab, marker = 50, 49
    prefill = torch.full((4,), 5, dtype=torch.int32)
    board = ConfidenceBoard(str(tmp_path))
    mon = SlotMonitor(4, vocab, torch.device("cpu"), False, SimpleNamespace(gpu=prefill))
    slots = {n: board.slot() for n in "abc"}
    seen: dict[str, list[float]] = {n: [] for n in "abc"}
    rng = torch.Generator().manual_seed(5)

    def add(slot: int, n: str) -> None:
        args = request_args(board, slots[n], Monitor(-1000.0, 2, 0, True), marker)
        assert mon.add_request(slot, SimpleNamespace(extra_args=args))

    def step(batch: list[tuple[int, str, int]]) -> None:  # (slot, name, position)
        logits = torch.randn((len(batch), vocab), generator=rng)
        top1 = torch.log_softmax(logits, dim=-1).max(dim=-1).values
        rows = np.array([slot for slot, _, _ in batch], dtype=np.int32)
        pos = torch.tensor([p for _, _, p in batch])
        mon.apply(logits, torch.from_numpy(rows), rows, pos)
        for i, (_, n, p) in enumerate(batch):
            if p + 1 >= 5:  # its prefill is done: this row's token is kept
                seen[n].append(float(top1[i]))

    # When "a" prefills in two chunks while "b" decodes, the rows swap order, and "b" leaves
    # and "c" takes its slot
    add(2, "a")
    add(0, "b")
    step([(2, "a", 2), (0, "b", 4)])
    step([(0, "b", 5), (2, "a", 4)])
    add(0, "c")
    step([(0, "c", 4), (2, "a", 5)])
    # Then each request's numbers are its own kept tokens', never a chunk's or the slot's last
    # occupant's
    assert [len(seen[n]) for n in "abc"] == [2, 2, 1]
    for n, values in seen.items():
        got = board.read(slots[n], len(values), wait_s=0)
        assert got.tokens == len(values), n
        assert got.min_logprob == pytest.approx(min(values), abs=1e-4), n
        assert got.mean_logprob == pytest.approx(sum(values) / len(values), abs=1e-4), n
    board.close()


def test_the_monitor_keeps_each_requests_counters_through_batch_changes(tmp_path: Path) -> None:
    # Given a monitor on the CPU and requests that join, leave, move and swap rows between steps,
    # as vLLM reports them
    from enum import Enum
    from types import SimpleNamespace

    import torch

    from worker.confidence import ConfidenceBoard, Monitor, request_args
    from worker.vllm_ext.monitor import V1Monitor

    Move = Enum("Move", "SWAP UNIDIRECTIONAL")
    rows, vocab, marker = 6, 50, 49
    config = SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_seqs=rows),
        model_config=SimpleNamespace(get_vocab_size=lambda: vocab),
    )
    board = ConfidenceBoard(str(tmp_path))
    mon = V1Monitor(config, torch.device("cpu"), False)
    slots = {name: board.slot() for name in "abcd"}
    rules = {n: Monitor(-1000.0, 2, 0, True) for n in "abc"} | {"d": Monitor(0.0, 2, 1, True)}
    outputs: dict[str, list[int]] = {n: [] for n in "abcd"}
    seen: dict[str, list[float]] = {n: [] for n in "abcd"}
    at: dict[int, str] = {}
    forced: list[str] = []
    rng = torch.Generator().manual_seed(3)

    def change(added: dict[int, str] | None = None, removed: tuple = (), moved: tuple = ()) -> None:
        added = added or {}
        for i in removed:
            del at[i]
        for i, n in added.items():
            at[i] = n
        for a, b, kind in moved:
            if kind is Move.SWAP:
                at[a], at[b] = at[b], at[a]
            else:
                at[b] = at.pop(a)
        mon.update_state(
            SimpleNamespace(
                removed=list(removed),
                added=[
                    (
                        i,
                        SimpleNamespace(extra_args=request_args(board, slots[n], rules[n], marker)),
                        None,
                        outputs[n],
                    )
                    for i, n in added.items()
                ],  # fmt: skip
                moved=list(moved),
            )
        )

    def step() -> None:
        b = max(at) + 1
        logits = torch.randn((b, vocab), generator=rng) * 3
        top1 = torch.log_softmax(logits, dim=-1).max(dim=-1).values
        mon.apply(logits)
        for i, n in at.items():
            seen[n].append(float(top1[i]))
            outputs[n].append(1)
            if logits[i, marker] == 1e9:
                forced.append(n)

    # When they run through adds, a removal with a move into the gap, a swap and a new arrival
    change(added={0: "a", 1: "b", 2: "c"})
    step()
    step()
    change(removed=(1,), moved=((2, 1, Move.UNIDIRECTIONAL),), added={2: "d"})
    step()
    change(moved=((0, 1, Move.SWAP),))
    step()
    step()
    # Then each request's numbers are its own tokens' top-1 logprobs, wherever its row was
    for n, values in seen.items():
        got = board.read(slots[n], len(values), wait_s=0)
        assert got.tokens == len(values), n
        assert got.min_logprob == pytest.approx(min(values), abs=1e-4), n
        assert got.mean_logprob == pytest.approx(sum(values) / len(values), abs=1e-4), n
    # and the rule fired only for the request whose threshold every token misses: at its
    # second token (window 2, past a grace of 1), and at every step after
    assert forced == ["d", "d"] and board.read(slots["d"], 0, wait_s=0).fired
    assert not any(board.read(slots[n], 0, wait_s=0).fired for n in "abc")
    board.close()
