"""Activation memory with and without ``activation_checkpointing`` (ZeRO engine, one process).

For each setting the same GPT runs a few forward + backward passes and reports:

* saved bytes: the bytes of the tensors autograd keeps from forward for backward, counted
  exactly with ``torch.autograd.graph.saved_tensors_hooks`` (with checkpointing, the tensors a
  checkpointed block saves are dropped and recomputed, so they are not counted);
* peak RSS growth over one forward + backward (``VmHWM`` reset through ``/proc/self/clear_refs``,
  with glibc's mmap threshold fixed so freed buffers go back to the OS);
* the median step time.

Run: python benchmarks/bench_activation_checkpointing.py --model gpt_20m --batch 8 --seq-len 256
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_zero.core.comm.data_parallel import DataParallelComm
from lightning_zero.core.settings.zero import ZeroConfig
from lightning_zero.core.zero.engine import ZeroEngine
from lightning_zero.models.gpt import GPT, GPT_PRESETS
from lightning_zero.testing.memory import proc_status_bytes, reset_peak_rss


def measure(model_name: str, batch: int, seq_len: int, stage: int, checkpointing: bool, steps: int) -> dict:
    torch.manual_seed(0)
    config = GPT_PRESETS[model_name]
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine = ZeroEngine(model, optimizer, ZeroConfig(stage=stage, activation_checkpointing=checkpointing,
                                                     param_persistence_threshold=0), DataParallelComm())
    x = torch.randint(0, config.vocab_size, (batch, seq_len))
    saved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[0] += t.numel() * t.element_size()
        return t

    times, saved_bytes, rss = [], [], []
    for step in range(steps + 1):
        gc.collect()
        reset_peak_rss()
        base = proc_status_bytes("VmRSS")
        saved[0] = 0
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(x).float().logsumexp(-1).mean()
        loss.backward()
        engine.finish_backward()
        engine.prepare_step()
        optimizer.step()
        engine.after_step()
        if step:  # the first step allocates the optimizer state
            times.append(time.perf_counter() - start)
            saved_bytes.append(saved[0])
            rss.append(proc_status_bytes("VmHWM") - base)
    engine.detach()
    return {"step_ms": 1e3 * statistics.median(times), "saved_mb": statistics.median(saved_bytes) / 1e6,
            "rss_growth_mb": statistics.median(rss) / 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt_20m", choices=sorted(GPT_PRESETS))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--stages", default="2,3")
    args = parser.parse_args()
    ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD: return big frees to the OS
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    print(f"- Model: {args.model}, batch {args.batch} x seq {args.seq_len}, fp32, AdamW, 1 process "
          f"(world size 1), {torch.get_num_threads()} torch threads")
    print(f"- Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} logical cores, "
          f"Python {platform.python_version()}, torch {torch.__version__}; load average {os.getloadavg()[0]:.2f}")
    print(f"- {args.steps} measured steps after one warm-up; medians\n")
    print("| stage | activation checkpointing | saved for backward MB | peak RSS growth MB | step ms |")
    print("| --: | :-- | --: | --: | --: |")
    for stage in (int(s) for s in args.stages.split(",")):
        rows = {ck: measure(args.model, args.batch, args.seq_len, stage, ck, args.steps) for ck in (False, True)}
        for ck, r in rows.items():
            print(f"| {stage} | {'on' if ck else 'off'} | {r['saved_mb']:.1f} | {r['rss_growth_mb']:.1f} | "
                  f"{r['step_ms']:.0f} |")
        drop = 1 - rows[True]["saved_mb"] / rows[False]["saved_mb"]
        print(f"|  | stage {stage}: saved activations {100 * drop:.0f}% smaller with checkpointing |  |  |  |")


if __name__ == "__main__":
    main()
