"""1-bit Adam against AdamW on 2 gloo ranks: convergence, bytes on the wire, and step time on slow links.

Two parts, each in fresh processes (``torch.multiprocessing``, gloo over a file store):

* ``convergence``: the GPT experiment's model (``--model``, default gpt_tiny) on the Python
  standard library's source, trained with AdamW, with 1-bit Adam (warm-up = 15% of the steps) and
  with 1-bit Adam without error feedback (the ablation); the validation loss on fixed held-out
  batches every ``--val-every`` steps, and the bytes each rank sent (``DataParallelComm.bytes_sent``,
  the ring model of docs/design.md). Writes ``docs/onebit_adam_convergence.png``.
* ``speed``: the median step time after the warm-up, AdamW against 1-bit Adam, on the link as it
  is and on an emulated slower link. Emulation: every torch.distributed collective of the process
  is wrapped so that it occupies a link of the given bandwidth for its ring-model bytes: a blocking
  collective returns when its bytes have crossed; an asynchronous one's ``wait()`` does, so the
  gradient all-reduce still overlaps with backward as it would on a real link. Rounds interleave
  the systems; the median over rounds is reported.

Run: python benchmarks/bench_onebit_adam.py --part convergence --steps 600
     python benchmarks/bench_onebit_adam.py --part speed --model gpt_small --gbits 0,10,1
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments.data import TokenChunkDataset, load_corpus, split_corpus
from experiments.gpt import GPT, GPT_PRESETS, param_groups

from lightning_zero import OneBitAdam, ZeroEngine
from lightning_zero.core.comm.data_parallel import DataParallelComm
from lightning_zero.core.settings.zero import ZeroConfig

DOCS = Path(__file__).resolve().parents[1] / "docs"


# ------------------------------------------------------------------------------------------ link emulation
class _Link:
    """One full-duplex link of ``bytes_per_s``: each collective occupies it for its bytes, in issue order."""

    def __init__(self, bytes_per_s: float) -> None:
        self.rate, self.free_at = bytes_per_s, 0.0

    def occupy(self, nbytes: float) -> float:
        start = max(time.perf_counter(), self.free_at)
        self.free_at = start + nbytes / self.rate
        return self.free_at


class _Delayed:
    def __init__(self, work: Any, done_at: float) -> None:
        self.work, self.done_at = work, done_at

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        out = self.work.wait(*args, **kwargs)
        time.sleep(max(0.0, self.done_at - time.perf_counter()))
        return out


def _ring_bytes(name: str, args: tuple[Any, ...], world: int) -> float:
    def nbytes(t: Any) -> int:
        if isinstance(t, (list, tuple)):
            return sum(nbytes(x) for x in t)
        return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0

    if name == "all_reduce":
        return 2 * (world - 1) / world * nbytes(args[0])
    if name in ("all_gather_into_tensor", "all_gather_single", "all_gather"):
        return (world - 1) / world * nbytes(args[0])
    if name in ("reduce_scatter_tensor", "reduce_scatter_single", "all_to_all", "reduce_scatter"):
        return (world - 1) / world * nbytes(args[1])
    return (world - 1) / world * nbytes(args[0])  # broadcast


def throttle(bytes_per_s: float) -> None:
    """Wrap this process's torch.distributed collectives so they cross a link of ``bytes_per_s``."""
    link = _Link(bytes_per_s)
    for name in ("all_reduce", "all_gather_into_tensor", "all_gather_single", "all_gather", "reduce_scatter_tensor",
                 "reduce_scatter_single", "reduce_scatter", "all_to_all", "broadcast"):
        if not hasattr(dist, name):  # the *_single names are torch >= 2.13's
            continue
        original = getattr(dist, name)

        def wrapped(*args: Any, _original: Any = original, _name: str = name, **kwargs: Any) -> Any:
            done_at = link.occupy(_ring_bytes(_name, args, dist.get_world_size()))
            work = _original(*args, **kwargs)
            if kwargs.get("async_op"):
                return _Delayed(work, done_at)
            time.sleep(max(0.0, done_at - time.perf_counter()))
            return work

        setattr(dist, name, wrapped)


