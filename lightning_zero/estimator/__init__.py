"""Memory estimator: per-rank device, CPU and NVMe bytes of ZeRO stages 0-3, with and without offload.

One file per job: :mod:`.options` (precisions, offloads), :mod:`.model_spec` (what is known about the
model), :mod:`.cluster`, :mod:`.activations`, :mod:`.deepspeed_figures` (DeepSpeed's formulas),
:mod:`.estimate` (the result types and :func:`estimate_memory`), :mod:`.sizes` (size text) and
:mod:`.report` (the text pieces the printed tables share). The stage advisor is :mod:`lightning_zero.estimator.advisor`.
"""

from lightning_zero.estimator.activations import Activations, activation_memory
from lightning_zero.estimator.cluster import Cluster, make_cluster
from lightning_zero.estimator.deepspeed_figures import DeepSpeedFigures, deepspeed_figures
from lightning_zero.estimator.estimate import (
    ConfigEstimate,
    EstimateOptions,
    MemoryEstimate,
    estimate_config,
    estimate_memory,
    render_estimate,
)
from lightning_zero.estimator.model_spec import PRESETS, ModelSpec, resolve_model, spec_of_module
from lightning_zero.estimator.options import OFFLOADS, PRECISIONS, formula_precision
from lightning_zero.estimator.sizes import format_bytes, format_count, parse_count, parse_size

__all__ = [
    "OFFLOADS",
    "PRECISIONS",
    "PRESETS",
    "Activations",
    "Cluster",
    "ConfigEstimate",
    "DeepSpeedFigures",
    "EstimateOptions",
    "MemoryEstimate",
    "ModelSpec",
    "activation_memory",
    "deepspeed_figures",
    "estimate_config",
    "estimate_memory",
    "format_bytes",
    "format_count",
    "formula_precision",
    "make_cluster",
    "parse_count",
    "parse_size",
    "render_estimate",
    "resolve_model",
    "spec_of_module",
]
