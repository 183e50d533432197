"""The strategy's small typed parts and policies (issue 30's structure leftovers), without a process group.

- ``RecordedCollectives``: a composed part (not a mixin) that records Lightning's own collectives;
- ``StepStatsSource``: the narrow view ``ZeroStatsMonitor`` reads instead of ``strategy.engine``;
- ``GradReduction``: who averages a step's gradients (was the boolean ``grads_local``);
- ``ParamOffload``: stores an ``OffloadDevice``, still accepting its string.
"""

from __future__ import annotations

import importlib
import warnings
from types import SimpleNamespace

import pytest
from lightning.pytorch.strategies import DDPStrategy

from lightning_zero import ZeroStrategy
from lightning_zero.core.common.choices import OffloadDevice
from lightning_zero.core.offload.param_offload import ParamOffload
from lightning_zero.core.reliability.progress_record import ProgressRecord
from lightning_zero.core.zero.engine_step import GradReduction
from lightning_zero.observability.stats_source import StepStatsSource, stats_source
from lightning_zero.reliability.hang_watchdog import RecordedCollectives


def test_recorded_collectives_is_a_part_and_numbers_each_collective() -> None:
    assert RecordedCollectives not in ZeroStrategy.__mro__
    assert isinstance(ZeroStrategy()._collectives, RecordedCollectives)
    record = ProgressRecord(clock=lambda: 0.0)
    part = RecordedCollectives(record)
    for entered, kind in ((part.barrier("save"), "barrier(save)"), (part.barrier(), "barrier"),
                          (part.broadcast(), "broadcast (Lightning)"), (part.reduce(), "reduce (Lightning")):
        with entered:
            assert record.current_wait()[1].startswith(kind)
    assert record.seq == 4


def test_the_monitor_reads_the_strategy_through_a_narrow_view() -> None:
    strategy = ZeroStrategy()
    assert isinstance(strategy, StepStatsSource)
    assert not isinstance(DDPStrategy(), StepStatsSource)
    assert strategy.engine_comm is None and strategy.measure_grad_norm() is None and not strategy.pipelined
    zero, ddp = SimpleNamespace(strategy=strategy), SimpleNamespace(strategy=DDPStrategy())
    assert stats_source(zero) is strategy and stats_source(ddp) is None  # type: ignore[arg-type]


def test_grad_reduction_names_who_averages_the_gradients() -> None:
    assert {m.name for m in GradReduction} == {"BY_ENGINE", "BY_OPTIMIZER"}


@pytest.mark.parametrize("device", ["cpu", "nvme", OffloadDevice.cpu, OffloadDevice.nvme])
def test_param_offload_stores_the_enum_and_accepts_its_string(device: str, tmp_path) -> None:
    offload = ParamOffload(device, [], str(tmp_path))
    assert offload.device is OffloadDevice(device) and offload.nvme == (offload.device is OffloadDevice.nvme)


@pytest.mark.parametrize("device", ["none", OffloadDevice.none, "gpu"])
def test_param_offload_refuses_a_device_that_is_not_offload(device: str) -> None:
    with pytest.raises(ValueError, match="'cpu' or 'nvme'"):
        ParamOffload(device, [], None)


def test_model_summary_moved_and_its_former_path_warns() -> None:
    from lightning_zero.observability.model_summary import ZeroModelSummary

    with pytest.warns(DeprecationWarning, match="observability.model_summary"):
        from lightning_zero.observability.callbacks import ZeroModelSummary as former
    assert former is ZeroModelSummary
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from lightning_zero.observability import ZeroModelSummary as public
    assert public is ZeroModelSummary


@pytest.mark.parametrize("former", ["lightning_zero.deepspeed.strategy", "lightning_zero.deepspeed.strategy_args"])
@pytest.mark.parametrize("name", ["precision_plugin_args", "build_precision_plugin"])
def test_names_the_file_size_split_moved_still_import_and_warn(former: str, name: str) -> None:
    """Issue 30 moved them to ``strategy_args``; issue 47 made them the JSON's precision node
    (``DeepSpeedConfig.precision_settings``): both former places still serve them (lightning_zero/compat)."""
    from lightning_zero.deepspeed.config import parse_deepspeed_config

    with pytest.warns(DeprecationWarning, match="precision_settings"):
        found = getattr(importlib.import_module(former), name)
    made = found(parse_deepspeed_config({"bf16": {"enabled": True}}))
    assert made == ("bf16-mixed", {}) if name == "precision_plugin_args" else made.precision == "bf16-mixed"
    with pytest.raises(AttributeError):
        importlib.import_module(former).no_such_name  # noqa: B018
