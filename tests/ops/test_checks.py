"""The operators' typed cross-rank checks (``plait.ops.agree.Check``), without processes:
a check crosses ranks as a row of integers and reads back as the same check; the fields
that must agree raise, named as the operator names them, and the others may differ."""

from __future__ import annotations

import pytest
import torch

from plait.ops.embedding import EmbeddingCheck
from plait.ops.matmul_all_reduce import DgradCheck, MatmulCheck
from plait.ops.moe import RoutesCheck
from plait.ops.regions import RegionCheck
from plait.ops.sequence_parallel import GatherCheck, ScatterCheck
from plait.transport.calls import dtype_code

F32, F64 = dtype_code(torch.float32), dtype_code(torch.float64)


def test_rows_round_trip_with_per_rank_fields():
    world = 3
    checks = [RoutesCheck(F32, 8, 16, 0, 1, 1, e, (1, 2, 3), (3, 2, 1), (7, 8, 9), (9, 8, 7))
              for e in (2, 1, 1)]
    rows = [c.row() for c in checks]
    assert len(rows[0]) == RoutesCheck.width(world) == 7 + 4 * world
    assert RoutesCheck.from_rows(rows) == checks
    RoutesCheck.agree("moe", rows)  # the expert counts may differ
    region = RegionCheck(F32, 4, 0, 5, (2, 2, 1))
    assert RegionCheck.from_rows([region.row()] * world) == [region] * world
    assert MatmulCheck.width(0) == 6 and DgradCheck.width(0) == 7


def test_a_field_that_must_agree_is_named_as_the_operator_names_it():
    rows = [MatmulCheck(F32, 4, 8, 0, 3, 1).row(), MatmulCheck(F64, 4, 8, 0, 5, 0).row()]
    with pytest.raises(ValueError, match=r"op: ranks disagree on dtype: rank 0 has "
                                         r"torch.float32, rank 1 has torch.float64"):
        MatmulCheck.agree("op", rows)
    same = [MatmulCheck(F32, 4, 8, 0, 3, 1).row(), MatmulCheck(F32, 4, 8, 0, 5, 0).row()]
    MatmulCheck.agree("op", same)  # K_r and the layout may differ
    with pytest.raises(ValueError, match="disagree on w column-major"):
        MatmulCheck.agree("op", same, (*MatmulCheck.AGREED, "w_column_major"))
    dgrad = [DgradCheck(F32, 4, 8, 0, 3, 1, 1).row(), DgradCheck(F32, 4, 9, 0, 3, 1, 0).row()]
    with pytest.raises(ValueError, match=r"disagree on \(K, x needs grad\): rank 0 has "
                                         r"\(8, True\), rank 1 has \(9, False\)"):
        DgradCheck.agree("dgrad", dgrad)


def test_per_rank_fields_and_labels_in_the_error():
    a = ScatterCheck(F32, 6, 4, 0, 1, 3, (3, 3)).row()
    b = ScatterCheck(F32, 6, 4, 0, 1, 2, (2, 4)).row()
    with pytest.raises(ValueError, match=r"disagree on sizes: rank 0 has \[3, 3\], rank 1 has "
                                         r"\[2, 4\]"):
        ScatterCheck.agree("rs", [a, b])
    g = [GatherCheck(2, 5, F32, 4, 0, 1, 1, (-1, -1)).row(),
         GatherCheck(3, 5, F32, 4, 0, 1, 2, (-1, -1)).row()]
    with pytest.raises(ValueError, match="disagree on rows per index of dim"):
        GatherCheck.agree("ag", g)
    r = [RegionCheck(F32, 10, 0, 0, (-1, -1)).row(), RegionCheck(F32, 12, 0, 0, (-1, -1)).row()]
    with pytest.raises(ValueError, match="disagree on elements"):
        RegionCheck.agree("ar", r, labels={"others": "elements"})
    e = EmbeddingCheck(F32, 8, 4, 0, 0, 1, (2, 2), 3, 40)
    assert EmbeddingCheck.from_rows([e.row(), e.row()]) == [e, e]


def test_a_row_cut_short_after_the_agreed_fields_is_still_judged():
    long = MatmulCheck(F32, 4, 8, 0, 3, 1).row()
    short = MatmulCheck(F32, 4, 9, 0, 3, 1).row()[:4]  # a header of another width
    with pytest.raises(ValueError, match="disagree on N"):
        MatmulCheck.agree("op", [long, short])
