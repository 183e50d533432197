"""The small shared helpers of the core: interval overlap (flat_param.overlap) and the all-ranks agreement
(DataParallelComm.extremes; its 2-rank path is exercised by the stage-3 divergent-units test)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from lightning_zero.core.comm import DataParallelComm
from lightning_zero.core.flat_param import overlap

bounds = st.tuples(st.integers(0, 50), st.integers(0, 50)).map(sorted)


@given(bounds, bounds)
def test_overlap_is_the_intersection_of_two_ranges(a: list[int], b: list[int]) -> None:
    lo, hi = overlap(a[0], a[1], b[0], b[1])
    common = set(range(*a)) & set(range(*b))
    assert set(range(lo, hi)) == common
    if common:
        assert (lo, hi) == (min(common), max(common) + 1)
    else:
        assert hi <= lo


def test_extremes_without_a_group_is_the_value_itself() -> None:
    comm = DataParallelComm()
    assert not comm.active and comm.extremes(7) == (7, 7) and comm.extremes(-3) == (-3, -3)
