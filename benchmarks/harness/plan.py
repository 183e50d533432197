"""What ``run_all.py`` measures: the cells (a model size, a world size, the systems, the rounds), the tuning sweeps,
and an up-front estimate of how long all of it takes on this machine."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

from benchmarks.harness.config import BenchConfig
from lightning_zero.models.gpt import count_parameters, resolve_config

# ~5M, ~20M, ~80M parameters: presets, the last one deepened and widened (GPTConfig field overrides)
SIZES: dict[str, tuple[str, tuple[tuple[str, int], ...]]] = {
    "5M": ("gpt_small", ()),
    "20M": ("gpt_20m", ()),
    "80M": ("gpt_50m", (("n_layer", 24), ("n_embd", 512), ("n_head", 8))),
    "tiny": ("gpt_tiny", ()),  # --quick only
}
PEERS = ("ddp", "torch_zero1", "fsdp2", "fsdp2_noreshard", "ds_zero0", "ds_zero1", "ds_zero2", "ds_zero3",
         "zero0", "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload_nvme", "pp2_1f1b")  # fmt: skip
GROWTH = ("ddp", "zero2", "zero3", "fsdp2", "ds_zero3")
# the stage-3 knobs of docs/tuning.md: BenchConfig field -> values, each run as zero3 beside zero2 and ddp
SWEEPS: dict[str, tuple[str, tuple[int, ...]]] = {
    "prefetch_bucket_size": ("prefetch_size", (1, 2_000_000, 50_000_000)),
    "param_persistence_threshold": ("persistence_threshold", (0, 100_000, 1_000_000)),
    "max_live_parameters": ("max_live_parameters", (2_000_000, 4_000_000, 1_000_000_000)),
    "reduce_bucket_size (+ prefetch)": ("bucket_size", (1_000_000, 6_553_600, 26_214_400)),
}


@dataclass(frozen=True)
class Entry:
    """One row of a cell: a label (the contender, or a sweep point), the contender run, its config."""

    label: str
    contender: str
    config: BenchConfig


@dataclass(frozen=True)
class Cell:
    """Systems measured together, interleaved over ``rounds``: same world size, same rows per rank."""

    key: str  # "peers", "growth:20M:w2", "sweep:prefetch_bucket_size"
    size: str
    world_size: int
    entries: tuple[Entry, ...]
    rounds: int
    meta: dict[str, str] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class Budget:
    """Steps and rounds per cell kind, chosen so that the whole run fits ``run_all.py``'s time limit."""

    peer_steps: int = 7  # 3 left the DDP ratios of stages 1-3 inside the spread between whole runs
    growth_steps: int = 2
    sweep_steps: int = 4  # 2 left the sweeps' differences inside the spread between rounds
    warmup: int = 1
    rounds: int = 3
    peer_batch: tuple[int, int] = (4, 128)  # micro-batch x seq per rank
    growth_batch: tuple[int, int] = (2, 64)
    sweep_batch: tuple[int, int] = (2, 128)  # the sweeps and the stage-3 speed items


FULL, QUICK = Budget(), Budget(peer_steps=2, growth_steps=2, sweep_steps=2, rounds=1, peer_batch=(2, 32),
                               growth_batch=(2, 32), sweep_batch=(2, 32))  # fmt: skip
# the stage-3 speed items of issue 21, each switched off alone and all together ("before"), per world size
ITEMS: dict[int, tuple[str, ...]] = {2: ("zero3_before", "zero3_agree_always", "zero3_nopool", "zero3"),
                                     1: ("zero3_before", "zero3_copy", "zero3_nopool", "zero3")}


def config_for(size: str, batch: tuple[int, int], steps: int, warmup: int) -> BenchConfig:
    model, overrides = SIZES[size]
    return BenchConfig(model=model, micro_batch=batch[0], seq_len=batch[1], steps=steps, warmup=warmup,
                       model_overrides=overrides)  # fmt: skip


def parameters(config: BenchConfig) -> int:
    return count_parameters(resolve_config(config.model, dict(config.model_overrides)))


