"""Serving with the split moved between requests (``plait.inference.serve``), on virtual devices:
each rank's clock counts its matrix products' FLOPs (``plait.balance.VirtualDevice``), and the
last rank turns 2 × slower from the second request on (the straggler's step is the request's
index), so the speeds each request measures are known exactly, and so is every decision.

On 2 and 3 ranks, ``split="adaptive"``: the first request measures equal speeds and moves
nothing; the second measures the slow rank at 0.5, predicts the gain of shares by speed and
moves every split dim to them; the third measures the same speeds (the slowdown is in the
rank, not in its share) and, already on those shares, moves nothing; the last decides
nothing (no request follows). Every
request's tokens, greedy and sampled, equal one process's (a move is exact).
``split="even"`` never moves. ``predicted_gain`` follows its formula.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from plait.testing import run_ranks

pytest.importorskip("transformers")


def _setting(name: str):
    """(the virtual device, the single-process model, its parallel copy, 4 prompts): the
    last rank 2 × slow from the second request on, every rank a virtual device."""
    import plait
    from plait.testing.virtual import VirtualDevice
    from plait.inference.generate import build_model
    from plait.runtime import SlowSpec, Straggler, rank_context

    rank, world = dist.get_rank(), dist.get_world_size()
    device = VirtualDevice().install(unmovable=False)
    rank_context().straggler = Straggler([SlowSpec(world - 1, 2.0, from_step=1)], rank)
    cfg = SimpleNamespace(model=name, vocab_size=128, n_embd=96, n_layer=2, n_head=12,
                          n_kv_head=6, max_positions=64, seed=0)
    ref = build_model(cfg)
    model = plait.parallelize(copy.deepcopy(ref), "auto")
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 128, (1, n), generator=gen) for n in (5, 3, 4, 2)]
    return device, ref, model, prompts


def _serve(split: str, sample: bool):
    from plait.inference.decode import decode
    from plait.inference.serve import serve

    device, ref, model, prompts = _setting("hf-llama")
    kw = dict(sample=True, seed=3, temperature=0.9) if sample else {}
    with device:
        served = serve(model, prompts, 6, split=split, tolerance=0.05, timed_steps=3,
                       speed_steps=3, **kw)
    one = [decode(ref, p, 6, **kw).tokens for p in prompts]
    return [(s.speeds, s.gain, s.moved, s.sizes, torch.equal(s.tokens, want))
            for s, want in zip(served, one)]


@pytest.mark.parametrize("world", [2, 3])
def test_adaptive_moves_after_the_request_a_rank_slowed_in_and_the_tokens_do_not_change(world):
    for rank_seen in run_ranks(_serve, world, "adaptive", False):
        (s0, g0, m0, z0, t0), (s1, g1, m1, z1, t1), (s2, g2, m2, z2, t2), \
            (s3, g3, m3, z3, t3) = rank_seen
        assert t0 and t1 and t2 and t3  # every request's tokens are one process's
        assert s0 == pytest.approx([1.0] * world, rel=1e-9) and not m0 and g0 < 0.05
        assert s1 == pytest.approx([1.0] * (world - 1) + [0.5], rel=1e-9), s1
        assert m1 and g1 >= 0.05 and z1 == z0  # request 1 ran on the old split, then moved
        assert all(sizes[-1] < sizes[0] for sizes in z2.values()), z2  # the slow rank has less
        assert s2 == pytest.approx([1.0] * (world - 1) + [0.5], rel=1e-9)
        assert g2 < 0.05 and not m2 and z3 == z2  # on the shares by speed: it stays
        assert s3 is None and g3 is None and not m3  # the last request decides nothing


def test_sampled_tokens_survive_a_move_and_even_never_moves():
    for rank_seen in run_ranks(_serve, 2, "adaptive", True):
        assert all(same for *_, same in rank_seen)
        assert any(moved for _, _, moved, _, _ in rank_seen)
    for rank_seen in run_ranks(_serve, 2, "even", False):
        assert all(same for *_, same in rank_seen)
        assert not any(moved for _, _, moved, _, _ in rank_seen)
        assert all(speeds is None for speeds, *_ in rank_seen)


def test_predicted_gain_is_the_slowest_ranks_time_against_the_summed_speeds():
    from plait.inference.serve import predicted_gain

    assert predicted_gain([4, 4], [1.0, 1.0]) == 0.0
    # now: max(2/1, 2/0.5) = 4; by speed: 4 / 1.5
    assert predicted_gain([2, 2], [1.0, 0.5]) == pytest.approx(1 - (4 / 1.5) / 4)
    assert predicted_gain([3, 1], [1.0, 0.5]) == pytest.approx(1 - (4 / 1.5) / 3)
    # whole units: [3, 1] at (1, 0.5) takes 3 against [2, 2]'s 4
    assert predicted_gain([2, 2], [1.0, 0.5], to=[3, 1]) == pytest.approx(0.25)
    assert predicted_gain([3, 1], [1.0, 0.5], to=[3, 1]) == 0.0
    for sizes, speeds in (([1, 1], [1.0]), ([1, 1], [1.0, 0.0])):
        with pytest.raises(ValueError):
            predicted_gain(sizes, speeds)


def _serve_mixtral():
    from plait.inference.decode import decode
    from plait.inference.serve import serve
    from plait.parallel.experts import ExpertParallelExperts

    device, ref, model, prompts = _setting("hf-mixtral")
    with device:
        served = serve(model, prompts, 6, split="adaptive", tolerance=0.05, timed_steps=3,
                       speed_steps=3)
    one = [decode(ref, p, 6).tokens for p in prompts]
    layers = [m for m in model.modules() if isinstance(m, ExpertParallelExperts)]
    return ([s.placed for s in served], [torch.equal(s.tokens, w) for s, w in zip(served, one)],
            [m.placed for m in layers])


@pytest.mark.parametrize("world", [2, 3])
def test_mixtral_experts_placed_between_requests_keep_the_tokens(world):
    """hf-mixtral under ``--split adaptive``: after a request each expert layer's experts are
    placed by the tokens routed to them and the speeds (hot ones copied); every request's
    tokens stay one process's."""
    for placed, same, layers_placed in run_ranks(_serve_mixtral, world):
        assert all(same), same
        assert any(placed) and any(layers_placed), (placed, layers_placed)
        assert placed[-1] == 0  # the last request decides nothing
