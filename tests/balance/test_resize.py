"""ZERO-resizing in the linear layers, the Balancer driving it, and the hetero benchmark's sums.

Resizing is checked against a single-device reference whose skipped weights are zero: the
output and the input gradient equal it, and the weight gradients equal its gradients at the
kept weights and are zero (imputed) at the skipped ones.
"""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from plait.balance import Balancer, PolicyConfig
from plait.bench.hetero import HeteroBenchConfig
from plait.bench.hetero_ideal import with_ideal
from plait.runtime.slow.scenarios import scenario_specs
from plait.nn import ColumnParallelLinear, RowParallelLinear, ShardPlan
from plait.testing import run_ranks
from plait.nn.record import record


def _resized_mlp(overlap, keep, plan_sizes, shared):
    from plait.balance.balancer import _resize_dim

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    fc_ref, proj_ref = nn.Linear(16, 24, dtype=torch.float64), nn.Linear(24, 16, dtype=torch.float64)
    plan = ShardPlan(tuple(plan_sizes))
    fc = ColumnParallelLinear.from_module(fc_ref, plan=plan, overlap=overlap, chunks=2)
    proj = RowParallelLinear.from_module(proj_ref, plan=plan, overlap=overlap, chunks=2)
    for layer in (fc, proj):
        layer.refresh_priority()
    with torch.no_grad():  # a history, so the layers' own priorities differ
        fc.weight[::2] += 0.5
        proj.weight[:, 1::2] += 0.5
    for layer in (fc, proj):
        layer.refresh_priority()
    if shared:  # as the balancer resizes a dim
        _resize_dim([fc, proj], keep[rank])
    else:
        for layer in (fc, proj):
            layer.resize(keep[rank])
    # the reference: every rank's skipped features zeroed (fc: output rows and bias, proj: columns)
    with torch.no_grad():
        fc_ref.weight.copy_(fc.full_state_dict()["weight"])
        proj_ref.weight.copy_(proj.full_state_dict()["weight"])
    fc_mask, proj_mask = torch.ones_like(fc_ref.weight), torch.ones_like(proj_ref.weight)
    everyone = [None] * world
    dist.all_gather_object(everyone, (fc._kept.tolist() if fc._kept is not None else None,
                                      proj._kept.tolist() if proj._kept is not None else None))
    for r, (fc_kept, proj_kept) in enumerate(everyone):
        start = plan.slice_of(r).start
        if fc_kept is not None:
            fc_mask[[start + k for k in sorted(set(range(plan.sizes[r])) - set(fc_kept))]] = 0
        if proj_kept is not None:
            proj_mask[:, [start + k for k in sorted(set(range(plan.sizes[r])) - set(proj_kept))]] = 0
    with torch.no_grad():
        fc_ref.weight *= fc_mask
        fc_ref.bias *= fc_mask[:, 0]
        proj_ref.weight *= proj_mask
    x = torch.randn(2, 6, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    xs, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    y = proj(F.gelu(fc(xs)))
    y_ref = proj_ref(F.gelu(fc_ref(xr)))
    (y ** 2).sum().backward()
    (y_ref ** 2).sum().backward()
    fc_grad = fc.full_state_dict(grads=True)
    proj_grad = proj.full_state_dict(grads=True)["weight"]
    return {"y": (y - y_ref).abs().max().item(), "dx": (xs.grad - xr.grad).abs().max().item(),
            "fc_dw": (fc_grad["weight"] - fc_ref.weight.grad * fc_mask).abs().max().item(),
            "fc_db": (fc_grad["bias"] - fc_ref.bias.grad * fc_mask[:, 0]).abs().max().item(),
            "proj_dw": (proj_grad - proj_ref.weight.grad * proj_mask).abs().max().item(),
            "skipped_zero": bool((fc_grad["weight"][fc_mask == 0] == 0).all()
                                 and (proj_grad[proj_mask == 0] == 0).all()),
            "same": bool((fc_mask[:, 0] == proj_mask[0]).all()),
            "skipped": int((fc_mask == 0).sum() + (proj_mask == 0).sum()),
            "work": (fc._work(), fc.weight.numel(), proj._work(), proj.weight.numel())}


@pytest.mark.parametrize("world,keep,sizes,overlap,shared", [
    (2, (1.0, 0.5), (12, 12), True, True),
    (2, (0.5, 0.75), (16, 8), False, True),
    (2, (0.5, 1.0), (12, 12), True, False),
    (4, (1.0, 0.25, 1.0, 0.5), (6, 6, 4, 8), True, True),
    (4, (0.5, 1.0, 0.5, 1.0), (6, 6, 4, 8), False, False),
])
def test_resized_layers_equal_masked_reference(world, keep, sizes, overlap, shared):
    """Both layers of an MLP resized, fused and plain, the same features (as the balancer
    resizes a dim) or each its own: output, input gradient and weight gradients equal the
    single-device MLP with the skipped features zeroed, whose gradients are zero."""
    results = run_ranks(_resized_mlp, world, overlap, keep, sizes, shared)
    assert sum(r["skipped"] for r in results) > 0
    for rank, r in enumerate(results):
        for key in ("y", "dx", "fc_dw", "fc_db", "proj_dw"):
            assert r[key] < 1e-10, (rank, key, r)
        assert r["skipped_zero"]
        assert r["same"] == shared, (rank, r)  # skipped the same features or not
        fc_work, fc_full, proj_work, proj_full = r["work"]
        n = round(keep[rank] * sizes[rank])
        assert fc_work * sizes[rank] == n * fc_full and proj_work * sizes[rank] == n * proj_full


def test_resize_refuses_bad_input_and_priority_keeps_changed_features():
    run_ranks(_resize_refusals_and_priority, 1)  # plait layers need a group: a world of one


def _resize_refusals_and_priority():
    layer = RowParallelLinear(8, 4, seed=0)
    for bad in (0.0, 1.5, -1, "half"):
        with pytest.raises(ValueError, match="keep must be in"):
            layer.resize(bad)
    for kept in ([0, 1, 2], [1, 1], [0, 8]):
        with pytest.raises(ValueError, match="kept must name 2 distinct"):
            layer.resize(0.25, kept=kept)
    layer.refresh_priority()  # the snapshot
    with torch.no_grad():
        layer.weight[:, 3] += 1.0
        layer.weight[:, 5] -= 2.0
    layer.refresh_priority()
    layer.resize(0.25)  # 2 of 8 input features: the two that changed
    assert layer._kept.tolist() == [3, 5]
    with torch.no_grad():  # the kept settle (no change); skipped feature 7 moves, unseen
        layer.weight[:, 7] += 0.1
    layer.refresh_priority()  # 3 and 5 rescored 0; the skipped keep their last score (0)
    layer.resize(0.25)
    assert layer._kept.tolist() == [0, 1]  # all tied: the skipped return, in index order
    layer.resize(1.0)
    with torch.no_grad():
        layer.weight[:, 7] += 0.1
    layer.refresh_priority()  # nobody skipped: every feature rescored, and 7 moved
    layer.resize(0.125)
    assert layer._kept.tolist() == [7]
    layer.resize(1.0)
    assert layer._kept is None and layer.keep == 1.0
    heads = RowParallelLinear(8, 4, unit=2, seed=0)  # 4 units of 2: resized in whole units
    heads.refresh_priority()
    with torch.no_grad():
        heads.weight[:, 3] += 1.0
    heads.refresh_priority()
    heads.resize(0.3)
    assert heads._kept.tolist() == [2, 3] and heads.keep == 0.25
    with pytest.raises(ValueError, match="in whole units of 2"):
        heads.resize(0.25, kept=[1, 2])
    qkv = ColumnParallelLinear(4, 12, blocks=3, seed=0)  # a column layer scores output rows
    qkv.refresh_priority()
    with torch.no_grad():
        qkv.weight[2 + 4] += 1.0  # feature 2 of the second block
    qkv.refresh_priority()
    qkv.resize(0.25)
    assert qkv._kept.tolist() == [2] and qkv._rows().tolist() == [2, 6, 10]
    y = qkv(torch.randn(3, 4))
    assert y.shape == (3, 12) and (y[:, [0, 1, 3, 4, 5, 7, 8, 9, 11]] == 0).all()


SLOW_UNTIL, STEPS = 9, 15


def _batches(steps):
    gen = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 32, (4, 16), generator=gen),
             torch.randint(0, 32, (4, 16), generator=gen)) for _ in range(steps)]