def build_plan(budget: Budget, sizes: tuple[str, ...], worlds: tuple[int, ...], peers: tuple[str, ...],
               growth: tuple[str, ...], peer_size: str, parts: tuple[str, ...]) -> list[Cell]:  # fmt: skip
    """Every cell of the run, in the order they run (grouped by world size so that each pool starts once)."""
    cells = []
    if "peers" in parts:
        config = config_for(peer_size, budget.peer_batch, budget.peer_steps, budget.warmup)
        cells.append(Cell("peers", peer_size, 2, tuple(Entry(n, n, config) for n in peers), budget.rounds))
    if "items" in parts:
        base = config_for(peer_size, budget.sweep_batch, budget.sweep_steps, budget.warmup)
        for world, names in ITEMS.items():
            cells.append(Cell(f"items:w{world}", peer_size, world, tuple(Entry(n, n, base) for n in names),
                              budget.rounds))  # fmt: skip
    if "sweeps" in parts:
        base = config_for(peer_size, budget.sweep_batch, budget.sweep_steps, budget.warmup)
        for knob, (attr, values) in SWEEPS.items():
            entries = [Entry("zero2", "zero2", base)]  # the baseline: what stage 3 costs over stage 2
            entries += [Entry(f"zero3 {knob}={v:,}", "zero3", replace(base, **{attr: v})) for v in values]
            cells.append(Cell(f"sweep:{knob}", peer_size, 2, tuple(entries), budget.rounds, {"knob": knob}))
    if "growth" in parts:
        for world in sorted(worlds):
            for size in sizes:
                config = config_for(size, budget.growth_batch, budget.growth_steps, budget.warmup)
                entries = tuple(Entry(n, n, config) for n in growth if world > 1 or n != "torch_zero1")
                cells.append(Cell(f"growth:{size}:w{world}", size, world, entries, budget.rounds))
    return sorted(cells, key=lambda c: c.world_size)  # stable: peers, items, sweeps stay first among world 2


# -------------------------------------------------------------------------------------------- the estimate
SECONDS_PER_PARAM_TOKEN = 0.86e-10  # fp32 forward + backward + AdamW, one thread (gpt_20m, 4 x 128: DDP 951 ms)
RUN_OVERHEAD_S = 2.0  # Trainer, model build, strategy setup and teardown of one run
RUN_OVERHEAD_PER_PARAM_S = 6e-8  # model build, optimizer, engine setup grow with the model
POOL_START_S, DS_POOL_START_S = 12.0, 70.0  # spawn + imports (+ DeepSpeed's first initialize)
SLOWDOWN = {"zero3": 1.3, "zero3_before": 1.4, "zero3_agree_always": 1.4, "zero3_nopool": 1.3, "zero3_copy": 1.3,
            "fsdp2": 1.3, "fsdp2_noreshard": 1.2, "ds_zero3": 1.8, "ds_zero2": 1.3, "ds_zero1": 1.3, "ds_zero0": 1.2,
            "torch_zero1": 1.2, "zero2_offload": 1.3, "zero3_offload_nvme": 2.0}  # fmt: skip


def estimate_seconds(cells: list[Cell]) -> float:
    """Seconds the plan takes on this machine at idle: a cost model calibrated on gpt_20m (see the constants)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    total, pools = 0.0, set()
    for cell in cells:
        for entry in cell.entries:
            c = entry.config
            n = parameters(c)
            step = SECONDS_PER_PARAM_TOKEN * n * c.micro_batch * c.seq_len * max(1.0, cell.world_size / cores)
            step *= SLOWDOWN.get(entry.contender, 1.0)
            total += cell.rounds * (c.total_steps * step + RUN_OVERHEAD_S + RUN_OVERHEAD_PER_PARAM_S * n)
            pools.add((cell.world_size, entry.contender.startswith("ds_")))
    return total + sum(DS_POOL_START_S if ds else POOL_START_S for _, ds in pools)
