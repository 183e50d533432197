"""One process training a stack of linear units at ZeRO stage 3 whose model state is 8x its memory cgroup, for
tests/e2e/test_infinity.py: ``python tests/infinity_cgroup_script.py OUT NVME_PATH MODE`` run inside the cgroup.

MODE ``disk``: parameter shards, gradient shards, fp32 masters and AdamW moments in swap files under NVME_PATH
(``offload=param_nvme``), 2 optimizer steps; ``none``: the same without offload (the control the cgroup kills).
The model is built on the meta device and materialised one unit at a time (as ``configure_model`` does), so
setup never holds more than a unit. Writes ``{"losses", "state_bytes", "peak_rss"}`` to OUT.
"""

from __future__ import annotations

import json
import sys

import torch
from torch import nn

from lightning_zero import ZeroConfig, ZeroEngine
from lightning_zero.core.comm.data_parallel import DataParallelComm
from lightning_zero.core.settings.offload import OffloadConfig
from lightning_zero.core.stage3.materialize import parameters_on_meta, replace_meta_parameters
from lightning_zero.testing.memory import proc_status_bytes

WIDTH, UNITS = 1024, 224  # 224 units of 1.05M parameters: 235M, 16 bytes each in fp32 with AdamW = 3.76 GB


def main(out: str, nvme: str, mode: str) -> None:
    torch.manual_seed(0)
    with parameters_on_meta():
        model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(UNITS)])
    replace_meta_parameters(model, torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    state = 16 * sum(p.numel() for p in model.parameters())  # params, grads and two moments, fp32
    unit = WIDTH * WIDTH + WIDTH
    config = ZeroConfig(stage=3, unit_classes=(nn.Linear,), param_persistence_threshold=0,
                        prefetch_bucket_size=unit, reduce_bucket_size=unit)  # one unit read ahead, one kept
    offload = OffloadConfig(optimizer_device="nvme", param_device="nvme", nvme_path=nvme, sub_group_size=1 << 17)
    engine = ZeroEngine(model, optimizer, config, DataParallelComm(), offload=offload if mode == "disk" else None)
    x = torch.randn(4, WIDTH)
    losses = []
    for _ in range(2):
        engine.before_backward()
        loss = model(x).square().mean()
        loss.backward()
        engine.finish_backward()
        engine.prepare_step()
        optimizer.step()
        engine.after_step()
        losses.append(loss.item())
    engine.detach(keep_optimizer_state=False, gather_params=False)
    with open(out, "w") as f:
        json.dump({"losses": losses, "state_bytes": state, "peak_rss": proc_status_bytes("VmHWM")}, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
