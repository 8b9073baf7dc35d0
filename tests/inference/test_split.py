"""Shares sized by measured speed before decoding (``plait.inference.split``), on virtual devices:
each rank's clock counts its matrix products' FLOPs (``plait.balance.VirtualDevice``), the
last rank is emulated 2 × slower, so the speeds are known exactly and so is the split.

On 2 and 3 ranks: the measured speeds are (1, …, 0.5) to 1e-9; every split dim moves to
``static_plan(units, speeds)``; the tokens decoded after the move equal the tokens before it
and one process's (the move is exact); the capacity ideal of a step follows its formula.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from plait.testing import run_ranks
from plait.nn.record import applied

pytest.importorskip("transformers")


def _split(world_slow: float):
    import plait
    from plait.balance import static_plan
    from plait.testing.virtual import VirtualDevice
    from plait.runtime import SlowSpec, Straggler, rank_context
    from plait.inference.decode import decode
    from plait.inference.generate import build_model
    from plait.inference.split import measure_speeds, split_by_speed

    rank, world = dist.get_rank(), dist.get_world_size()
    device = VirtualDevice().install(unmovable=False)
    rank_context().straggler = Straggler([SlowSpec(world - 1, world_slow)], rank)
    cfg = SimpleNamespace(model="hf-llama", vocab_size=128, n_embd=96, n_layer=2, n_head=12,
                          n_kv_head=6, max_positions=64, seed=0)
    ref = build_model(cfg)
    model = plait.parallelize(copy.deepcopy(ref), "auto")
    prompt = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(1))
    with device:
        before = decode(model, prompt, 6).tokens
        speeds, compute, work = measure_speeds(model, prompt, 4)
        moved = split_by_speed(model, speeds)
        after = decode(model, prompt, 6).tokens
    want = {dim: static_plan(model.get_submodule(names[0]).plan.total, speeds).sizes
            for dim, names in applied(model).dims.items()}
    return (speeds, moved, want, torch.equal(before, after),
            torch.equal(after, decode(ref, prompt, 6).tokens), compute, work)


@pytest.mark.parametrize("world", [2, 3])
def test_a_2x_rank_gets_its_speeds_share_and_the_tokens_do_not_change(world):
    results = run_ranks(_split, world, 2.0)
    for speeds, moved, want, same_as_before, same_as_one, compute, work in results:
        assert speeds == pytest.approx([1.0] * (world - 1) + [0.5], rel=1e-9), speeds
        assert moved == want and all(s[-1] < s[0] for s in moved.values()), moved
        assert same_as_before and same_as_one
    speeds, moved, want, _, _, compute, work = results[0]
    # the slow rank's compute per token is its work at half the fast ranks' speed
    fast = work[0] / compute[0]
    assert compute[-1] == pytest.approx(work[-1] / (0.5 * fast), rel=1e-9)


def test_the_decode_ideal_is_the_rest_plus_the_work_at_the_summed_speeds():
    from plait.inference.split import decode_ideal

    # 10 ms steps whose split layers took 4 ms and 8 ms (a 2 x rank) for 100 units each:
    # 2 ms elsewhere, then 200 units at 25 + 12.5 units a ms
    assert decode_ideal(10e-3, [4e-3, 8e-3], [100, 100]) == pytest.approx(2e-3 + 200 / 37.5e3)