def _balanced_gpt(policies):
    """A float64 GPT (fused, 2 pieces) trained with AdamW under each policy in turn on 2 ranks
    timed by FLOPs, rank 1 emulated 2× slower for the steps before SLOW_UNTIL; the balancer's
    decisions, every step's loss and the final plans. Also the single-process GPT's losses."""
    from plait.testing.virtual import VirtualDevice
    from plait.models import GPT, GPTConfig
    from plait.parallel import apply_tp
    from plait.runtime import SlowSpec, Straggler, rank_context

    device = VirtualDevice().install(unmovable=False)  # in this rank's process only
    torch.manual_seed(0)
    ref = GPT(GPTConfig(vocab_size=32, block_size=16, n_layer=1, n_head=4, n_embd=32)).double()
    batches = _batches(STEPS)
    out = {}
    for policy in policies:
        model = apply_tp(copy.deepcopy(ref), overlap=True, chunks=2)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        balancer = Balancer(model, opt, None, PolicyConfig(name=policy, spike_steps=6,
                                                           migrate_cost_steps=0.5),
                            every=2, window=1, warmup=3)
        losses, slow = [], Straggler([SlowSpec(1, 2.0, until_step=SLOW_UNTIL)], dist.get_rank())
        rank_context().straggler = slow
        for step, (idx, targets) in enumerate(batches):
            slow.set_step(step)
            with device:  # the timed compute
                loss = model(idx, targets)[1]
                opt.zero_grad()
                loss.backward()
            opt.step()
            balancer.step(step)
            losses.append(loss.item())
        decisions = [d.to_json() for d in balancer.log]
        for d in decisions:
            d.get("migration", {}).pop("seconds", None)  # wall time, this rank's own
        out[policy] = {"losses": losses, "decisions": decisions, "final_state": balancer.state()}
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    out["reference"] = []
    for idx, targets in batches:
        loss = ref(idx, targets)[1]
        opt.zero_grad()
        loss.backward()
        opt.step()
        out["reference"].append(loss.item())
    return out


