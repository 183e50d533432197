"""``max_reuse_distance`` (DeepSpeed's ``stage3_max_reuse_distance``), the kept tail's third bound (Note [kept tail] in
core/stage3/runtime.py): read from the JSON, a ``ZeroConfig`` / ``ZeroStrategy`` keyword, refused unless a
non-negative int. What it keeps is tested in tests/distributed/test_kept_tail.py; the Hydra key with the other
stage-3 keys in test_deepspeed_config.py."""

from __future__ import annotations

import warnings
from typing import Any

import pytest

from lightning_zero import DeepSpeedZeroStrategy, ZeroConfig, ZeroStrategy
from lightning_zero.deepspeed import parse_deepspeed_config


def test_stage3_max_reuse_distance_maps_onto_the_kept_tails_bound() -> None:
    with warnings.catch_warnings():  # no longer among the ignored keys
        warnings.simplefilter("error")
        ds = parse_deepspeed_config({"zero_optimization": {"stage": 3, "stage3_max_reuse_distance": 1e6}})
    assert ds.zero.max_reuse_distance == 1_000_000 and ds.unsupported == ()
    assert ds.given["zero.max_reuse_distance"] == "zero_optimization.stage3_max_reuse_distance"
    assert parse_deepspeed_config({"zero_optimization": {"stage3_max_reuse_distance": 0}}).zero.max_reuse_distance == 0
    assert (
        DeepSpeedZeroStrategy.from_deepspeed_config(
            {"zero_optimization": {"stage": 3, "stage3_max_reuse_distance": 4096}}
        ).zero_config.max_reuse_distance
        == 4096
    )
    with pytest.raises(ValueError, match=r"zero_optimization: `max_reuse_distance` must be a non-negative int"):
        parse_deepspeed_config({"zero_optimization": {"stage3_max_reuse_distance": -1}})
    with pytest.raises(ValueError, match=r"`zero_optimization\.stage3_max_reuse_distance` must be int"):
        parse_deepspeed_config({"zero_optimization": {"stage3_max_reuse_distance": 1.5}})


@pytest.mark.parametrize("value", [-1, 1.5, True, "1000"])
def test_max_reuse_distance_must_be_a_non_negative_int(value: Any) -> None:
    with pytest.raises(ValueError, match=r"`max_reuse_distance` must be a non-negative int .*0 keeps no unit"):
        ZeroConfig(stage=3, max_reuse_distance=value)
    with pytest.raises(ValueError, match="`max_reuse_distance` must be a non-negative int"):
        ZeroStrategy(stage=3, max_reuse_distance=value)
    assert ZeroStrategy(stage=3, max_reuse_distance=0).zero_config.max_reuse_distance == 0


def test_a_whole_float_max_reuse_distance_is_taken_as_its_int() -> None:
    """DeepSpeed configs write ``1e9``; ``prefetch_bucket_size`` and the other sizes take it too."""
    config = ZeroConfig(stage=3, max_reuse_distance=1e9)
    assert config.max_reuse_distance == 1_000_000_000 and type(config.max_reuse_distance) is int
