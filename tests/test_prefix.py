"""Prefix-aware routing and gating with two real workers (real engine, small model)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis

from producer import Client
from protocol.routing import rank, worker_queue
from schemas import Envelope
from worker.models import resolve_model

from .conftest import RUN, Procs, WorkerProc, make_settings, run_cli, wait_for

pytestmark = pytest.mark.engine

Q = f"vqtest-{RUN}-route"
CONTEXT = (
    "def parse(line):\n    key, _, value = line.partition('=')\n    return key.strip(), value\n"
) * 12  # a shared code context of a few hundred tokens


def make_adapter(where: Path) -> Path:
    """A LoRA adapter of the embedded model, made with peft: rank 8 on the attention's query
    and value projections, its B weights random (peft starts them at zero, which would leave
    the model's answers as they are), so its answers differ from the model's."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        resolve_model(make_settings().model), dtype=torch.float32
    )
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    tuned = get_peft_model(model, config)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, weights in tuned.named_parameters():
            if "lora_B" in name:
                weights.normal_(0, 0.5)
    tuned.save_pretrained(str(where))
    return where


@pytest.fixture(scope="module")
def two_workers(
    module_procs: Procs, redis_client: redis.Redis, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, WorkerProc]:
    # each also answers to a name of its own: jobs naming it are routed to it alone; rb also
    # serves a LoRA adapter
    adapter = make_adapter(tmp_path_factory.mktemp("lora") / "tuned")
    env = {
        "ra": {"VQUEUE_SERVED_MODEL_NAME": "alpha,smollm2"},
        "rb": {
            "VQUEUE_SERVED_MODEL_NAME": "beta,smollm2",
            "VQUEUE_LORA_ADAPTERS": f"tuned={adapter}",
        },
    }
    ws = {n: module_procs.worker(n, Q, VQUEUE_CONCURRENCY="8", **env[n]) for n in ("ra", "rb")}
    for w in ws.values():
        w.wait_ready(redis_client)
    return ws


def _names(ws: dict[str, WorkerProc]) -> list[str]:
    return [ws["ra"].node, ws["rb"].node]


def _job(group: int, i: int, **extra: Any) -> dict[str, Any]:
    return {"id": f"g{group}-{i}", "type": "codegen", "language": "python",
            "context": f"# module {group}\n{CONTEXT}", "instruction": f"Add test {i}.",
            "max_tokens": 8, **extra}  # fmt: skip


def _expected_worker(job: dict[str, Any], names: list[str]) -> str:
    env = Envelope.model_validate({"job": job, "batch": "x", "enqueued_at": 0})
    return rank(env.prefix_key or "", names)[0]


def test_a_prefix_group_lands_on_one_worker(two_workers: dict[str, WorkerProc]) -> None:
    # Given two live workers, keeping up (no backlog reaches the spill depth), and 6 groups of
    # 4 jobs sharing a code context each, 3 groups homed on each worker (worker names carry a
    # per-run suffix, so the groups are picked by rank rather than fixed)
    client = Client(make_settings(Q, route_spill_depth=100))
    names = _names(two_workers)
    homes: dict[str, list[int]] = {n: [] for n in names}
    for g in range(64):
        home = homes[_expected_worker(_job(g, 0), names)]
        if len(home) < 3:
            home.append(g)
    groups = sorted(g for gs in homes.values() for g in gs)
    assert len(groups) == 6, homes
    jobs = [_job(g, i) for g in groups for i in range(4)]
    # When they are submitted
    results = list(client.submit_many(jobs).results(timeout=300))
    # Then each group ran on one worker, the one its prefix key ranks first
    by_group: dict[str, set[str]] = {}
    for r in results:
        by_group.setdefault(r.id.split("-")[0], set()).add(r.worker or "")
    assert all(len(ws) == 1 for ws in by_group.values()), by_group
    for g in groups:
        assert by_group[f"g{g}"] == {_expected_worker(_job(g, 0), names)}
    assert {w for ws in by_group.values() for w in ws} == set(names)  # both got keys
    # and the siblings found the group's prefix cached
    st = client.batch(results[0].batch).status()
    assert st.prefix_hit_rate and st.prefix_hit_rate > 0.4, st


