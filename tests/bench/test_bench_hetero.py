"""``plait bench hetero``'s summary: semi's gaps to migrate and resize alone and to even on
``none`` (the noise floor), paired by step."""

import pytest

from plait.bench.hetero_summary import paired_gaps


def _record(seed, scenario, policy, times, ideal=0.1):
    return {"seed": seed, "scenario": scenario, "policy": policy, "step_times_s": times,
            "t_ideal_s": ideal}


def test_gaps_are_paired_by_step_and_leave_the_warm_up_out():
    # a load that drifts over the run lands on both runs' step i alike; semi is 3 ms (0.03 of
    # the 100 ms ideal) slower at every step; the first two steps (warm-up) are far off
    drift = [0.1 + 0.02 * (i % 7) for i in range(20)]
    semi = [9.0, 9.0] + [t + 0.003 for t in drift[2:]]
    resize = [0.0, 0.0] + drift[2:]
    shifted = resize[:2] + resize[3:] + resize[2:3]  # the same steps, out of step with semi
    records = [_record(0, "spike", "semi", semi), _record(0, "spike", "resize", resize),
               _record(1, "spike", "semi", semi), _record(1, "spike", "resize", shifted)]
    gaps = paired_gaps(records, warmup=2)["spike_semi_minus_resize_paired_per_seed"]
    assert gaps[0] == pytest.approx(0.03)
    assert abs(gaps[1] - 0.03) > 0.05  # unpaired steps: the drift, not the gap
    assert "straggler-2x_semi_minus_migrate_paired_per_seed" not in paired_gaps(records, 2)


def test_the_noise_floor_is_semi_beside_even_with_no_straggler():
    """On ``none`` semi makes no decision and computes what even does: their gap, paired by
    step, is what two runs of the same work differ by, reported beside every other gap."""
    times = [0.1 + 0.01 * (i % 3) for i in range(12)]
    records = [_record(0, "none", "even", times), _record(0, "none", "semi",
                                                           [t + 0.002 for t in times])]
    assert paired_gaps(records, warmup=2)["none_semi_minus_even_paired_per_seed"] == \
        pytest.approx([0.02])
