"""The balancer under data parallelism: dp 2 × tp 2 (4 ranks, tp groups [0, 1] and [2, 3]),
plait's GPT in float64, the loop ``plait train --dp 2 --tp 2 --balance POLICY --no-overlap``
runs (``plait.training.dp_tp.RankParallel``: DDP over dp, the balancer on each tp group with
its speeds agreed over dp), rank 1 (replica 0, tp position 1) made 3 × slower at compute.
Every rank is a virtual device (:mod:`plait.testing.virtual`, timed by its products' FLOPs,
planning by speed alone), so the speeds read (1, 1/3) exactly and the first decision is known:
3 warm-up steps, then an exchange every 2 steps; the window of 5 is half full after step 8
and the imbalance has lasted ``CONFIRM_STEPS`` = 3 steps at step 10.

- ``migrate``, on the plain path and on the fused sequence-parallel one: after every step,
  both replicas hold the same plans (every ``ShardPlan`` of the model; gathered from the
  ranks), both dims migrate at step 10 to ``static_plan`` for (1, 1/3) (heads 3:1, columns
  96:32), and every step's loss equals a single process's on the global batch (the plain
  GPT, the same loop, AdamW and schedule) within 1e-9 (~2e-15 seen): migration is exact,
  and DDP reduces the new shapes after it.
- ``semi``: after every step, both replicas hold the same plans and the same resizing (each
  dim's kept share and the very features kept); both dims resize at step 10, rank 1 keeping
  half (``max_skip``: 0.5 of the 2/3 its speed would skip).

Replica 1 is not slowed: without the agreement over dp it would see balanced speeds and act
otherwise than replica 0. A change of plan under FSDP2 (dp 2 × tp 1) is refused in one line
on every rank.
"""

import dataclasses

import pytest
import torch
import torch.distributed as dist

from plait.models import GPT
from plait.parallel.data import data_parallel, dp_tp_mesh, replanned, replica_signature
from plait.plan import ShardPlan
from plait.runtime import rank_context
from plait.runtime.slow.straggler import SlowSpec, Straggler
from plait.testing import raised, run_ranks
from plait.training.components import OnStep, Straggling
from plait.training.config import TrainConfig
from plait.training.data import CharCorpus
from plait.training.dp_tp import RankParallel
from plait.training.loop import Trainer, cosine_schedule
from plait.training.models import build_gpt, gpt_loss

TOL = 1e-9
SLOW, FACTOR = 1, 3.0
SIZES = dict(model="gpt", n_layer=1, n_head=4, n_embd=32, seq_len=16, batch_size=8, lr=1e-2,
             eval_batches=0, dp=2, tp=2, overlap=False)


def _config(policy: str, steps: int) -> TrainConfig:
    return TrainConfig(balance=policy, steps=steps, **SIZES)


def _state(run: RankParallel) -> dict:
    """What both replicas must hold alike: every plan of the model, and per dim each layer's
    kept share and kept features (None: all)."""
    out = {"plans": replica_signature(run.tp_model)["plans"]}
    for dim, layers in run.balancer.dims.items():
        out[dim] = [(layer.keep, None if layer._kept is None else layer._kept.tolist())
                    for layer in layers]
    return out


