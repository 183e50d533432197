"""The data-parallel layout of an estimate: ranks, and how they sit on nodes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Cluster:
    """Data-parallel ranks and how they sit on nodes (CPU memory and NVMe are per node)."""

    world_size: int
    gpus_per_node: int

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.gpus_per_node


def make_cluster(world_size: int | None, num_nodes: int | None, gpus_per_node: int | None) -> Cluster:
    """Fill in the one of world size, nodes and ranks per node that is missing.

    With only ``world_size``: 8 ranks per node when it is a multiple of 8, else one node.

    Args:
        world_size: N, data-parallel ranks.
        num_nodes: machines.
        gpus_per_node: ranks per machine.
    """
    for label, v in (("world size", world_size), ("number of nodes", num_nodes), ("GPUs per node", gpus_per_node)):
        if v is not None and (int(v) != v or v < 1):
            flag = "--" + label.replace(" ", "-").replace("number-of-", "num-").lower()
            raise ValueError(f"The {label} must be a positive integer (e.g. {flag} 8), got {v!r}.")
    if world_size is None:
        if num_nodes is None or gpus_per_node is None:
            raise ValueError("Give the world size (--world-size N) or both --num-nodes and --gpus-per-node.")
        world_size = num_nodes * gpus_per_node
    if gpus_per_node is None:
        if num_nodes is not None:
            gpus_per_node = world_size // num_nodes
        else:
            gpus_per_node = 8 if world_size % 8 == 0 else world_size
    if world_size % gpus_per_node or (num_nodes is not None and num_nodes * gpus_per_node != world_size):
        raise ValueError(
            f"World size {world_size} is not {num_nodes or '?'} nodes x {gpus_per_node} GPUs per node; "
            "give consistent --world-size / --num-nodes / --gpus-per-node (world size = nodes x GPUs/node)."
        )
    return Cluster(int(world_size), int(gpus_per_node))