# ------------------------------------------------------------------------------------------ training
def _data(seq_len: int) -> tuple[TokenChunkDataset, TokenChunkDataset]:
    train, val = split_corpus(load_corpus(max_bytes=4_000_000), 0.05)
    return TokenChunkDataset(train, seq_len), TokenChunkDataset(val, seq_len, max_samples=64)


def _batch(ds: TokenChunkDataset, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    items = [ds[i] for i in indices]
    return torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])


def _lr_factor(step: int, warmup: int, steps: int, cosine: bool) -> float:
    """Linear warm-up, then constant or cosine decay to 10% (the GPT experiment's schedules)."""
    if step < warmup:
        return (step + 1) / warmup
    if not cosine:
        return 1.0
    progress = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def _train(rank: int, world: int, model_name: str, optimizer: str, steps: int, freeze: int, batch: int,
           lr: float, val_every: int, timed: bool, cosine: bool = False) -> dict[str, Any]:
    cfg = GPT_PRESETS[model_name]
    train_ds, val_ds = _data(cfg.seq_len)
    torch.manual_seed(0)
    model = GPT(cfg)
    groups = param_groups(model, 0.1)
    if optimizer == "adamw":
        opt: torch.optim.Optimizer = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))
    else:
        opt = OneBitAdam(groups, lr=lr, betas=(0.9, 0.95), freeze_step=freeze,
                         error_feedback=optimizer == "onebit")
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(s, warmup, steps, cosine))
    engine = ZeroEngine(model, opt, ZeroConfig(stage=0), DataParallelComm())
    gen = torch.Generator().manual_seed(1)
    order = torch.randperm(len(train_ds), generator=gen).tolist()
    val_losses, times, step_bytes = [], [], []
    for step in range(steps):
        if val_every and step % val_every == 0:
            val_losses.append((step, _validate(model, val_ds)))
        start, before = time.perf_counter(), engine.comm.bytes_sent
        picks = order[(step * world + rank) * batch:(step * world + rank + 1) * batch]
        x, y = _batch(train_ds, picks)
        engine.zero_grad()
        engine.before_backward()
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        engine.finish_backward()
        engine.clip_grad_norm_(1.0)
        opt.step()
        engine.after_step()
        sched.step()
        times.append(time.perf_counter() - start)
        step_bytes.append(engine.comm.bytes_sent - before)
    if val_every:
        val_losses.append((steps, _validate(model, val_ds)))
    params = sum(p.numel() for p in model.parameters())
    return {"val": val_losses, "times": times, "bytes": step_bytes, "params": params,
            "fp32_allreduce_bytes": 2 * (world - 1) * params * 4 // world}


@torch.no_grad()
def _validate(model: GPT, ds: TokenChunkDataset) -> float:
    model.eval()
    x, y = _batch(ds, list(range(len(ds))))
    loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()
    model.train()
    return loss


def _worker(rank: int, world: int, store: str, jobs: list[dict[str, Any]], out: str, gbit: float) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    if gbit:
        throttle(gbit * 1e9 / 8)
    results = [_train(rank, world, **job) for job in jobs]
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def run(jobs: list[dict[str, Any]], gbit: float = 0.0, world: int = 2) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        mp.spawn(_worker, args=(world, os.path.join(tmp, "store"), jobs, out, gbit), nprocs=world, join=True)
        return json.loads(Path(out).read_text())


# ------------------------------------------------------------------------------------------ parts
def convergence(args: argparse.Namespace) -> None:
    freeze = max(1, round(0.15 * args.steps))
    base = dict(model_name=args.model, steps=args.steps, freeze=freeze, batch=args.batch, lr=args.lr,
                val_every=args.val_every, timed=False, cosine=args.schedule == "cosine")
    names = ("adamw", "onebit", "onebit_no_feedback")
    results = dict(zip(names, run([{**base, "optimizer": n} for n in names])))
    print(f"model {args.model} ({results['adamw']['params'] / 1e6:.2f}M params), 2 ranks, {args.steps} steps, "
          f"batch {args.batch} per rank, lr {args.lr} ({args.schedule}), freeze_step {freeze} (15%)")
    adamw_bytes = sum(results["adamw"]["bytes"])
    print("| optimizer | final val loss | vs AdamW | bytes sent per rank | vs AdamW |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        final, total = r["val"][-1][1], sum(r["bytes"])
        ref = results["adamw"]["val"][-1][1]
        print(f"| {name} | {final:.4f} | {100 * (final / ref - 1):+.2f}% | {total / 1e6:.2f} MB | "
              f"1/{adamw_bytes / total:.1f} |")
    after = statistics.median(results["onebit"]["bytes"][freeze + 1:])
    plain = statistics.median(results["adamw"]["bytes"])
    print(f"bytes per step after the freeze: {after:.0f} vs AdamW's {plain:.0f} (1/{plain / after:.1f})")
    _plot(results, freeze, DOCS / "onebit_adam_convergence.png")


def _plot(results: dict[str, Any], freeze: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in results.items():
        steps, losses = zip(*r["val"])
        ax.plot(steps, losses, marker="o", markersize=3, label=name.replace("_", " "))
    ax.axvline(freeze, color="grey", linestyle=":", label=f"freeze_step={freeze}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("validation loss (nats/byte)")
    ax.set_title("1-bit Adam vs AdamW, 2 gloo ranks")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path.relative_to(DOCS.parent)}")


def speed(args: argparse.Namespace) -> None:
    base = dict(model_name=args.model, steps=args.timed_steps + 2, freeze=2, batch=args.batch, lr=args.lr,
                val_every=0, timed=True)
    table: dict[tuple[float, str], list[float]] = {}
    sizes: dict[str, float] = {}
    for _ in range(args.rounds):
        for gbit in args.gbits:
            for name in ("adamw", "onebit"):
                (r,) = run([{**base, "optimizer": name}], gbit=gbit)
                table.setdefault((gbit, name), []).append(statistics.median(r["times"][3:]))
                sizes[name] = statistics.median(r["bytes"][3:])
    print(f"model {args.model}, 2 ranks, batch {args.batch} per rank, median step time after the freeze, "
          f"{args.rounds} interleaved rounds (median of per-round medians over {args.timed_steps - 1} steps)")
    print(f"bytes sent per rank per step: AdamW {sizes['adamw'] / 1e6:.2f} MB, 1-bit Adam "
          f"{sizes['onebit'] / 1e6:.3f} MB (1/{sizes['adamw'] / sizes['onebit']:.1f})")
    print("| link | AdamW step (s) | 1-bit Adam step (s) | 1-bit / AdamW |")
    print("|---|---|---|---|")
    for gbit in args.gbits:
        a, o = statistics.median(table[(gbit, "adamw")]), statistics.median(table[(gbit, "onebit")])
        link = "as is (gloo, one machine)" if not gbit else f"{gbit:g} Gbit/s emulated"
        print(f"| {link} | {a:.3f} | {o:.3f} | {o / a:.2f}x |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("convergence", "speed"), required=True)
    p.add_argument("--model", default=None)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--val-every", type=int, default=20)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--schedule", choices=("constant", "cosine"), default="cosine")
    p.add_argument("--gbits", type=lambda s: [float(x) for x in s.split(",")], default=[0.0, 10.0, 1.0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--timed-steps", type=int, default=6)
    args = p.parse_args()
    if args.part == "convergence":
        args.model = args.model or "gpt_tiny"
        convergence(args)
    else:
        args.model = args.model or "gpt_small"
        speed(args)


if __name__ == "__main__":
    main()
