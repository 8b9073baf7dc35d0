"""``plait bench decode``: every system's tokens equal one process's on 3 ranks with uneven
heads (8 query heads over 4 KV heads: 2, 1, 1 KV-head groups), its records carry what the
README's table reads, and a rank slowed by the kernel is given less (``--slow-by kernel``'s
budgets). Timings are printed, never asserted: the bench measures, the test decides on the
tokens and the records' shape."""

from __future__ import annotations

import json

import pytest

from plait.bench.decode import DecodeBenchConfig, kernel_budgets
from plait.cli.main import main
from plait.runtime.slow.straggler import SlowSpec

pytest.importorskip("transformers")

TINY = ["--n-layer", "1", "--n-embd", "64", "--n-head", "8", "--n-kv-head", "4",
        "--vocab-size", "128", "--prompt-len", "4", "--new-tokens", "4", "--rounds", "1",
        "--batch-sizes", "1,3", "--no-progress"]


def test_three_ranks_uneven_heads_decode_the_same_tokens_as_one_process(tmp_path):
    out = tmp_path / "decode.json"
    assert main(["bench", "decode", "--ranks", "3", *TINY, "--split", "speed",
                 "--speed-steps", "2", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    timed = [r for r in data["records"] if "batch" in r]
    assert {r["system"] for r in timed} == {"plait", "plait-plain", "one-process",
                                           "plait-speed"}
    assert {r["batch"] for r in timed} == {1, 3}
    for r in timed:
        assert r["same_tokens"] is True, r
        for key in ("ms_per_token", "p99_ms", "ttft_ms", "tokens_per_s"):
            assert r[key] > 0, (key, r)
    skipped = [r for r in data["records"] if "skipped" in r]
    assert [r["system"] for r in skipped] == ["pytorch-tp"]  # 4 KV heads over 3: DTensor can't
    even = next(r for r in timed if r["system"] == "plait")["split"]["sizes"]
    assert {d.rsplit(".", 1)[-1]: v for d, v in even.items()}["self_attn"] == [2, 1, 1], even
    speed = next(r for r in timed if r["system"] == "plait-speed")
    assert sum(speed["split"]["sizes"][next(iter(speed["split"]["sizes"]))]) > 0
    assert data["meta"]["summary"]["all_same_tokens"] is True


def test_checks_as_gathers_decode_the_same_tokens_and_the_saving_is_reported(tmp_path,
                                                                            monkeypatch):
    # the environment the ranks inherit (what --transport shm sets), restored afterwards:
    # the suite's other tests run on gloo (tests/conftest.py)
    monkeypatch.setenv("PLAIT_TRANSPORT", "shm")
    out = tmp_path / "checks.json"
    assert main(["bench", "decode", "--ranks", "2", *TINY, "--systems",
                 "plait,plait-gather-checks,one-process", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    timed = [r for r in data["records"] if "batch" in r]
    assert {r["system"] for r in timed} == {"plait", "plait-gather-checks", "one-process"}
    assert all(r["same_tokens"] is True for r in timed)
    summary = data["meta"]["summary"]
    assert {"plait_b1_check_saving_ms", "plait_b3_check_saving_ms"} <= set(summary), summary


def test_kernel_budgets_divide_the_slowed_hosts_budget():
    assert kernel_budgets(3, 3, [SlowSpec(2, 2.0)]) == [1.0, 1.0, 0.5]
    assert kernel_budgets(2, 2, []) == [1.0, 1.0]


def test_kernel_budgets_take_host_cpu_as_the_full_budget(monkeypatch):
    from plait.runtime.placement import HOST_CPU_ENV

    monkeypatch.setenv(HOST_CPU_ENV, "0.5")
    assert kernel_budgets(3, 3, [SlowSpec(0, 4.0)]) == [0.125, 0.5, 0.5]


@pytest.mark.parametrize("ranks, hosts, slow, says", [
    (2, 0, [SlowSpec(1, 2.0)], "needs one rank per host"),
    (4, 2, [SlowSpec(1, 2.0)], "needs one rank per host"),
    (2, 2, [SlowSpec(1, 2.0, from_step=3)], "lasts the whole run"),
    (2, 2, [SlowSpec(1, 500.0)], "under 0.01"),
])
def test_kernel_budgets_refuse_what_they_cannot_make(ranks, hosts, slow, says):
    with pytest.raises(ValueError, match=says):
        kernel_budgets(ranks, hosts, slow)


@pytest.mark.parametrize("flags, says", [
    (["--slow-by", "cpu"], "--slow-by must be sleep or kernel"),
    (["--slow-by", "kernel", "--slow", "1:2"], "needs one rank per host"),
    (["--split", "fast"], "--split must be even or speed"),
    (["--systems", "vllm"], "--systems vllm: choose from"),
    (["--slow", "1:2@3"], "for the whole run"),
    (["--slow", "1:2", "--slow", "1:3"], "names rank 1 more than once"),
    (["--batch-sizes", "1,x"], "--batch-sizes: 'x' is not a whole number"),
])
def test_bad_input_is_refused_in_one_line(flags, says, capsys):
    # with the progress bar on: a refusal comes before it is drawn, and before any rank
    shown = [a for a in TINY if a != "--no-progress"]
    assert main(["bench", "decode", "--ranks", "2", *shown, *flags]) == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and says in err, err
    assert "bench decode" not in out, out


def test_the_config_refuses_a_head_count_that_does_not_divide():
    with pytest.raises(ValueError, match="multiple of --n-kv-head"):
        DecodeBenchConfig(n_head=6, n_kv_head=4)
