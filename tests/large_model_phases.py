"""Phases of the "model bigger than a rank" test (tests/e2e/test_large_models.py), each run as fresh
processes under a per-process ``RLIMIT_DATA`` that DDP's per-rank state exceeds:

    train   2 ranks (``torch.distributed.run``): build in ``configure_model`` at the default
            persistence threshold, fit 4 steps, ``trainer.save_checkpoint`` after step 2
    resume  2 ranks: a fresh run resumes from that checkpoint (``ckpt_path``) and fits to step 4
    convert 1 process: ``lightning-zero convert`` of the checkpoint to ``.safetensors``

Each rank writes ``<phase>-rank<r>.json``: losses, and the peak resident set (``VmHWM``, reset
through ``/proc/self/clear_refs`` at the start of each part) of every part.
"""

from __future__ import annotations

import json
import os
import resource
import sys
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

DIM, BLOCKS, VOCAB, SEQ = 768, 6, 2048, 32
PSI = BLOCKS * (12 * DIM * DIM + 13 * DIM) + 2 * VOCAB * DIM + VOCAB + SEQ * DIM + 2 * DIM
DDP_STATE = 16 * PSI  # fp32 AdamW, per rank: params 4 + grads 4 + moments 8 bytes per parameter
LIMIT = int(0.9 * DDP_STATE)  # above the phase's starting VmData: DDP's state does not fit, 1/2 of it does


def status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS


def return_freed_memory_to_the_os() -> None:
    """Fix glibc's mmap threshold at 128 KiB: large tensors are then always mmap-ed and unmapped
    on free. (By default the threshold grows after big frees, and freed buffers stay in the heap,
    so the resident set would count memory the model no longer uses.)"""
    import ctypes

    ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # -3: M_MMAP_THRESHOLD


def limit_memory() -> dict[str, Any]:
    """Return freed memory to the OS (a fixed mmap threshold), then cap this process's data
    segment at ``LIMIT`` above what it uses now; check DDP's per-rank state cannot be allocated."""
    return_freed_memory_to_the_os()
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    if os.environ.get("LZ_DEBUG"):
        print("start", {k: status(k) >> 20 for k in ("VmHWM", "VmRSS", "VmData")}, LIMIT >> 20, flush=True)
    resource.setrlimit(resource.RLIMIT_DATA, (status("VmData") + LIMIT, hard))
    try:
        torch.empty(DDP_STATE // 4)
        ddp_fits = True
    except (RuntimeError, MemoryError):
        ddp_fits = False
    reset_peak()
    return {"ddp_state_fits": ddp_fits, "limit": LIMIT, "ddp_state": DDP_STATE, "psi": PSI,
            "start_rss": status("VmRSS")}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.fc1, self.fc2 = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, _ = h.shape
        q, k, v = self.qkv(self.ln1(h)).view(b, t, 3, 12, DIM // 12).permute(2, 0, 3, 1, 4)
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.proj(a.transpose(1, 2).reshape(b, t, DIM))
        return h + self.fc2(torch.relu(self.fc1(self.ln2(h))))


class BigLM(pl.LightningModule):
    """A GPT-style stack built in ``configure_model`` (meta under stage 3): weights above the
    default persistence threshold are sharded, biases, LayerNorms and the position embedding
    are persistent."""

    def __init__(self) -> None:
        super().__init__()
        self.net: nn.Module | None = None
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if self.net is None:
            self.net = nn.ModuleDict({
                "emb": nn.Embedding(VOCAB, DIM), "pos": nn.Embedding(SEQ, DIM),
                "blocks": nn.ModuleList(Block() for _ in range(BLOCKS)),
                "ln": nn.LayerNorm(DIM), "head": nn.Linear(DIM, VOCAB),
            })

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        h = self.net["emb"](x[:, :-1]) + self.net["pos"](torch.arange(x.shape[1] - 1))
        for block in self.net["blocks"]:
            h = block(h)
        logits = self.net["head"](self.net["ln"](h))
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), x[:, 1:].reshape(-1))
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Phases(pl.Callback):
    """Records the peak RSS of each part of a run; saves after step ``save_at`` when given."""

    def __init__(self, path: str | None, save_at: int) -> None:
        self.path, self.save_at = path, save_at
        self.peaks: dict[str, int] = {}

    def _mark(self, part: str) -> None:
        self.peaks[part] = max(self.peaks.get(part, 0), status("VmHWM"))
        if os.environ.get("LZ_DEBUG"):
            print(part, {k: status(k) >> 20 for k in ("VmHWM", "VmRSS", "VmData")}, flush=True)
        reset_peak()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._mark("setup")  # sharded construction (and, when resuming, reading the checkpoint)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if os.environ.get("LZ_DEBUG"):
            self._mark(f"step{trainer.global_step}")
        if self.path is not None and trainer.global_step == self.save_at:
            self._mark("train")
            trainer.save_checkpoint(self.path)
            self._mark("save")

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._mark("train")


def run(phase: str, root: str) -> None:
    from lightning_zero import ZeroStrategy
    from tests.e2e.test_checkpoints import ResumableLoader
    from tests.models import make_trainer, token_loader

    info = limit_memory()
    torch.manual_seed(0)
    model = BigLM()
    ckpt = os.path.join(root, "step2.ckpt")
    phases = Phases(ckpt if phase == "train" else None, save_at=2)
    strategy = ZeroStrategy(stage=3, prefetch_bucket_size=1)  # the default param_persistence_threshold
    trainer = make_trainer(strategy, max_steps=4, callbacks=[phases])
    loader = ResumableLoader(token_loader(n=32, seq=SEQ + 1, batch_size=2))
    loader.trainer = trainer
    from lightning_zero.core.stage3.memory_room import memory_pools

    trainer.fit(model, loader, ckpt_path=ckpt if phase == "resume" else None)
    runtime = strategy._run.last_runtime
    info.update(
        losses=model.losses, peaks=phases.peaks, rank=trainer.global_rank,
        released=min(u.releases for u in runtime.units if not u.persistent),
        peak_live=runtime.peak_live_numel, persistent=any(u.persistent for u in runtime.units),
        all_nan_after=all(torch.isnan(p).all() for p in model.parameters()),
        any_nan_after=any(torch.isnan(p).any() for p in model.parameters()),
        room_at_teardown=min(p.room for p in memory_pools(torch.device("cpu"))),
    )
    with open(os.path.join(root, f"{phase}-rank{trainer.global_rank}.json"), "w") as f:
        json.dump(info, f)


def convert(root: str) -> None:
    from lightning_zero.cli import main

    info = limit_memory()
    code = main(["convert", os.path.join(root, "step2.ckpt"), os.path.join(root, "model.safetensors")])
    info.update(code=code, peaks={"convert": status("VmHWM")})
    with open(os.path.join(root, "convert-rank0.json"), "w") as f:
        json.dump(info, f)


if __name__ == "__main__":
    phase, root = sys.argv[1], sys.argv[2]
    convert(root) if phase == "convert" else run(phase, root)
    from lightning_zero.config.run.worker import exit_after_handlers

    exit_after_handlers(0)  # as the CLI's ranks do: without ~2 s of interpreter teardown
