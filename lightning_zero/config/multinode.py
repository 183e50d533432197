"""Several nodes with the existing engine: torchrun's rendezvous arguments for this node, from the config
(``trainer.num_nodes``, ``trainer.node_rank``, ``trainer.rdzv_endpoint``) or the launcher's environment
(torchrun / SLURM), a DeepSpeed-style ``hostfile`` translated into the command to run on each host, and the
check that this node has the GPUs a run asks for.

Note [multi-node]
    torchrun's static rendezvous replaces DeepSpeed's ssh / pdsh launcher: every node runs the same
    ``lightning-zero train ... trainer.num_nodes=N trainer.node_rank=i trainer.rdzv_endpoint=HOST:PORT``
    (or ``srun`` runs it once per node), each starts ``torchrun --nnodes=N --node_rank=i
    --nproc_per_node=devices --master_addr=HOST --master_port=PORT``, and node 0 hosts the store at
    HOST:PORT. Global rank = node_rank * devices + local rank. Nothing needs ssh between the nodes; a
    ``hostfile`` (``host slots=N`` per line) is only turned into those per-node commands, printed, or
    run over ssh when asked (``lightning-zero hostfile --ssh``).
"""

from __future__ import annotations

import os
import shlex
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

DEFAULT_PORT = 29500


@dataclass(frozen=True)
class NodeLaunch:
    """This node's place in the job: torchrun's ``--nnodes`` / ``--node_rank`` / master address and port."""

    num_nodes: int
    node_rank: int
    master_addr: str
    master_port: int

    def torchrun_args(self) -> list[str]:
        return [f"--nnodes={self.num_nodes}", f"--node_rank={self.node_rank}",
                f"--master_addr={self.master_addr}", f"--master_port={self.master_port}"]


def resolve_node(num_nodes: int, node_rank: int | None, endpoint: str | None,
                 env: Mapping[str, str] | None = None) -> NodeLaunch | None:
    """This node's launch (``None`` for one node). ``node_rank`` / ``endpoint`` left unset are read from
    the environment: ``NODE_RANK``, ``GROUP_RANK`` or ``SLURM_NODEID``; ``MASTER_ADDR`` / ``MASTER_PORT``.

    Raises:
        ValueError: a multi-node run without a node rank or a rendezvous endpoint, or values out of range.
    """
    env = os.environ if env is None else env
    if num_nodes < 1:
        raise ValueError(f"trainer.num_nodes must be >= 1, got {num_nodes}.")
    if num_nodes == 1:
        return None
    if node_rank is None:
        found = next((env[k] for k in ("NODE_RANK", "GROUP_RANK", "SLURM_NODEID") if env.get(k)), None)
        if found is None:
            raise ValueError(f"trainer.num_nodes={num_nodes} needs this node's rank: set trainer.node_rank=0..."
                             f"{num_nodes - 1} (or NODE_RANK; under SLURM, srun sets SLURM_NODEID).")
        node_rank = int(found)
    if not 0 <= node_rank < num_nodes:
        raise ValueError(f"trainer.node_rank must be in 0..{num_nodes - 1}, got {node_rank}.")
    if endpoint is None and env.get("MASTER_ADDR"):
        endpoint = f"{env['MASTER_ADDR']}:{env.get('MASTER_PORT') or DEFAULT_PORT}"
    if not endpoint:
        raise ValueError(f"trainer.num_nodes={num_nodes} needs the rendezvous endpoint of node 0: set "
                         "trainer.rdzv_endpoint=HOST:PORT (or MASTER_ADDR / MASTER_PORT).")
    host, _, port = endpoint.rpartition(":") if ":" in endpoint else (endpoint, "", str(DEFAULT_PORT))
    if not host or not port.isdigit():
        raise ValueError(f"trainer.rdzv_endpoint must be HOST:PORT, got {endpoint!r}.")
    return NodeLaunch(num_nodes, node_rank, host, int(port))


@dataclass(frozen=True)
class Host:
    """One line of a hostfile: ``name slots=N``."""

    name: str
    slots: int


def parse_hostfile(text: str) -> list[Host]:
    """DeepSpeed's hostfile format: ``host slots=N`` per line, ``#`` comments and blank lines ignored.

    Raises:
        ValueError: a malformed line (named with its number), a repeated host, or unequal slots.
    """
    hosts: list[Host] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2 or not parts[1].startswith("slots=") or not parts[1][6:].isdigit() or int(parts[1][6:]) < 1:
            raise ValueError(f"hostfile line {number}: expected 'HOST slots=N' (N >= 1), got {raw.strip()!r}.")
        if any(h.name == parts[0] for h in hosts):
            raise ValueError(f"hostfile line {number}: host {parts[0]!r} is listed twice.")
        hosts.append(Host(parts[0], int(parts[1][6:])))
    if not hosts:
        raise ValueError("the hostfile lists no host ('HOST slots=N' per line).")
    if len({h.slots for h in hosts}) > 1:
        raise ValueError("every host of the hostfile needs the same slots (trainer.devices per node), got "
                         + ", ".join(f"{h.name}={h.slots}" for h in hosts) + ".")
    return hosts


def host_commands(hosts: Sequence[Host], overrides: Sequence[str], port: int = DEFAULT_PORT,
                  program: str = "lightning-zero") -> list[tuple[str, str]]:
    """``(host, command)`` per host: ``lightning-zero train`` with this node's rank, the job's node count,
    the slots as ``trainer.devices`` and the first host as the rendezvous endpoint."""
    master = hosts[0].name
    out = []
    for rank, host in enumerate(hosts):
        args = [program, "train", *overrides, f"trainer.num_nodes={len(hosts)}", f"trainer.node_rank={rank}",
                f"trainer.devices={host.slots}", f"trainer.rdzv_endpoint={master}:{port}"]
        out.append((host.name, shlex.join(args)))
    return out


def run_over_ssh(commands: Sequence[tuple[str, str]], workdir: str | Path) -> int:
    """Start every host's command over ``ssh HOST 'cd WORKDIR && COMMAND'`` at once; the first non-zero exit
    code (0 when all succeed)."""
    procs = [subprocess.Popen(["ssh", host, f"cd {shlex.quote(str(workdir))} && {cmd}"]) for host, cmd in commands]
    codes = [p.wait() for p in procs]
    return next((c for c in codes if c != 0), 0)


def node_device_problems(accelerator: str, devices: int) -> list[str]:
    """GPUs a run asks for (``trainer.accelerator`` gpu / cuda, ``trainer.devices`` per node) that this node does not
    have: refused before any rank starts, naming the CPU options (every node of a multi-node run checks its own)."""
    if accelerator not in ("gpu", "cuda"):
        return []
    import torch

    if not torch.cuda.is_available():
        two, one = (" trainer.devices=2", " trainer.devices=1") if devices > 2 else ("", "")  # an experiment's count
        return [f"trainer.accelerator={accelerator}, but this machine has no GPU that torch can use "
                f"(torch.cuda.is_available() is False). Fix: trainer=cpu2{two} (2 CPU processes) or trainer=cpu1{one}."]
    have = torch.cuda.device_count()
    if devices > have:
        return [f"trainer.devices={devices} GPU ranks, but this machine has {have} GPU(s). Fix: "
                f"trainer.devices={have}."]
    return []
