"""Where the shards live against the run: the stage and the swap directory's room
for the model's state (with the estimator's formula), each problem with its fix."""

from __future__ import annotations

from lightning_zero.config.describe import count_model_parameters, offload_name
from lightning_zero.config.model_zoo import preset_known
from lightning_zero.config.schema import (
    GPTModelSchema,
    TrainConfig,
)
from lightning_zero.core.common.choices import OffloadDevice
from lightning_zero.core.common.memory import OFFLOAD_STAGES
from lightning_zero.core.settings.offload import nvme_path_problem


def offload_problems(cfg: TrainConfig) -> list[str]:
    """The swap directory of ``"nvme"`` offload, checked here before any rank starts, with the room the estimator
    counts (the offload node's values and its rules with the stage are checked with the settings tree)."""
    o = cfg.offload
    if OffloadDevice.nvme not in (o.optimizer_device, o.param_device) or not o.nvme_path:
        return []
    problem = nvme_path_problem(str(o.nvme_path), nvme_bytes_per_node(cfg), "offload.nvme_path")
    return [problem] if problem else []  # the check the ranks repeat, here before any of them starts


def nvme_bytes_per_node(cfg: TrainConfig) -> float:
    """The estimator's bytes of offloaded state under ``offload.nvme_path`` on one node (its ranks share the
    path); 0 when it cannot be counted yet (a stage the offload cannot run, an unknown model: refused apart).

    Args:
        cfg: a composed config with ``"nvme"`` offload.
    """
    from lightning_zero.estimator import ModelSpec, estimate_config, make_cluster

    name, t = offload_name(cfg), cfg.trainer
    gpt = isinstance(cfg.model, GPTModelSchema)
    if (cfg.zero.stage not in OFFLOAD_STAGES.get(name, ()) or (gpt and not preset_known(cfg.model))
            or t.devices < 1 or t.num_nodes < 1):
        return 0.0
    params = count_model_parameters(cfg)
    if params is None:  # not counted before launch: the ranks check the space they need
        return 0.0
    cluster = make_cluster(t.devices * t.num_nodes, t.num_nodes, t.devices)
    estimate = estimate_config(cfg.zero.stage, name, ModelSpec(float(params)), cluster,
                               cfg.precision.name.value)
    return estimate.nvme_bytes * t.devices
