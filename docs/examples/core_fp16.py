"""ZeRO stage 2 in fp16 from plain PyTorch (no Lightning): the core engine and DeepSpeed's loss scaling on 2 CPU
processes (docs/precision.md, "From plain PyTorch").

Run: python docs/examples/core_fp16.py   (starts its 2 ranks itself; under torchrun, runs as the launched rank)
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from lightning_zero.core.comm.data_parallel import DataParallelComm
from lightning_zero.core.precision.loss_scaler import LossScaler
from lightning_zero.core.settings import DtypePolicy, ZeroConfig
from lightning_zero.core.zero.engine import ZeroEngine


class Regression(nn.Module):
    """A small MLP whose forward returns the batch's mean squared error."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x.to(self.net[0].weight.dtype)), y.to(self.net[0].weight.dtype))


def train(steps: int = 8) -> None:
    torch.manual_seed(0)  # the same model on every rank
    model = Regression()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1 + dist.get_rank())  # each rank its own batches
    data = [(torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)) for _ in range(steps)]

    fp32 = {p: p.detach().clone() for p in model.parameters()}
    model.half()
    engine = ZeroEngine(model, optimizer, ZeroConfig(stage=2), DataParallelComm(),
                        dtypes=DtypePolicy(param_dtype=torch.float16, master_dtype=torch.float32), master_init=fp32)
    scaler = LossScaler()
    skipped = 0
    for batch in data:
        loss = model(batch).float()
        (loss * scaler.scale).backward()
        engine.finish_backward()
        overflow = engine.prepare_step(scaler.scale, check_overflow=True)  # agreed across ranks
        scaler.update(overflow)
        if not overflow:
            engine.clip_grad_norm_(1.0)
            optimizer.step()
        skipped += overflow
        engine.after_step()
    if dist.get_rank() == 0:
        print(f"{steps} steps, {skipped} skipped (overflow), last loss {loss.item():.4f}, loss scale {scaler.scale:g}")


def _rank(rank: int, world_size: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        train()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    if dist.is_initialized():  # a rank of a group made already (the test suite's pool)
        train()
    elif "RANK" in os.environ:  # a rank started by torchrun
        _rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["MASTER_PORT"]))
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            free = s.getsockname()[1]
        mp.spawn(_rank, args=(2, free), nprocs=2)
