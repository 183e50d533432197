"""Tensor parallelism (issue 31) at TP 2 on 2 gloo ranks of this machine, printed as markdown for
docs/benchmarks.md:

* ``step``: the training step time (forward, backward, AdamW) of one transformer, in two harnesses, the systems
  of each interleaved round by round (median of the rounds' medians):
  - a plain PyTorch loop: the unsplit model on each rank (no TP, the floor), this project's layers
    (``apply_plan``) and torch's own ``parallelize_module`` (DTensor ``ColwiseParallel`` / ``RowwiseParallel``),
    one plan in torch's styles for both;
  - Lightning's ``Trainer``: ``ZeroStrategy(stage=0, tensor_parallel=2)`` against Lightning's
    ``ModelParallelStrategy(tensor_parallel_size=2)`` whose ``configure_model`` calls ``parallelize_module``.
* ``traffic``: the collectives one rank issues per training step after the first (which also checks the
  replicated gradients once across the TP group), counted at the call (every
  ``torch.distributed.all_reduce`` / ``all_gather``: its tensor's bytes), against Megatron's formula: 2
  all-reduces of B x T x H per block forward and 2 backward (4 here: this file's model has separate q, k
  and v layers, each column-parallel layer's f all-reduces its input's gradient; the GPT fuses them), and,
  for the project's GPT with its
  vocabulary-parallel embedding, tied head and cross-entropy, one more each way and 3 all-reduces of B x T
  per-token fp32 scalars. torch's DTensor collectives run as functional ops: counted with its
  ``CommDebugMode`` (counts, no bytes).

Run: .venv/bin/python benchmarks/bench_tensor_parallel.py --rounds 5 --steps 8
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.nn.functional as F
from torch import nn

H, LAYERS, HEADS, VOCAB, T, B = 256, 4, 8, 1024, 128, 8


class Block(nn.Module):
    """Pre-norm attention (separate q, k, v: the heads a rank holds follow from its q's output width) and MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(H), nn.LayerNorm(H)
        self.q, self.k, self.v, self.o = (nn.Linear(H, H) for _ in range(4))
        self.fc, self.proj = nn.Linear(H, 4 * H), nn.Linear(4 * H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ln1(x)
        dim = H // HEADS
        q, k, v = (t.view(B, T, -1, dim).transpose(1, 2) for t in (self.q(y), self.k(y), self.v(y)))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, -1)
        x = x + self.o(a)
        return x + self.proj(F.gelu(self.fc(self.ln2(x))))


class Net(nn.Module):
    """Embedding, LAYERS blocks, final norm and head (the embedding and head replicated: not in the plan)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.blocks = nn.Embedding(VOCAB, H), nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f, self.head = nn.LayerNorm(H), nn.Linear(H, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def torch_plan(prefix: str = "") -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {f"{prefix}blocks.*.{n}": ColwiseParallel() for n in ("q", "k", "v", "fc")}
    plan.update({f"{prefix}blocks.*.{n}": RowwiseParallel() for n in ("o", "proj")})
    return plan


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (n, B, T + 1), generator=g)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _split(system: str, model: nn.Module, prefix: str = "") -> None:
    import torch.distributed as dist

    if system == "ours":
        from lightning_zero.tensor_parallel.collectives import TPGroup
        from lightning_zero.tensor_parallel.plan import apply_plan, resolve_plan

        tp = TPGroup(dist.group.WORLD, dist.get_world_size(), dist.get_rank())
        apply_plan(model, resolve_plan(model, torch_plan(prefix), "the bench plan"), tp)
    elif system == "torch":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module

        parallelize_module(model, init_device_mesh("cpu", (dist.get_world_size(),)), torch_plan(prefix))


def loop_body(system: str, steps: int, warmup: int) -> list[float]:
    """Step times (s) of a plain loop on this rank: ``whole`` (unsplit), ``ours`` or ``torch`` TP."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Net()
    _split(system, model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times = []
    for i, (x, y) in enumerate(_batches(steps + warmup)):
        start = time.perf_counter()
        F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


class _Module:  # built lazily: Lightning is imported in the workers only
    @staticmethod
    def make() -> Any:
        import lightning.pytorch as pl
        from lightning.pytorch.strategies import ModelParallelStrategy

        class BenchModule(pl.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.net = Net()

            def tensor_parallel_plan(self) -> dict[str, Any]:
                return torch_plan("net.")

            def configure_model(self) -> None:
                if isinstance(self.trainer.strategy, ModelParallelStrategy):
                    from torch.distributed.tensor.parallel import parallelize_module

                    parallelize_module(self.net, self.device_mesh["tensor_parallel"], torch_plan())

            def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
                x, y = batch
                return F.cross_entropy(self.net(x).reshape(-1, VOCAB), y.reshape(-1))

            def configure_optimizers(self) -> torch.optim.Optimizer:
                return torch.optim.AdamW(self.parameters(), lr=1e-3)

        return BenchModule()


def trainer_body(system: str, steps: int, warmup: int) -> list[float]:
    """Step times (s) through Lightning's Trainer: ``zero`` (ZeroStrategy, TP 2) or ``lightning``
    (ModelParallelStrategy, TP 2)."""
    import lightning.pytorch as pl
    import torch.distributed as dist
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_zero import ZeroStrategy

    torch.set_num_threads(1)
    torch.manual_seed(0)
    world = dist.get_world_size()
    strategy = (ZeroStrategy(stage=0, tensor_parallel=world) if system == "zero" else
                ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=world))
    times: list[float] = []
    marks: dict[str, float] = {}

    class Clock(pl.Callback):
        def on_train_batch_start(self, *args: Any) -> None:
            marks["start"] = time.perf_counter()

        def on_train_batch_end(self, *args: Any) -> None:
            times.append(time.perf_counter() - marks["start"])

    os.environ.setdefault("PL_DISABLE_FORK", "1")
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=world, max_steps=steps + warmup, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[Clock()], use_distributed_sampler=False)
    from torch.utils.data import DataLoader

    trainer.fit(_Module.make(), DataLoader(_batches(steps + warmup), batch_size=None))
    return times[warmup:]


def traffic_body(model_name: str) -> dict[str, Any]:
    """The collectives of one training step on this rank: ``bench`` (this file's model under our layers), ``gpt``
    (the project's GPT, its own plan) or ``torch`` (this file's model under DTensor, CommDebugMode counts)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    torch.manual_seed(0)
    x, y = _batches(1)[0]
    if model_name == "torch":
        from torch.distributed.tensor.debug import CommDebugMode

        model = Net()
        _split("torch", model)
        mode = CommDebugMode()
        with mode:
            F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1)).backward()
        return {"counts": {str(k).split(".")[-1]: v for k, v in mode.get_comm_counts().items()}}
    calls: list[tuple[str, int]] = []
    real = {name: getattr(dist, name) for name in ("all_reduce", "all_gather")}

    def counted(name: str) -> Any:
        def call(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            if name == "all_reduce":
                calls.append((name, tensor.numel() * tensor.element_size()))
            else:  # all_gather(list_of_outputs, input): what this rank contributes
                calls.append((name, args[0].numel() * args[0].element_size()))
            return real[name](tensor, *args, **kwargs)

        return call

    if model_name == "bench":
        model: Any = Net()
        _split("ours", model)
        loss = lambda: F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))  # noqa: E731
    else:
        from lightning_zero.models.gpt import GPTConfig, GPTLightningModule
        from lightning_zero.tensor_parallel.collectives import TPGroup
        from lightning_zero.tensor_parallel.plan import apply_plan, resolve_plan

        module = GPTLightningModule(GPTConfig(vocab_size=VOCAB, seq_len=T, n_layer=LAYERS, n_head=HEADS, n_embd=H,
                                              dropout=0.0))
        tp = TPGroup(dist.group.WORLD, dist.get_world_size(), dist.get_rank())
        apply_plan(module, resolve_plan(module, module.tensor_parallel_plan(), "gpt"), tp)
        loss = lambda: module.loss((x, y))  # noqa: E731
    loss().backward()  # a first step: the one-time check of the replicated gradients (tensor_parallel/regions.py)
    for name in real:
        setattr(dist, name, counted(name))
    try:
        loss().backward()
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
    return {"calls": calls}


def _formula(model_name: str, t: int) -> tuple[int, int]:
    """(all-reduces, payload bytes) per training step at TP ``t`` (Megatron; fp32 activations)."""
    bth = B * T * H * 4
    if model_name == "bench":  # separate q, k, v: each column-parallel layer's f all-reduces its input gradient
        return 6 * LAYERS, 6 * LAYERS * bth
    # + the vocabulary-parallel embedding's forward sum, the tied head's input gradient, 3 x B x T CE scalars
    return 4 * LAYERS + 2 + 3, (4 * LAYERS + 2) * bth + 3 * B * T * 4


def main() -> None:
    from lightning_zero.testing.pool import GlooPool

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    a = parser.parse_args()
    load = os.getloadavg()
    pool = GlooPool(world_size=2, timeout_s=600)
    here = "benchmarks.bench_tensor_parallel"
    try:
        runs: dict[str, list[float]] = {}
        for r in range(a.rounds):  # interleaved: every system once per round
            for system in ("whole", "ours", "torch"):
                out = pool.run(f"{here}:loop_body", system=system, steps=a.steps, warmup=a.warmup)
                runs.setdefault(f"loop {system}", []).append(max(statistics.median(t) for t in out))
            for system in ("zero", "lightning"):
                out = pool.run(f"{here}:trainer_body", system=system, steps=a.steps, warmup=a.warmup)
                runs.setdefault(f"trainer {system}", []).append(max(statistics.median(t) for t in out))
            print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1] * 1e3:.1f} ms" for k, v in runs.items()), file=sys.stderr)
        traffic = {m: pool.run(f"{here}:traffic_body", model_name=m)[0] for m in ("bench", "gpt", "torch")}
    finally:
        pool.close()
    med = {k: statistics.median(v) * 1e3 for k, v in runs.items()}
    print(f"TP 2 on 2 gloo ranks, 1 torch thread each; model: {LAYERS} blocks, hidden {H}, {HEADS} heads, vocabulary "
          f"{VOCAB}, batch {B} x {T} tokens; AdamW; {a.rounds} interleaved rounds of {a.steps} steps after "
          f"{a.warmup} warm-up; median of the rounds' per-run medians (slowest rank). Load average "
          f"{load[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end (2 cores shared with other jobs).\n")
    print("| harness | system | step ms | vs this project | per round: ms (vs this project) |\n"
          "| :-- | :-- | --: | --: | :-- |")
    rows = [("plain loop", "unsplit model on each rank (no TP)", "loop whole", "loop ours"),
            ("plain loop", "this project's layers (`apply_plan`)", "loop ours", "loop ours"),
            ("plain loop", "torch `parallelize_module` (DTensor)", "loop torch", "loop ours"),
            ("Trainer", "`ZeroStrategy(stage=0, tensor_parallel=2)`", "trainer zero", "trainer zero"),
            ("Trainer", "Lightning `ModelParallelStrategy(tensor_parallel_size=2)`", "trainer lightning",
             "trainer zero")]
    for harness, label, key, ref in rows:
        rounds = ", ".join(f"{v * 1e3:.0f} ({v / w:.2f}x)" for v, w in zip(runs[key], runs[ref], strict=True))
        print(f"| {harness} | {label} | {med[key]:.1f} | {med[key] / med[ref]:.2f}x | {rounds} |")
    print("\n| model | collective | calls / step | bytes / step (payload) | formula calls | formula bytes |"
          "\n| :-- | :-- | --: | --: | --: | --: |")
    for m in ("bench", "gpt"):
        calls = traffic[m]["calls"]
        n, total = _formula(m, 2)
        reduces = [b for c, b in calls if c == "all_reduce"]
        gathers = [b for c, b in calls if c == "all_gather"]
        print(f"| {m} | all_reduce | {len(reduces)} | {sum(reduces)} | {n} | {total} |")
        if gathers:
            print(f"| {m} | all_gather | {len(gathers)} | {sum(gathers)} | 0 | 0 |")
    print(f"| bench under torch DTensor | CommDebugMode counts | {traffic['torch']['counts']} | - | {6 * LAYERS} "
          "all-reduces | - |")
    print("\nRing all-reduce bytes each rank sends: 2 (t - 1) / t x payload = the payload at t = 2.")


if __name__ == "__main__":
    main()