def _train(cfg: TrainConfig) -> dict:
    from plait.testing.virtual import VirtualDevice

    # timed by FLOPs, by speed alone (the unmovable reading is test_unmovable's): the speeds
    # are (1, 1/3) exactly at every exchange, so when and what the balancer decides is known
    device = VirtualDevice().install(unmovable=False)  # in this rank's process only
    torch.set_default_dtype(torch.float64)
    rank = dist.get_rank()
    rank_context().straggler = Straggler([SlowSpec(rank=SLOW, factor=FACTOR)], rank)
    run = RankParallel(cfg)
    corpus = CharCorpus.load()
    model = run.wrap(build_gpt(cfg, run.tp_group, vocab_size=corpus.vocab_size))
    batches = run.replica_rows(corpus.batches("train", cfg.batch_size, cfg.seq_len,
                                              seed=cfg.seed + 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    run.attach(model, optimizer)
    states = []
    # the straggler's step, the balancer's (DDP rebuilt after a migration), the loss over dp,
    # then this test's look at the balancer
    look = OnStep(lambda record: states.append(_state(run)))
    trainer = Trainer(model, optimizer, gpt_loss, schedule=cosine_schedule(cfg.steps, cfg.lr),
                      components=[Straggling(), *run.components(), look])
    with device:
        history = trainer.run(batches, cfg.steps)
    return {"losses": [r["loss"] for r in history], "states": states,
            "decisions": [d.to_json() for d in run.balancer.log], "replica": run.replica,
            "kind": run.dp_kind}


def _reference(cfg: TrainConfig) -> list[float]:
    """Every step's loss of the plain GPT (no plait layer) in this process on the global batch,
    float64, through the same loop (one process: no straggler, no balancer)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        corpus = CharCorpus.load()
        torch.manual_seed(cfg.seed)
        model = GPT(cfg.gpt_config(corpus.vocab_size))
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
        batches = corpus.batches("train", cfg.batch_size, cfg.seq_len, seed=cfg.seed + 1)
        trainer = Trainer(model, optimizer, gpt_loss,
                          schedule=cosine_schedule(cfg.steps, cfg.lr))
        history = trainer.run(batches, cfg.steps)
        return [r["loss"] for r in history]
    finally:
        torch.set_default_dtype(previous)


def _same_on_both_replicas(results: list[dict]) -> None:
    assert [r["replica"] for r in results] == [0, 0, 1, 1]
    assert {r["kind"] for r in results} == {"DDP"}
    for tp_rank in range(2):
        ours, theirs = results[tp_rank]["states"], results[2 + tp_rank]["states"]
        assert len(ours) == len(theirs)
        for step, (a, b) in enumerate(zip(ours, theirs)):
            assert a == b, (tp_rank, step, a, b)
        # the same decisions, for the same reasons (a migration's own seconds differ)
        assert _decided(results[tp_rank]) == _decided(results[2 + tp_rank])


def _show(results: list[dict]) -> None:
    for d in results[0]["decisions"]:
        print(f"step {d['step']} {d['dim']}: {d['kind']} → {d['sizes']} {d.get('fractions', '')}")


def _decided(result: dict) -> list[dict]:
    return [{k: v for k, v in d.items() if k != "migration"} for d in result["decisions"]]


def _train_each(cfgs: list[TrainConfig]) -> list[dict]:
    return [_train(cfg) for cfg in cfgs]


def _first_decisions(kind: str) -> list[tuple]:
    """Both dims' decision at step 10 (see the module doc): (step, dim, kind, sizes)."""
    from plait.balance import static_plan

    speeds = (1.0, 1 / FACTOR)
    units = {"blocks.0.attn": SIZES["n_head"], "blocks.0.mlp": 4 * SIZES["n_embd"]}
    return [(10, dim, kind, list(static_plan(n, speeds).sizes if kind == "migrate"
                                 else ShardPlan.even(n, 2).sizes)) for dim, n in units.items()]


def _steps_of(decisions: list[dict]) -> list[tuple]:
    return [(d["step"], d["dim"], d["kind"], d["sizes"]) for d in decisions]


def test_migrate_agrees_across_replicas_and_matches_one_process():
    plain = _config("migrate", steps=14)
    # the fused sequence-parallel path: DDP sees its gradients (plait.parallel.choose_kind)
    fused_sp = dataclasses.replace(plain, overlap=True, sequence_parallel=True)
    launched = run_ranks(_train_each, 4, [plain, fused_sp], timeout_s=60)
    for i, cfg in enumerate((plain, fused_sp)):
        results = [out[i] for out in launched]
        _show(results)
        _same_on_both_replicas(results)
        decisions = results[0]["decisions"]
        assert _steps_of(decisions) == _first_decisions("migrate"), decisions
        assert all(d["migration"]["bytes_moved"] > 0 for d in decisions), decisions
        want = _reference(cfg)
        for rank, out in enumerate(results):
            assert out["losses"] == pytest.approx(want, rel=0, abs=TOL), (cfg, rank,
                                                                          out["losses"], want)


def test_semi_agrees_across_replicas():
    cfg = _config("semi", steps=13)
    results = run_ranks(_train, 4, cfg, timeout_s=60)
    _show(results)
    _same_on_both_replicas(results)
    decisions = results[0]["decisions"]
    assert _steps_of(decisions) == _first_decisions("resize"), decisions
    assert [d["fractions"] for d in decisions] == [[1.0, 0.5]] * 2, decisions


def _fsdp_refused() -> dict:
    torch.set_default_dtype(torch.float64)
    mesh = dp_tp_mesh(dp=2, tp=1)
    cfg = TrainConfig(balance="even", steps=1, **{**SIZES, "tp": 1})
    model = data_parallel(build_gpt(cfg, mesh.get_group("tp")), mesh, kind="fsdp")
    return raised({"replanned": lambda: replanned(model, mesh)})


def test_a_change_of_plan_under_fsdp2_is_refused():
    for seen in run_ranks(_fsdp_refused, 2):
        line = seen["replanned"]
        assert line.startswith("ValueError: a change of plan under FSDP2 is not supported"), line
        assert "\n" not in line