def test_a_backed_up_worker_sheds_to_the_other(two_workers: dict[str, WorkerProc]) -> None:
    # Given producers that call a worker backed up at 4 waiting jobs
    client = Client(make_settings(Q, route_spill_depth=4))
    # When 24 jobs of one prefix group arrive at once
    jobs = [_job(100, i, max_tokens=24) for i in range(24)]
    results = list(client.submit_many(jobs).results(timeout=300))
    # Then its worker kept most, and the other took the overflow
    workers = [r.worker for r in results]
    home = _expected_worker(jobs[0], _names(two_workers))
    assert workers.count(home) >= 4 and 0 < len(set(workers) - {home}) <= 1
    assert len(workers) - workers.count(home) > 0


def test_jobs_naming_a_model_go_to_the_workers_serving_it(
    two_workers: dict[str, WorkerProc],
) -> None:
    # Given ra serving the model as "alpha" (and "smollm2"), rb as "beta" (and "smollm2")
    client = Client(make_settings(Q, route_spill_depth=100))
    ra, rb = _names(two_workers)
    # When prefix groups homed on either worker come as jobs naming "alpha" and jobs naming
    # "beta", with jobs naming the name both serve, and one naming a model nobody serves
    jobs = [_job(300 + g, i, model=m) for g in range(6) for i, m in enumerate(("alpha", "beta"))]
    jobs += [_job(300 + g, 2, model="smollm2") for g in range(6)]
    jobs.append(_job(399, 0, model="gamma"))
    results = {r.id: r for r in client.submit_many(jobs).results(timeout=300)}
    # Then each named job ran on the worker serving its name, whatever its prefix, and its
    # result names the model that answered
    assert len(results) == len(jobs)
    for g in range(6):
        alpha, beta, both = (results[f"g{300 + g}-{i}"] for i in range(3))
        assert (alpha.status, alpha.worker, alpha.model) == ("completed", ra, "alpha"), alpha
        assert (beta.status, beta.worker, beta.model) == ("completed", rb, "beta"), beta
        # (the name both serve routes by prefix, as a job naming no model does)
        home = _expected_worker(_job(300 + g, 2, model="smollm2"), [ra, rb])
        assert (both.status, both.worker) == ("completed", home), both
    # and the job naming a model no live worker serves failed alone, saying so
    gamma = results["g399-0"]
    assert gamma.status == "failed" and gamma.error is not None
    assert gamma.error.type == "model_not_found" and "gamma" in gamma.error.message
    # and `vqueue status` lists the names each worker answers to
    shown = run_cli("status", queue=Q).stdout.decode()
    assert f"{ra}  " in shown and "model=alpha,smollm2 " in shown, shown
    assert f"{rb}  " in shown and "model=beta,smollm2,tuned " in shown, shown


def test_a_lora_adapter_is_served_routed_and_reported(two_workers: dict[str, WorkerProc]) -> None:
    # Given rb serving the LoRA adapter "tuned" beside its model
    client = Client(make_settings(Q, route_spill_depth=100))
    ra, rb = _names(two_workers)
    ask = {"type": "chat", "max_tokens": 12,
           "messages": [{"role": "user", "content": "What is the capital of France?"}]}  # fmt: skip
    # When the same question comes three times naming the adapter and three times the model
    jobs = [{"id": f"{m}{i}", **ask, "model": m} for m in ("tuned", "beta") for i in range(3)]
    results = {r.id: r for r in client.submit_many(jobs).results(timeout=300)}
    # Then all ran on rb, the adapter's results name it, and the adapter answered otherwise
    # than the model (greedy: each answered alike every time)
    assert {(r.status, r.worker) for r in results.values()} == {("completed", rb)}, results
    assert {results[f"tuned{i}"].model for i in range(3)} == {"tuned"}
    assert {results[f"beta{i}"].model for i in range(3)} == {"beta"}
    tuned = {results[f"tuned{i}"].text for i in range(3)}
    base = {results[f"beta{i}"].text for i in range(3)}
    assert len(tuned) == 1 and len(base) == 1 and tuned != base, (tuned, base)
    # and rb's heartbeat lists the adapter among the names it answers to
    beat = {w["name"]: w for w in client.store.workers()}
    assert beat[rb]["models"] == ["beta", "smollm2", "tuned"], beat[rb]


