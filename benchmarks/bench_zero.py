"""Step time and memory of ZeRO stages 0-3 against Lightning DDP and PyTorch FSDP2, on CPU processes over gloo.

Run from the repository root (see benchmarks/README.md)::

    python benchmarks/bench_zero.py --model gpt_20m --micro-batch 4 --seq-len 128 --steps 10 --repeats 3

This file is the command line; the parts are in ``benchmarks/harness/``: the contenders, registered in
one place (``contenders.py``: a Lightning strategy or a plain PyTorch loop each), what they train
(``training.py``), the step timer and probes (``recorder.py``, ``probes.py``), one run on one rank
(``run.py``) and the tables (``report.py``). Every contender trains the same GPT on the same per-rank
batches inside one long-lived pool of gloo processes (``lightning_zero.testing.pool.GlooPool``, the
test suite's pool), and the contenders are interleaved over ``--repeats`` so that drifts of a shared
machine hit all alike.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.harness.config import DEFAULT_CONTENDERS, BenchConfig, Runs  # noqa: E402
from benchmarks.harness.contenders import CONTENDERS  # noqa: E402
from benchmarks.harness.pools import Pools, find_deepspeed_python  # noqa: E402
from benchmarks.harness.report import comm_share, machine, report, summarize  # noqa: E402
from lightning_zero.core.settings.zero import ZeroConfig  # noqa: E402
from lightning_zero.models.gpt import GPT_PRESETS, count_parameters  # noqa: E402

__all__ = ["CONTENDERS", "BenchConfig", "comm_share", "main", "report", "summarize"]


# ------------------------------------------------------------------------------------------ command line
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Step time and memory of ZeRO stages vs Lightning DDP (CPU, gloo).")
    add = p.add_argument
    add("--model", default="gpt_20m", choices=sorted(GPT_PRESETS), help="GPT preset (lightning_zero/models/gpt.py)")
    add("--micro-batch", type=int, default=BenchConfig.micro_batch, help="sequences per rank per step")
    add("--seq-len", type=int, default=BenchConfig.seq_len, help="tokens per sequence")
    add("--steps", type=int, default=BenchConfig.steps, help="measured steps per run")
    add("--warmup", type=int, default=BenchConfig.warmup, help="steps run before measuring")
    add("--repeats", type=int, default=3, help="runs of every contender, interleaved")
    add("--contenders", default=DEFAULT_CONTENDERS, help="comma separated (see --list); ddp adds ddp_nosync")
    add("--bucket-size", type=int, default=BenchConfig.bucket_size, help="gradient bucket in elements, all rows")
    add("--prefetch-size", type=int, default=None, help="stage 3 prefetch_bucket_size (default: --bucket-size)")
    add("--persistence-threshold", type=int, default=BenchConfig.persistence_threshold,
        help="stage 3 param_persistence_threshold in elements (DeepSpeed's default 1e5)")
    add("--threads", type=int, default=1, help="torch threads per rank")
    add("--world-size", type=int, default=2, help="processes")
    add("--data", default="random", choices=["random", "stdlib"], help="random tokens or stdlib source text")
    add("--markdown", action="store_true", help="print markdown tables (for docs/benchmarks.md)")
    add("--profile", action="store_true", help="also time ZeroEngine internals (small overhead)")
    add("--json", type=Path, help="write the raw per-step measurements to this file")
    add("--timeout", type=float, default=1800.0, help="seconds one contender run may take")
    add("--deepspeed-python", default=None, help="interpreter with DeepSpeed for the ds_* contenders (default: "
        "this one if it imports deepspeed)")
    add("--list", action="store_true", help="list the registered contenders and exit")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        print("\n".join(f"{c.name:16} {c.kind:9} {c.description}" for c in CONTENDERS.values()))
        return 0
    names = list(dict.fromkeys(n.strip() for n in args.contenders.split(",") if n.strip()))
    if unknown := [n for n in names if n not in CONTENDERS]:
        raise SystemExit(f"unknown contender(s) {unknown}; registered: {sorted(CONTENDERS)}")
    if "ddp" in names and "ddp_nosync" not in names:  # the baseline of DDP's communication share
        names.insert(names.index("ddp") + 1, "ddp_nosync")
    config = BenchConfig(args.model, args.micro_batch, args.seq_len, args.steps, args.warmup, args.bucket_size,
                         args.threads, args.data, args.profile, args.prefetch_size,
                         args.persistence_threshold)  # fmt: skip
    started, load = time.strftime("%Y-%m-%d %H:%M %Z"), os.getloadavg()[0]
    runs: Runs = {n: [] for n in names}
    ds_python = None
    if any(CONTENDERS[n].pool == "deepspeed" for n in names):
        ds_python, why = find_deepspeed_python(args.deepspeed_python)
        if ds_python is None:
            raise SystemExit(f"cannot run the DeepSpeed contenders: {why}")
    pool = Pools(args.world_size, args.threads, args.timeout, ds_python)
    try:
        for repeat in range(args.repeats):
            for name in names:
                t = time.perf_counter()
                runs[name].append(pool.run(name, config))
                print(f"[repeat {repeat + 1}/{args.repeats}] {name}: {time.perf_counter() - t:.1f} s", file=sys.stderr)
    finally:
        pool.close()
    header = [
        f"Model: {config.model} ({count_parameters(config.model) / 1e6:.2f}M parameters), AdamW, fp32; micro-batch "
        f"{config.micro_batch} x seq {config.seq_len} per rank ({config.data} tokens), no gradient accumulation",
        f"Ranks: {args.world_size} CPU processes, gloo, {config.threads} torch thread(s) each; gradient buckets "
        f"{config.bucket_size:,} elements ({config.bucket_size * 4 / 2**20:.0f} MiB fp32) for every contender",
        f"Timing: {config.warmup} warm-up + {config.steps} measured steps per run, contenders interleaved over "
        f"{args.repeats} repeat(s); step = max over ranks of the median step, then median over repeats",
        f"Machine: {machine()}",
        f"Run: {started}; load average {load:.2f} at the start, {os.getloadavg()[0]:.2f} at the end (above "
        f"{args.world_size} means other processes competed for the cores)",
        "Memory: MB = 10^6 bytes per rank, sampled before the last optimizer step; ZeRO rows are "
        "ZeroStrategy.model_state_bytes(), the others are counted by hand (params + grads + AdamW state; comm_buffers "
        "= DDP's reducer buckets, a full gradient copy, sized from the parameters). Peak RSS = VmHWM per run, max "
        "over ranks: noisy (allocator caching, Lightning, imports).",
    ]  # fmt: skip
    if any(n.startswith("zero3") for n in names):
        header.append(f"Stage 3: prefetch_bucket_size {config.prefetch_size or config.bucket_size:,} elements, "
                      f"param_persistence_threshold {config.persistence_threshold:,}, max_live_parameters "
                      f"{ZeroConfig().max_live_parameters:,}; gathered units count as comm_buffers")  # fmt: skip
    if any(n.startswith("fsdp2") for n in names):
        header.append("FSDP2: torch.distributed.fsdp.fully_shard on every block, then the root, through Lightning's "
                      "ModelParallelStrategy (1-D data-parallel mesh, gloo), reshard_after_forward=True "
                      "(fsdp2_noreshard: False); memory counted from the DTensors' local shards (params, grads, AdamW "
                      "state), comm_buffers = unsharded parameters alive")  # fmt: skip
    print(report(summarize(runs, config.warmup), config, comm_share(runs, config.warmup), header, args.markdown))
    if args.json:
        given = sys.argv[1:] if argv is None else list(argv)
        args.json.write_text(json.dumps({"config": asdict(config), "argv": given, "runs": runs}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
