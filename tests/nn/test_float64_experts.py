"""A float64 Mixtral whose experts run torch's grouped GEMM (transformers' default), which
takes no float64 on a CPU: ``plait.parallelize`` checks it against its own forward with the
experts run the eager way (set back after), and the parallel model decodes what one process
does, on 2 and 3 ranks. Before, the check was skipped ("does not run on example token
ids") and the model's own experts raised in torch's grouped GEMM."""

from __future__ import annotations

import pytest
import torch

from plait.testing import run_ranks

pytest.importorskip("transformers")
IDS = torch.tensor([[1, 2, 3, 4, 5]])


def _reference():
    from plait.testing.tiny_hf import tiny_model

    return tiny_model("mixtral")(IDS).logits  # float64, eager experts


def _parallel():
    import plait
    from plait.testing.tiny_hf import tiny_model

    model = tiny_model("mixtral")
    model.set_experts_implementation("grouped_mm")
    with pytest.raises(RuntimeError, match="Float32, BFloat16 or Float16"):
        model(IDS)  # torch's own refusal: what the check must not trip on
    plait.parallelize(model, "auto")
    return model(IDS).logits, str(plait.parallel.applied(model)), \
        model.config._experts_implementation


@pytest.mark.parametrize("world", [2, 3])
def test_float64_grouped_experts_are_checked_and_exact(world):
    want = _reference()
    logits, told, impl = run_ranks(_parallel, world, timeout_s=120)[0]
    assert "not checked" not in told, told
    assert impl == "grouped_mm"  # the model's own setting, set back after the check
    assert float((logits - want).abs().max()) < 1e-10
