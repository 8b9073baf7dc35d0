"""``plait demo`` end to end on a tiny GPT (loopback), and its refusals."""

import json

import pytest

from plait.cli.main import main
from plait.demo import DemoConfig


def test_demo_writes_table_and_report(tmp_path, capsys):
    out = tmp_path / "demo"
    code = main(["demo", "--loopback", "--no-progress", "--steps", "10", "--slow-from", "3",
                 "--n-embd", "64", "--n-head", "4", "--n-layer", "1", "--seq-len", "16",
                 "--batch-size", "4", "--out", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    assert "plain" in text and "plait" in text and "× ideal" in text
    for name in ("index.html", "step_time.png", "loss.png", "decisions.log", "demo.json"):
        assert (out / name).stat().st_size > 0, name
    data = json.loads((out / "demo.json").read_text())
    assert {r["system"] for r in data["summary"]} == {"plain", "plait"}
    assert len(data["runs"]) == 4 and all(len(r["times"]) == 10 for r in data["runs"])
    assert "<table>" in (out / "index.html").read_text()


def test_demo_refuses_what_cannot_work(capsys):
    with pytest.raises(ValueError, match="slow-from"):
        DemoConfig(steps=10, slow_from=9)
    with pytest.raises(ValueError, match="factor"):
        DemoConfig(factor=1.0)
    assert main(["demo", "--loopback", "--ranks", "1"]) == 2
    assert "at least 2 ranks" in capsys.readouterr().err
    assert main(["bench", "hetero", "--scenarios", "slow"]) == 2