def test_balancer_migrates_a_persistent_straggler_exactly():
    """2 ranks, rank 1 emulated 2× slower until step 9, timed by FLOPs, so when the balancer
    acts is known: the monitor's first exchange ends step 4 (3 warm-up steps, then every 2)
    and reads speeds (1, 0.5); the exchange after step 10 reads (1, 1) (a window of one
    reading), and 5 balanced steps later, at step 14, the plan returns to even. After each
    decision the monitor restarts, and the policies wait a step for its next reading.

    ``migrate`` moves both dims (4 heads, 128 MLP columns) to the proportional plan at step 4
    and back to even at step 14, and every step's loss equals the single-process float64 GPT's
    to 1e-12 (exact migration, optimizer state included). ``semi`` resizes at step 4, migrates
    once the imbalance has lasted spike_steps = 6 steps (step 9; at step 5 it waits for the
    restarted monitor's reading, and the imbalance ages) and repays a migration there and
    back at a cost of 0.5 steps (6 × 0.25 of the heads' compute saved, 6 × 0.33 of the
    columns', each at least 2 × 0.5), and returns to even at 14."""
    from plait.balance import static_plan

    results = run_ranks(_balanced_gpt, 2, ("migrate", "semi"))
    assert results[0] == results[1]  # every rank took the same decisions, saw the same losses
    out = results[0]
    dims = {"blocks.0.attn": 4, "blocks.0.mlp": 128}
    even = {dim: list(ShardPlan.even(n, 2).sizes) for dim, n in dims.items()}
    proportional = {dim: list(static_plan(n, (1.0, 0.5)).sizes) for dim, n in dims.items()}
    assert all(p[1] < p[0] for p in proportional.values()), proportional

    def steps_of(decisions):
        return [(d["step"], d["dim"], d["kind"], d["sizes"]) for d in decisions]

    want = [(step, dim, "migrate", sizes[dim]) for step, sizes in ((4, proportional), (14, even))
            for dim in dims]
    assert steps_of(out["migrate"]["decisions"]) == want, out["migrate"]["decisions"]
    assert all(d["migration"]["bytes_moved"] > 0 for d in out["migrate"]["decisions"])
    errors = [abs(a - b) for a, b in zip(out["migrate"]["losses"], out["reference"])]
    assert len(errors) == STEPS and max(errors) < 1e-12, errors
    semi = steps_of(out["semi"]["decisions"])
    assert [(s, d, k) for s, d, k, _ in semi] == [
        (4, dim, "resize") for dim in dims] + [(9, dim, "migrate") for dim in dims] + [
        (14, dim, "migrate") for dim in dims], out["semi"]["decisions"]
    assert [sizes for *_, sizes in semi[2:4]] == [proportional[dim] for dim in dims]
    for policy in ("migrate", "semi"):
        for dim, state in out[policy]["final_state"].items():
            assert state == {"sizes": even[dim], "keep": 1.0}, (policy, dim, state)


def test_balancer_and_hetero_config_refuse_what_cannot_work():
    with pytest.raises(TypeError, match="no sharded dims"):
        Balancer(nn.Linear(2, 2), None)
    with pytest.raises(ValueError, match="warmup"):
        Balancer(nn.Linear(2, 2), None, warmup=-1)
    with pytest.raises(ValueError, match="--scenarios"):
        HeteroBenchConfig(scenarios=("slow",))
    with pytest.raises(ValueError, match="--policies"):
        HeteroBenchConfig(policies=("fast",))
    with pytest.raises(ValueError, match="does not end within"):
        HeteroBenchConfig(steps=20, spike_at=15, spike_len=10)
    with pytest.raises(ValueError, match="no head"):
        HeteroBenchConfig(n_head=2, n_embd=64).check_world(4)


