"""DeepSpeed's own model-state estimates, re-implemented (no ``deepspeed`` import) to show beside ours."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_zero.estimator.cluster import Cluster


@dataclass(frozen=True)
class DeepSpeedFigures:
    """DeepSpeed's own estimate for one configuration (mixed-precision Adam assumed).

    ``cpu_per_node`` is per node, as DeepSpeed reports it (it prints GiB labelled "GB").
    """

    device: float
    cpu_per_node: float
    function: str


def deepspeed_figures(
    stage: int, offload: str, num_params: float, largest_layer_params: float, cluster: Cluster,
    additional_buffer_factor: float = 1.5,
) -> DeepSpeedFigures | None:
    """Re-implementation of DeepSpeed's estimators (no ``deepspeed`` import), ``None`` where it has none.

    Transcribed from ``deepspeed/runtime/zero/stage_1_and_2.py`` and ``stage3.py`` (DeepSpeed's
    current master branch), with total GPUs ``N``, ranks per node ``g``, nodes ``n``, largest layer
    ``L`` and buffer factor ``f = 1.5`` (note ZeRO-2 with offload is ``2Ψ`` on the GPU there, the
    16-bit parameters only):

    * ``estimate_zero2_model_states_mem_needs``: no offload, gpu ``2Ψ + 18Ψ/N`` (16-bit params;
      16-bit grads + fp32 grads + fp32 master + moments partitioned; older DeepSpeed releases used
      ``4Ψ + 16Ψ/N``), cpu ``4Ψ·g·f`` (loading the model); ``cpu_offload=True``: gpu ``2Ψ``,
      cpu ``Ψ·max(4N, 16)·f``.
    * ``estimate_zero3_model_states_mem_needs`` with ``zero_init=True``: gpu ``4L + 18Ψ/N``,
      cpu ``4L·g·f``; optimizer offload: gpu ``4L + 2Ψ/N``, cpu ``16Ψ/n·f``; optimizer and param
      offload: gpu ``4L``, cpu ``18Ψ/n·f``.

    Stages 0-1, stage 1 offload and NVMe offload have no DeepSpeed estimator.

    Args:
        stage: ZeRO stage.
        offload: offload option (see :data:`OFFLOADS`).
        num_params: Ψ.
        largest_layer_params: L (0 when unknown).
        cluster: ranks and nodes.
        additional_buffer_factor: DeepSpeed's ``additional_buffer_factor``.
    """
    psi, big, f = float(num_params), float(largest_layer_params), additional_buffer_factor
    n, g, nodes = cluster.world_size, cluster.gpus_per_node, cluster.num_nodes
    fig: dict[tuple[int, str], tuple[float, float, str]] = {
        (2, "none"): (2 * psi + int(18 * psi / n), 4 * psi * g * f, "zero2(cpu_offload=False)"),
        (2, "optimizer_cpu"): (2 * psi, psi * max(4 * n, 16) * f, "zero2(cpu_offload=True)"),
        (3, "none"): (4 * big + int(18 * psi / n), 4 * big * g * f, "zero3(cpu_offload=False)"),
        (3, "optimizer_cpu"): (4 * big + int(2 * psi / n), 16 * psi / nodes * f,
                               "zero3(cpu_offload=True, cpu_offload_params=False)"),
        (3, "param_cpu"): (4 * big, 18 * psi / nodes * f, "zero3(cpu_offload=True, cpu_offload_params=True)"),
    }
    hit = fig.get((stage, offload))
    return None if hit is None else DeepSpeedFigures(float(int(hit[0])), float(int(hit[1])), hit[2])
