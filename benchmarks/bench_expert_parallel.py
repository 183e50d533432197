"""Expert parallelism against ZeRO 3 without it, DeepSpeed's MoE and torchtitan's expert parallel, on one MoE model.

Every row trains the same model (seed 0, the same per-rank token batches): a token embedding, ``--layers`` blocks
``x + MoE(LayerNorm(x))`` with ``--experts`` SwiGLU experts (``--hidden`` -> ``--ffn`` -> ``--hidden``, no bias) behind
a top-2 softmax router, a final LayerNorm and the head; AdamW, fp32, plain loops (no Lightning: each system's own
engine), on ``--world-size`` gloo ranks. Rows run interleaved, ``--rounds`` times; each cell is the median over
rounds of the median step.

* ``zero3``: ZeroEngine stage 3, every expert on every rank (gathered whole by each unit).
* ``zero3_ep``: the same with expert parallelism over every rank (``ExpertParallel`` of the strategy's mesh).
* ``zero3_ep_loop``: the same, the experts computed one by one (``GroupedKernel.LOOP``) instead of grouped products.
* ``zero2_ep_ds_layer``: ZeroEngine stage 2 with expert parallelism, the layer being ``lightning_zero.moe.MoE`` (the
  DeepSpeed API: the SwiGLU expert module stacked, computed by ``vmap``), capacity factor 1.25.
* ``zero0_ep``: ZeroEngine stage 0 (data parallel, whole states) with expert parallelism: the layout of the
  torchtitan row.
* ``deepspeed_zero2_ep``: DeepSpeed's ``deepspeed.moe.layer.MoE`` with the same arguments under
  ``deepspeed.initialize`` at ZeRO 2 (DeepSpeed's MoE does not run at stage 3), ``DS_ACCELERATOR=cpu``.
* ``torchtitan_ep``: torchtitan's MoE module (its router, all-to-all token dispatcher and grouped experts, which
  compute in bf16) with its experts split over every rank, the dense gradients all-reduced by hand.

Measured per optimizer step: wall time (the slowest rank's, barriers around the step), bytes this rank sends in
every ``torch.distributed`` collective (the ring model of ``DataParallelComm.bytes_sent``: an all-reduce
2(N-1)/N of its buffer, an all-gather, reduce-scatter or broadcast (N-1)/N, an all-to-all what leaves the rank, a
send all of it), the all-to-all bytes against Note [all-to-all bytes]'s formula, and for the ZeroEngine rows at
stage 3 the expert bytes each rank gathers (its units' expert elements times the gathers).

Run: python benchmarks/bench_expert_parallel.py --deepspeed-python <venv with deepspeed and torchtitan>/bin/python
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
from torch import nn

from lightning_zero.testing.pool import GlooPool

OURS = ("zero3", "zero3_ep", "zero3_ep_loop", "zero2_ep_ds_layer", "zero0_ep")
PEERS = ("deepspeed_zero2_ep", "torchtitan_ep")
TASK = "benchmarks.bench_expert_parallel:run_row"


class SwiGLU(nn.Module):
    """One expert: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(hidden, ffn, bias=False), nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class MoELM(nn.Module):
    """The benchmark model; ``layer(i)`` builds block i's MoE layer (returning a tensor, or DeepSpeed's tuple)."""

    def __init__(self, cfg: dict[str, Any], layer: Any) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg["vocab"], cfg["hidden"])
        self.norms = nn.ModuleList(nn.LayerNorm(cfg["hidden"]) for _ in range(cfg["layers"]))
        self.blocks = nn.ModuleList(layer(i) for i in range(cfg["layers"]))
        self.out_norm, self.head = nn.LayerNorm(cfg["hidden"]), nn.Linear(cfg["hidden"], cfg["vocab"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, aux = self.embed(x), 0.0
        for norm, block in zip(self.norms, self.blocks):
            out = block(norm(h))
            if isinstance(out, tuple):  # DeepSpeed's (output, l_aux, exp_counts)
                out, aux = out[0], aux + out[1]
            h = h + out
        return self.head(self.out_norm(h)), aux


def _ours_layer(cfg: dict[str, Any], row: str) -> Any:
    from lightning_zero.moe import GroupedKernel, GroupedMLPExperts, MoE, MoELayer, RoutingPolicy, TopKGate

    if row == "zero2_ep_ds_layer":
        return lambda i: MoE(cfg["hidden"], SwiGLU(cfg["hidden"], cfg["ffn"]), cfg["experts"], k=2,
                             capacity_factor=1.25, use_rts=False, top2_2nd_expert_sampling=False)
    kernel = GroupedKernel.LOOP if row.endswith("loop") else GroupedKernel.AUTO

    def build(i: int) -> nn.Module:
        experts = GroupedMLPExperts(cfg["experts"], cfg["hidden"], cfg["ffn"], "silu", gated=True, kernel=kernel)
        return MoELayer(TopKGate(cfg["hidden"], RoutingPolicy(cfg["experts"], 2, None)), experts, cfg["experts"])

    return build


# ---------------------------------------------------------------------------------------------- bytes sent
def _arg(args: tuple, kwargs: dict[str, Any], position: int, *names: str) -> Any:
    """A call's argument by position or by one of its keyword names (DeepSpeed passes keywords)."""
    for name in names:
        if name in kwargs:
            return kwargs[name]
    return args[position] if len(args) > position else None


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else sum(_nbytes(x) for x in t)


class BytesSent:
    """Wraps ``torch.distributed``'s collectives (and torchtitan's functional all-to-all) to count the bytes this
    rank sends, by the ring model of the module docstring; ``all_to_all`` keeps the all-to-alls' share."""

    def __init__(self) -> None:
        self.total = 0.0
        self.all_to_all = 0.0
        self._saved: list[tuple[Any, str, Any]] = []

    def _wrap(self, owner: Any, name: str, count: Any) -> None:
        original = getattr(owner, name, None)
        if original is None:
            return

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            sent, a2a = count(args, kwargs)
            self.total += sent
            self.all_to_all += a2a
            return original(*args, **kwargs)

        self._saved.append((owner, name, original))
        setattr(owner, name, wrapped)

    def __enter__(self) -> BytesSent:
        def ring(hops: float, position: int, tensor_at: int = 0) -> Any:
            names = ("input_tensor", "input") if tensor_at else ("tensor", "output_tensor", "output")

            def count(args: tuple, kwargs: dict[str, Any]) -> tuple[float, float]:
                n = dist.get_world_size(_arg(args, kwargs, position, "group"))
                return _nbytes(_arg(args, kwargs, tensor_at, *names)) * hops * (n - 1) / n if n > 1 else 0.0, 0.0
            return count

        def a2a(args: tuple, kwargs: dict[str, Any]) -> tuple[float, float]:
            inp = _arg(args, kwargs, 1, "input")
            splits = _arg(args, kwargs, 3, "input_split_sizes")
            group = _arg(args, kwargs, 4, "group")
            n, rank = dist.get_world_size(group), dist.get_rank(group)
            row = inp[0].numel() * inp.element_size() if inp.dim() > 1 and inp.shape[0] else inp.element_size()
            own = (splits[rank] if splits else inp.shape[0] // n) * row
            return float(_nbytes(inp) - own), float(_nbytes(inp) - own)

        for name, count in (("all_reduce", ring(2, 2)), ("broadcast", ring(1, 2)), ("all_to_all_single", a2a),
                            ("all_gather_into_tensor", ring(1, 2)), ("all_gather_single", ring(1, 2)),
                            ("reduce_scatter_tensor", ring(1, 2, 1)), ("reduce_scatter_single", ring(1, 2, 1))):
            self._wrap(dist, name, count)
        self._wrap(dist, "isend", lambda args, kwargs: (float(_nbytes(_arg(args, kwargs, 0, "tensor"))), 0.0))
        self._wrap(dist, "send", lambda args, kwargs: (float(_nbytes(_arg(args, kwargs, 0, "tensor"))), 0.0))
        try:
            from torchtitan.models.common import token_dispatcher  # the peer pool's interpreter has it

            def functional(args: tuple, kwargs: dict[str, Any]) -> tuple[float, float]:
                inp, splits, group = args[0], args[2], kwargs.get("group", args[3] if len(args) > 3 else None)
                n = group.size() if hasattr(group, "size") else dist.get_world_size()
                rank = group.get_local_rank() if hasattr(group, "get_local_rank") else dist.get_rank()
                row = _nbytes(inp) // max(inp.shape[0], 1)
                own = (splits[rank] if splits else inp.shape[0] // n) * row
                return float(_nbytes(inp) - own), float(_nbytes(inp) - own)

            self._wrap(token_dispatcher, "all_to_all_single", functional)
        except ImportError:
            pass
        return self

    def __exit__(self, *exc: Any) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)


# ---------------------------------------------------------------------------------------------- one row
def _batches(cfg: dict[str, Any], rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 + rank)
    n = cfg["warmup"] + cfg["steps"]
    tokens = torch.randint(0, cfg["vocab"], (n, cfg["batch"], cfg["seq"] + 1), generator=g)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], vocab: int) -> torch.Tensor:
    logits, aux = model(batch[0])
    return nn.functional.cross_entropy(logits.reshape(-1, vocab), batch[1].reshape(-1)) + 0.01 * aux


def _ours(row: str, cfg: dict[str, Any]) -> tuple[Any, Any, Any]:
    """(model, step(batch), stats()) of a ZeroEngine row."""
    from lightning_zero.core.mesh import ParallelDims
    from lightning_zero.core.settings.zero import ZeroConfig
    from lightning_zero.core.zero.engine import ZeroEngine
    from lightning_zero.parallel.expert import apply_expert_parallel
    from lightning_zero.parallel.mesh import build_mesh

    world, ep = dist.get_world_size(), dist.get_world_size() if "ep" in row else 1
    zero = ZeroConfig(stage=int(row[4]), param_persistence_threshold=0,
                      unit_classes=(type(_ours_layer(cfg, row)(0)),))
    made = build_mesh(ParallelDims(world, expert=ep), dist.get_rank(), zero)
    torch.manual_seed(0)
    model = MoELM(cfg, _ours_layer(cfg, row))
    expert = apply_expert_parallel(model, made.mesh)
    experts = expert.experts if expert is not None else frozenset()
    expert_names = {n for n, _ in model.named_parameters() if ".experts." in n or n.endswith("_proj")}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = ZeroEngine(model, opt, zero, made.comm, experts=experts)

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        engine.before_backward()
        loss = _loss(model, batch, cfg["vocab"])
        loss.backward()
        engine.finish_backward()
        engine.before_step()
        engine.prepare_step()
        opt.step()
        engine.after_step()
        return float(loss)

    def expert_gathered() -> float:
        total = 0.0
        for unit in engine.units:
            elements = sum(s.numel for g in unit.groups for s in g.slots
                           if g.experts or engine.names[s.param] in expert_names)
            total += elements * 4 * unit.gathers
        return total

    return model, step, expert_gathered


def _deepspeed(cfg: dict[str, Any]) -> tuple[Any, Any, Any]:
    import deepspeed
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    world = dist.get_world_size()
    torch.manual_seed(0)
    model = MoELM(cfg, lambda i: DeepSpeedMoE(cfg["hidden"], SwiGLU(cfg["hidden"], cfg["ffn"]), cfg["experts"],
                                              ep_size=world, k=2, capacity_factor=1.25, use_rts=False,
                                              top2_2nd_expert_sampling=False))
    params = {"params": list(model.parameters()), "name": "params"}
    groups = deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer(params)
    opt = torch.optim.AdamW(groups, lr=1e-3)
    config = {"train_micro_batch_size_per_gpu": cfg["batch"], "zero_optimization": {"stage": 2},
              "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config, dist_init_required=False)

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        loss = _loss(engine, batch, cfg["vocab"])
        engine.backward(loss)
        engine.step()
        return float(loss)

    return model, step, lambda: 0.0


def _titan(cfg: dict[str, Any]) -> tuple[Any, Any, Any]:
    """torchtitan's MoE (router, all-to-all dispatcher, grouped SwiGLU experts), experts split over every rank. Its
    EP dispatch runs on gloo through the functional ``all_to_all_single`` (the non-``spmd_types`` backend: the
    ``spmd_types`` one calls the list ``all_to_all``, which gloo refuses for uneven splits); data parallelism is
    one flat all-reduce of the dense gradients, the experts' divided by the world (their tokens came from every
    rank)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.distributed.utils import set_spmd_backend
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.moe import GroupedExperts, MoE, RoutedExperts, TokenChoiceTopKRouter
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

    set_spmd_backend("dtensor")
    world, e, h = dist.get_world_size(), cfg["experts"], cfg["hidden"]
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))

    def layer(i: int) -> nn.Module:
        experts = GroupedExperts.Config(dim=h, hidden_dim=cfg["ffn"], num_experts=e // world)
        routed = RoutedExperts.Config(inner_experts=experts,
                                      token_dispatcher=AllToAllTokenDispatcher.Config(num_experts=e, top_k=2))
        router = TokenChoiceTopKRouter.Config(num_experts=e, gate=Linear.Config(in_features=h, out_features=e,
                                                                                bias=False),
                                              top_k=2, score_func="softmax", route_norm=True)
        moe = MoE.Config(num_experts=e, routed_experts=routed, router=router, load_balance_coeff=None).build()
        for p in moe.parameters():
            nn.init.normal_(p, std=0.02)
        moe.routed_experts.token_dispatcher.wire_meshes(ep_mesh=mesh)
        return moe

    torch.manual_seed(0)
    model = MoELM(cfg, layer)
    experts = [p for n, p in model.named_parameters() if "inner_experts" in n]
    dense = [p for n, p in model.named_parameters() if "inner_experts" not in n]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        loss = _loss(model, batch, cfg["vocab"])
        loss.backward()
        flat = torch.cat([p.grad.reshape(-1) for p in dense])
        dist.all_reduce(flat)
        flat /= world
        for p, g in zip(dense, flat.split([p.numel() for p in dense])):
            p.grad.copy_(g.view_as(p))
        for p in experts:
            p.grad /= world
        opt.step()
        opt.zero_grad()
        return float(loss)

    return model, step, lambda: 0.0


def run_row(row: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """One row's warm-up and timed steps on this rank: median step seconds (the slowest rank's), bytes sent per
    step (all, all-to-all), the experts' gathered bytes per step, the all-to-all formula, the last loss."""
    rank = dist.get_rank()
    batches = _batches(cfg, rank)
    if row in OURS:
        _, step, gathered = _ours(row, cfg)
    elif row == "deepspeed_zero2_ep":
        _, step, gathered = _deepspeed(cfg)
    else:
        _, step, gathered = _titan(cfg)
    times, sent, a2a, experts, losses = [], [], [], [], []
    with BytesSent() as counter:
        for i, batch in enumerate(batches):
            dist.barrier()
            before = (counter.total, counter.all_to_all, gathered())
            t = time.perf_counter()
            losses.append(step(batch))
            after = (counter.total, counter.all_to_all, gathered())
            dist.barrier()
            seconds = time.perf_counter() - t
            if i >= cfg["warmup"]:
                times.append(seconds)
                sent.append(after[0] - before[0])
                a2a.append(after[1] - before[1])
                experts.append(after[2] - before[2])
    slowest = torch.tensor([statistics.median(times)])
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    world = dist.get_world_size()
    tokens = cfg["batch"] * cfg["seq"]
    formula = 4 * tokens * 2 * (world - 1) / world * cfg["hidden"] * 4 * cfg["layers"] if "ep" in row else 0.0
    return {"step_s": float(slowest), "bytes": statistics.median(sent), "a2a": statistics.median(a2a),
            "a2a_formula": formula, "experts_gathered": statistics.median(experts), "loss": losses[-1]}


# ---------------------------------------------------------------------------------------------- the kernels
def kernel_table(rounds: int, hidden: int, ffn: int) -> list[str]:
    """One SwiGLU expert MLP's forward and backward on rows sorted by expert (``expert_mlp``), each grouped-product
    implementation against the loop, in this process on one thread, timed in CPU seconds (what load on other cores
    does not change): median of ``rounds`` interleaved rounds of 3 calls each."""
    from lightning_zero.moe.grouped import GroupedKernel, activation, expert_mlp

    torch.set_num_threads(1)
    out = ["| experts | rows | counts | grouped_mm (ms) | padded_bmm (ms) | loop (ms) | loop / grouped_mm |",
           "|---:|---:|---|---:|---:|---:|---:|"]
    g = torch.Generator().manual_seed(0)
    for experts, rows, skew in ((8, 2048, False), (32, 2048, False), (32, 2048, True)):
        weights = torch.rand(experts, generator=g) ** (4 if skew else 0)
        counts = torch.distributions.Multinomial(rows, weights / weights.sum()).sample().long().tolist()
        x = torch.randn(rows, hidden, requires_grad=True)
        up = torch.randn(experts, 2 * ffn, hidden, requires_grad=True)
        down = torch.randn(experts, hidden, ffn, requires_grad=True)
        times: dict[GroupedKernel, list[float]] = {k: [] for k in (GroupedKernel.GROUPED_MM,
                                                                    GroupedKernel.PADDED_BMM, GroupedKernel.LOOP)}
        for _ in range(rounds):
            for kernel, seen in times.items():
                t = time.process_time()
                for _ in range(3):
                    expert_mlp(x, counts, up, down, activation("silu"), True, kernel=kernel).sum().backward()
                seen.append((time.process_time() - t) / 3 * 1000)
        med = {k: statistics.median(v) for k, v in times.items()}
        spread = f"{min(counts)}..{max(counts)}"
        out.append(f"| {experts} | {rows} | {spread} | {med[GroupedKernel.GROUPED_MM]:.1f} | "
                   f"{med[GroupedKernel.PADDED_BMM]:.1f} | {med[GroupedKernel.LOOP]:.1f} | "
                   f"{med[GroupedKernel.LOOP] / med[GroupedKernel.GROUPED_MM]:.2f}x |")
    return out


# ---------------------------------------------------------------------------------------------- the run
def _table(results: dict[str, list[dict[str, Any]]], cfg: dict[str, Any]) -> list[str]:
    """The markdown table: medians over rounds of rank 0's numbers (step time: the slowest rank's)."""
    base = statistics.median(r["step_s"] for r in results["zero3"]) if results.get("zero3") else None
    out = ["| row | step (s) | vs zero3 | bytes sent / step | all-to-all / step | formula | experts gathered / step "
           "| loss | per round: step (s) |", "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for row, runs in results.items():
        if not runs:
            continue
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        ratio = f"{med['step_s'] / base:.2f}x" if base else "-"
        mb = lambda v: f"{v / 2**20:.2f} MiB" if v else "-"  # noqa: E731
        rounds = ", ".join(f"{r['step_s']:.3f}" for r in runs)
        out.append(f"| {row} | {med['step_s']:.3f} | {ratio} | {mb(med['bytes'])} | {mb(med['a2a'])} | "
                   f"{mb(med['a2a_formula'])} | {mb(med['experts_gathered'])} | {med['loss']:.4f} | {rounds} |")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = p.add_argument
    add("--world-size", type=int, default=2)
    add("--layers", type=int, default=4)
    add("--hidden", type=int, default=128)
    add("--ffn", type=int, default=256)
    add("--experts", type=int, default=8)
    add("--vocab", type=int, default=256)
    add("--batch", type=int, default=8)
    add("--seq", type=int, default=128)
    add("--steps", type=int, default=5)
    add("--warmup", type=int, default=2)
    add("--rounds", type=int, default=3)
    add("--rows", default=",".join(OURS + PEERS))
    add("--kernels-only", action="store_true", help="only the grouped-product table (one process, CPU time)")
    add("--deepspeed-python", default=None, help="an interpreter with deepspeed 0.19.8 and torchtitan 0.3.0 (and "
        "triton, which torchtitan's MoE imports) for the peer rows; without it they are skipped")
    args = p.parse_args()
    cfg = {k: getattr(args, k) for k in ("layers", "hidden", "ffn", "experts", "vocab", "batch", "seq", "steps",
                                        "warmup")}
    print("\n".join(kernel_table(max(args.rounds, 3), args.hidden, args.ffn)))
    if args.kernels_only:
        return
    rows = args.rows.split(",")
    start_load = Path("/proc/loadavg").read_text().split()[0] if Path("/proc/loadavg").exists() else "?"
    pools = {"ours": GlooPool(args.world_size, threads=1)}
    if args.deepspeed_python and any(r in PEERS for r in rows):
        pools["peers"] = GlooPool(args.world_size, threads=1, python=args.deepspeed_python,
                                  env={"DS_ACCELERATOR": "cpu"}, release_groups=False)
    results: dict[str, list[dict[str, Any]]] = {r: [] for r in rows}
    skipped: dict[str, str] = {}
    try:
        for _ in range(args.rounds):  # interleaved: every row once per round
            for row in rows:
                pool = pools.get("peers" if row in PEERS else "ours")
                if pool is None:
                    skipped[row] = "no --deepspeed-python"
                    continue
                results[row].append(pool.run(TASK, row=row, cfg=cfg, _timeout_s=900)[0])
    finally:
        for pool in pools.values():
            pool.close()
    load = Path("/proc/loadavg").read_text().split()[0] if Path("/proc/loadavg").exists() else "?"
    print(f"load average at the end: {load} (at the start: {start_load})")
    print(f"MoE LM: {cfg['layers']} layers x {cfg['experts']} SwiGLU experts ({cfg['hidden']} -> {cfg['ffn']}), "
          f"top-2, {cfg['batch']} x {cfg['seq']} tokens per rank, {args.world_size} ranks, AdamW, fp32; "
          f"{args.rounds} rounds x {cfg['steps']} steps (+{cfg['warmup']} warm-up), medians")
    print("\n".join(_table(results, cfg)))
    for row, why in skipped.items():
        print(f"{row}: skipped ({why})")


if __name__ == "__main__":
    main()