def test_a_job_at_a_worker_not_serving_its_model_is_sent_on(
    two_workers: dict[str, WorkerProc],
) -> None:
    # Given a job naming "beta" that lands in ra's own queue, as a rescued queue or a producer's
    # stale view of the fleet puts it (this producer sends every job there)
    client = Client(make_settings(Q, route_spill_depth=100))
    ra, rb = _names(two_workers)
    client.router.route = lambda envs: {worker_queue(Q, ra): list(envs)}  # type: ignore[method-assign]
    jobs = [_job(400, 0, model="beta"), _job(401, 0, model="alpha")]
    # When they run
    results = {r.id: r for r in client.submit_many(jobs).results(timeout=300)}
    # Then ra sent the beta job on to rb, which answered it, once; ra answered its own
    assert len(results) == 2
    assert (results["g400-0"].status, results["g400-0"].worker) == ("completed", rb)
    assert (results["g401-0"].status, results["g401-0"].worker) == ("completed", ra)


def test_stopping_a_worker_moves_its_keys_and_loses_nothing(
    two_workers: dict[str, WorkerProc], redis_client: redis.Redis
) -> None:
    # Given 20 jobs routed to rb, 12 more than it holds, so they wait in its own queue
    client = Client(make_settings(Q, route_spill_depth=100))
    ra, rb = _names(two_workers)
    mine = [j for j in (_job(200 + g, 0, max_tokens=32) for g in range(80))
            if _expected_worker(j, [ra, rb]) == rb][:20]  # fmt: skip
    batch = client.submit_many(mine)
    rb_queue = worker_queue(Q, rb)
    wait_for(lambda: client.queue_depth(rb_queue) > 0, 10, "rb's backlog")
    # (rb has answered some: a stop before its first job ran would hand every one back)
    wait_for(lambda: batch.status().done > 0, 120, "rb's first answers")
    # When rb stops (SIGTERM) with its queue not empty
    assert two_workers["rb"].stop() == 0
    # (a stop asked for is no engine death: vLLM reads as errored while it stops, and nobody
    # reports that)
    log = two_workers["rb"].log_path.read_text()
    assert "engine core is gone" not in log and "the vLLM engine died" not in log
    # Then its jobs all complete (the rest on ra), and its keys now route to ra
    results = list(batch.results(timeout=300))
    assert len(results) == len(mine) and all(r.status == "completed" for r in results)
    assert {r.worker for r in results} == {ra, rb}  # rb's backlog went to ra
    assert client.queue_depth(rb_queue) == 0
    wait_for(lambda: rb not in {w["name"] for w in client.store.workers()}, 30, "rb to be gone")
    after = Client(make_settings(Q))
    res = list(after.submit_many([_job(200, 1)]).results(timeout=300))
    assert res[0].worker == ra


def test_a_cached_prefix_serves_its_own_tenant_only(worker: WorkerProc) -> None:
    # Given tenant a's job with a code context of a few hundred tokens, run to its end
    def job(i: int) -> dict[str, Any]:
        return {"id": f"t{i}", "type": "codegen", "context": f"# {RUN} salt\n{CONTEXT}",
                "instruction": f"Add test {i}.", "max_tokens": 4}  # fmt: skip

    def run(tenant: str, i: int) -> Any:
        client = Client(make_settings(worker.queue, tenant=tenant))
        return next(client.submit_many([job(i)]).results(timeout=300))

    assert run("salt-a", 0).status == "completed"
    # When tenant b sends the same context, Then none of it was cached for b (vLLM's
    # cache_salt is the tenant), while tenant a's next job finds it cached
    assert run("salt-b", 1).usage.cached_tokens == 0
    assert run("salt-a", 2).usage.cached_tokens > 0
