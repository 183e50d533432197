"""One rank of a stage-3 fit whose end-of-fit gather does not fit in its memory cgroup, for
tests/e2e/test_large_models.py: ``python tests/teardown_cgroup_script.py ROOT CGROUP VERSION`` with RANK /
WORLD_SIZE / MASTER_ADDR / MASTER_PORT set, both ranks in the memory cgroup at the directory CGROUP (VERSION 1 or
2; the test makes it and puts them there).

An MLP of 16.8M parameters (67 MB in fp32, 4 Linear units) trains 2 steps with AdamW under ZeRO 3 on 2 gloo ranks.
At ``on_train_end`` rank 0 sets the cgroup's limit to what the ranks use then plus 64 MiB: the gather of both ranks
needs 0.52 GiB with AdamW's state, 0.27 GiB without (Note [memory pools] in lightning_zero/core/stage3/memory_room.py),
so it must not start. Each rank then writes ``ROOT/rank<r>.json``:
whether its parameters are left released, and the warnings it got.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero import ZeroStrategy
from lightning_zero.core.stage3.sharded_unit import is_released
from tests.models import RankSampler, make_trainer

WIDTH, LAYERS = 2048, 4
PARAMS = LAYERS * (WIDTH * WIDTH + WIDTH)
HEADROOM = 64 * 2**20  # less than either rank's parameters with teardown.py's slack (67 MB x 1.05 + 64 MiB)


class Wide(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).square().mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class LimitAtTheEnd(pl.Callback):
    """Rank 0 lowers the cgroup's limit to its working set (usage less inactive file cache) plus ``HEADROOM``;
    every rank waits for it before teardown."""

    def __init__(self, cgroup: Path, version: int) -> None:
        self.cgroup, self.version = cgroup, version

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_rank == 0:
            cgroup, version = self.cgroup, self.version
            usage = int((cgroup / ("memory.usage_in_bytes" if version == 1 else "memory.current")).read_text())
            stat = dict(line.split() for line in (cgroup / "memory.stat").read_text().splitlines())
            inactive = int(stat["total_inactive_file" if version == 1 else "inactive_file"])
            limit = usage - inactive + HEADROOM
            if version == 1:
                (cgroup / "memory.limit_in_bytes").write_text(str(limit))
                if (cgroup / "memory.memsw.limit_in_bytes").exists():  # no swapping around the limit either
                    (cgroup / "memory.memsw.limit_in_bytes").write_text(str(limit))
            else:
                (cgroup / "memory.max").write_text(str(limit))
                if (cgroup / "memory.swap.max").exists():
                    (cgroup / "memory.swap.max").write_text("0")
            print(f"LIMIT {limit >> 20} MiB, {(usage - inactive) >> 20} MiB in use", flush=True)
        trainer.strategy.barrier("limit set")


def main(root: str, cgroup: str, version: int) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data = TensorDataset(torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(1)))
    loader = DataLoader(data, batch_size=2, sampler=RankSampler(8, rank, world))
    model = Wide()
    strategy = ZeroStrategy(stage=3, param_persistence_threshold=0, unit_classes=(nn.Linear,), timeout_s=120,
                            hang_timeout_s=0, monitor=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = make_trainer(strategy, devices=world, max_steps=2, callbacks=[LimitAtTheEnd(Path(cgroup), version)])
        trainer.fit(model, loader)
    result = {"released": all(is_released(p) for p in model.parameters()),
              "warnings": [str(w.message) for w in caught if "gather_on_teardown" in str(w.message)]}
    Path(root, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    from lightning_zero.config.run.worker import exit_after_handlers

    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
    exit_after_handlers(0)