def test_ideal_is_work_over_summed_speeds_plus_the_rest():
    cfg = HeteroBenchConfig(steps=10, warmup=0, spike_at=2, spike_len=4)
    assert [s.factor for s in scenario_specs("graded", 4, cfg)] == [4.0, 2.0]
    spike = scenario_specs("spike", 4, cfg)[0]
    assert (spike.rank, spike.from_step, spike.until_step) == (3, 2, 6)
    none = {"seed": 0, "scenario": "none", "policy": "even", "t_step_s": 1.0,
            "compute_s_per_step": 0.6, "losses": [1.0], "factors": [[1.0] * 4] * 10}
    slow = {"seed": 0, "scenario": "straggler-2x", "policy": "even", "t_step_s": 1.6,
            "compute_s_per_step": 0.9, "losses": [1.0], "factors": [[1, 1, 1, 2.0]] * 10}
    with_ideal([none, slow], 0)
    assert slow["t_ideal_s"] == pytest.approx(0.4 + 0.6 * 4 / 3.5)
    assert slow["ratio_to_ideal"] == pytest.approx(1.6 / slow["t_ideal_s"])
    assert none["ratio_to_ideal"] == pytest.approx(1.0)


def test_balancer_resizes_a_dims_layers_together_and_rotates_them_at_refresh():
    """A world of one: the balancer's resize picks the same features in fc and proj, and at
    each priority refresh a resized dim chooses anew, so skipped features (whose weights did
    not move) return in place of kept ones that settled."""
    run_ranks(_balancer_resizes_and_rotates, 1)


def _balancer_resizes_and_rotates():
    from plait.balance.policy import Action

    model = nn.Sequential(ColumnParallelLinear(8, 16, seed=0), RowParallelLinear(16, 8, seed=1))
    record(model, dims={"mlp": ("0", "1")})
    balancer = Balancer(model, None, None, PolicyConfig(name="even"), refresh=2, warmup=0)
    fc, proj = model
    x = torch.randn(4, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(x).square().mean().backward()  # one step: every feature moves, by its own amount
    opt.step()
    balancer._apply(0, "mlp", Action("resize", "test", fractions=(0.5,)))
    first = fc._kept.tolist()
    assert len(first) == 8 and proj._kept.tolist() == first
    balancer.step(0)
    balancer.step(1)  # a refresh: the kept did not move since (score 0), the skipped keep theirs
    assert proj._kept.tolist() == fc._kept.tolist() and fc.keep == proj.keep == 0.5
    assert set(fc._kept.tolist()) == set(range(16)) - set(first)


def test_hetero_rows_give_every_seeds_ratio_and_the_targets():
    """Per (scenario, policy): the median ratio over seeds, each seed's in seed order, their
    range; the summary's per-seed figures for issue 22's targets."""
    from plait.bench.hetero_summary import _targets, mean_over_seeds, ratio_cell

    def rec(seed, scenario, policy, ratio, acc, decisions=0):
        return {"seed": seed, "scenario": scenario, "policy": policy, "t_step_s": ratio,
                "ratio_to_ideal": ratio, "heldout_loss": 2.0, "heldout_acc": acc,
                "decisions": [{}] * decisions}

    records = [rec(s, "none", "even", 1.0, 0.30) for s in (1, 0)]
    records += [rec(1, "straggler-2x", "semi", 1.08, 0.29, 2),
                rec(0, "straggler-2x", "semi", 1.02, 0.30, 2),
                rec(0, "straggler-2x", "migrate", 1.00, 0.30, 1),
                rec(1, "straggler-2x", "migrate", 1.10, 0.30, 1),
                rec(0, "none", "semi", 1.0, 0.30), rec(1, "none", "semi", 1.01, 0.30, 1)]
    rows = {(r["scenario"], r["policy"]): r for r in mean_over_seeds(records)}
    semi = rows["straggler-2x", "semi"]
    assert semi["ratio_per_seed"] == [1.02, 1.08]
    assert semi["ratio_spread"] == pytest.approx(0.06)
    assert ratio_cell(semi) == "1.05 (1.02 1.08)"
    assert ratio_cell({"ratio_to_ideal": 1.0, "ratio_per_seed": [1.0]}) == "1.00"
    out = _targets(rows, rows["none", "even"])
    assert out["straggler-2x_semi_ratio_per_seed"] == [1.02, 1.08]
    assert out["straggler-2x_semi_minus_migrate_per_seed"] == pytest.approx([0.02, -0.02])
    assert out["none_semi_decisions_per_seed"] == [0, 1]
    assert out["acc_loss_pp"]["straggler-2x/semi"] == pytest.approx(0.5)
