"""Bitwise parity of a fixed set of runs across two versions of the code: a reorganisation moves no number.

Each case fits a tiny model for a few steps on the warm gloo pool and records every rank's losses (as
``float.hex``) and the SHA-256 of its final parameters' bytes. ``--record FILE`` writes them; ``--compare FILE``
runs the same cases and reports each that differs in a single bit. The cases cover ZeRO stages 0-3, mixed
precision, offload (host and swap files), tensor, sequence and pipeline parallelism, and pipeline x tensor on 4
ranks. Run it from the root of each checkout (``python benchmarks/bitwise_parity.py --record before.json`` at the
base commit, ``--compare before.json`` at the new one); it also prints each case's CPU seconds per rank.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# name -> (ranks, body keyword arguments)
CASES: dict[str, tuple[int, dict[str, Any]]] = {
    **{f"stage{s}": (2, {"model": "tiny", "stage": s}) for s in (0, 1, 2, 3)},
    "stage2_bf16": (2, {"model": "tiny", "stage": 2, "precision": "bf16-mixed"}),
    "stage1_fp16": (2, {"model": "tiny", "stage": 1, "precision": "16-mixed"}),
    "stage2_offload_cpu": (2, {"model": "tiny", "stage": 2, "offload_optimizer": "cpu"}),
    "stage3_offload_param_cpu": (2, {"model": "tiny", "stage": 3, "offload_param": "cpu"}),
    "stage2_offload_nvme": (2, {"model": "tiny", "stage": 2, "offload_optimizer": "nvme"}),
    "tp2_stage1": (2, {"model": "gpt", "stage": 1, "tensor_parallel": 2}),
    "tp2_stage3": (2, {"model": "gpt", "stage": 3, "tensor_parallel": 2}),
    "sp2_stage0": (2, {"model": "gpt_sp", "stage": 0, "sequence_parallel": 2}),
    "sp2_stage3": (2, {"model": "gpt_sp", "stage": 3, "sequence_parallel": 2}),
    "pp2_stage1": (2, {"model": "pipe", "stage": 1, "pipeline": 2}),
    "pp2_stage2": (2, {"model": "pipe", "stage": 2, "pipeline": 2}),
    "pp2_tp2_stage1": (4, {"model": "pipe_gpt", "stage": 1, "pipeline": 2, "tensor_parallel": 2}),
}


def _digest(module: Any) -> str:
    h = hashlib.sha256()
    for name, p in sorted(module.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().view(-1).view(dtype=__import__("torch").uint8).numpy().tobytes())
    return h.hexdigest()


def fit_body(model: str, stage: int, precision: str | None = None, tensor_parallel: int = 1,
             sequence_parallel: int = 1, pipeline: int = 1, steps: int = 4, **offload: str) -> dict[str, Any]:
    """One fit on this rank: its losses and the digest of its final parameters, and the CPU seconds it took."""
    import lightning.pytorch as pl
    import torch
    import torch.distributed as dist

    from lightning_zero import PipelineConfig, ZeroStrategy
    from tests.models import make_trainer

    class Losses(pl.Callback):
        def __init__(self) -> None:
            self.losses: list[str] = []

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, idx: int) -> None:
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            self.losses.append("none" if loss is None else float(loss).hex())

    kwargs: dict[str, Any] = {}
    trainer_kwargs: dict[str, Any] = {"max_steps": steps, "gradient_clip_val": 0.05}
    if model == "tiny":
        from tests.models import TinyTransformer, token_loader

        module, data = TinyTransformer("adamw"), token_loader()
        kwargs["reduce_bucket_size"] = 100
        trainer_kwargs["accumulate_grad_batches"] = 2
    elif model in ("gpt", "pipe_gpt"):
        from tests.distributed.test_tensor_parallel import MODELS, _loader

        torch.manual_seed(0)
        module, data = MODELS["gpt"](), _loader(1)
        kwargs.update(param_persistence_threshold=0, reduce_bucket_size=500)
        trainer_kwargs.update(accumulate_grad_batches=2, use_distributed_sampler=True)
    elif model == "gpt_sp":
        from tests.e2e.test_sequence_parallel import _module, _samples

        module, data = _module(False), torch.utils.data.DataLoader(_samples(), batch_size=4)
        trainer_kwargs.update(use_distributed_sampler=True, gradient_clip_val=None)
    else:
        from tests.pipeline_models import PipeLM, loader

        module, data = PipeLM("adamw"), loader(8)
    if pipeline > 1:
        kwargs["pipeline"] = PipelineConfig(stages=pipeline, micro_batches=4, schedule="1f1b",
                                            partition_method="uniform")
        trainer_kwargs.pop("accumulate_grad_batches", None)
    if precision is not None:
        kwargs["precision"] = precision
    if tensor_parallel > 1:
        kwargs["tensor_parallel"] = tensor_parallel
    if sequence_parallel > 1:
        kwargs["sequence_parallel"] = sequence_parallel
    scratch = None
    if "nvme" in offload.values():
        scratch = tempfile.mkdtemp(prefix="bitwise-parity-")
        kwargs["nvme_path"] = scratch
    losses = Losses()
    os.environ["PL_GLOBAL_SEED"] = "0"
    trainer = make_trainer(ZeroStrategy(stage=stage, **kwargs, **offload), devices=dist.get_world_size(),
                           callbacks=[losses], **trainer_kwargs)
    began = time.process_time()
    trainer.fit(module, data)
    cpu = time.process_time() - began
    if scratch is not None:
        import shutil

        shutil.rmtree(scratch, ignore_errors=True)
    return {"losses": losses.losses, "params": _digest(module), "cpu_s": cpu}


def run_cases(names: list[str]) -> dict[str, Any]:
    from lightning_zero.testing.pool import GlooPool

    out: dict[str, Any] = {}
    pools: dict[int, GlooPool] = {}
    try:
        for name in names:
            ranks, kwargs = CASES[name]
            pool = pools.get(ranks) or pools.setdefault(ranks, GlooPool(world_size=ranks, timeout_s=600))
            results = pool.run("benchmarks.bitwise_parity:fit_body", **kwargs)
            out[name] = results
            cpu = ", ".join(f"{r['cpu_s']:.2f}" for r in results)
            print(f"{name}: {len(results[0]['losses'])} losses, cpu s/rank {cpu}", flush=True)
    finally:
        for pool in pools.values():
            pool.close()
    return out


def cpu_per_step(names: list[str], steps: int, rounds: int) -> dict[str, list[float]]:
    """Each case's CPU seconds per optimizer step and rank: a fit of ``4 + steps`` steps less one of 4 (its setup
    and first steps cancel), ``rounds`` times; the median is printed."""
    from lightning_zero.testing.pool import GlooPool

    out: dict[str, list[float]] = {name: [] for name in names}
    pools: dict[int, GlooPool] = {}
    try:
        for _ in range(rounds):
            for name in names:
                ranks, kwargs = CASES[name]
                pool = pools.get(ranks) or pools.setdefault(ranks, GlooPool(world_size=ranks, timeout_s=600))
                short = pool.run("benchmarks.bitwise_parity:fit_body", **kwargs)
                long = pool.run("benchmarks.bitwise_parity:fit_body", **kwargs, steps=4 + steps)
                out[name].append(sum(b["cpu_s"] - a["cpu_s"] for a, b in zip(short, long)) / len(long) / steps)
    finally:
        for pool in pools.values():
            pool.close()
    for name, values in out.items():
        print(f"{name}: cpu ms per step and rank, median of {rounds}: {1e3 * sorted(values)[len(values) // 2]:.1f} "
              f"({', '.join(f'{1e3 * v:.1f}' for v in values)})", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--record", type=Path, help="write the cases' losses and parameter digests here")
    what.add_argument("--compare", type=Path, help="compare with a recorded file; exit 1 on any difference")
    what.add_argument("--cpu-steps", type=int, help="CPU time per step of each case over this many extra steps")
    parser.add_argument("--rounds", type=int, default=3, help="--cpu-steps: repetitions (the median is printed)")
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    args = parser.parse_args(argv)
    if args.cpu_steps is not None:
        cpu_per_step(args.cases, args.cpu_steps, args.rounds)
        return 0
    got = run_cases(args.cases)
    if args.record is not None:
        args.record.write_text(json.dumps(got, indent=1) + "\n")
        return 0
    recorded = json.loads(args.compare.read_text())
    differ = []
    for name, ranks in got.items():
        before = recorded.get(name)
        if before is None:
            differ.append(f"{name}: not recorded")
            continue
        for rank, (a, b) in enumerate(zip(before, ranks, strict=True)):
            if a["losses"] != b["losses"] or a["params"] != b["params"]:
                differ.append(f"{name} rank {rank}: losses {a['losses'] == b['losses']}, "
                              f"params {a['params'] == b['params']}")
        cpu_a = sum(r["cpu_s"] for r in before) / len(before)
        cpu_b = sum(r["cpu_s"] for r in ranks) / len(ranks)
        print(f"{name}: bitwise {'equal' if not any(d.startswith(name) for d in differ) else 'DIFFERENT'}; "
              f"cpu s/rank {cpu_a:.2f} -> {cpu_b:.2f}")
    print("\n".join(differ) if differ else "every case bitwise equal")
    return 1 if differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
