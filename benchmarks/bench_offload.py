"""Optimizer offload benchmarks: memory relief, step time, CPU optimizer speed and swap throughput.

Three parts, each printing a markdown table (docs/benchmarks.md holds a run's output):

* ``memory``: a GPT trained by ``ZeroEngine`` on ``--world-size`` gloo ranks (fresh processes per
  mode, modes interleaved over ``--rounds``): peak RSS per rank and step time without offload,
  with ``offload_optimizer="cpu"`` and with ``"nvme"``; the peak RSS drop is compared with the
  rank's AdamW state bytes (the two moments of its shard).
* ``optimizer``: AdamW steps on one fp32 shard of ``--numel`` elements: torch's fused CPU kernel
  (what offload uses), torch's foreach, and DeepSpeed's ``DeepSpeedCPUAdam`` when DeepSpeed can be
  imported (an optional peer, never a dependency: run this script with an interpreter that has it).
* ``disk``: raw sequential write (+ fsync) and cold read of a file, beside the swap files' write-out
  and cold read-in of the same bytes (Note [swap files] in core/offload_store.py), interleaved.

    python benchmarks/bench_offload.py memory --model gpt_125m --rounds 3
    python benchmarks/bench_offload.py optimizer --numel 16777216 --rounds 5
    python benchmarks/bench_offload.py disk --mib 512 --rounds 3 --dir /tmp
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_zero.core.offload import OffloadConfig
from lightning_zero.core.offload_store import SwapFile

MODES = ("none", "cpu", "nvme")


# ------------------------------------------------------------------------------------------------ memory
def _rank(rank: int, world: int, store: str, args: argparse.Namespace, mode: str, queue) -> None:
    import torch.distributed as dist
    from experiments.gpt import GPT, resolve_config

    from lightning_zero import ZeroConfig, ZeroEngine
    from lightning_zero.core.comm import DataParallelComm

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = GPT(resolve_config(args.model, {"seq_len": args.seq_len}))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)  # the same kernel in every mode
    offload = None if mode == "none" else OffloadConfig(optimizer_device=mode, nvme_path=args.dir,
                                                        sub_group_size=args.sub_group)
    engine = ZeroEngine(model, optimizer, ZeroConfig(stage=args.stage), DataParallelComm(dist.group.WORLD),
                        offload=offload)
    state_bytes = 8 * sum(g.shard_numel for g in engine.groups)
    gen = torch.Generator().manual_seed(rank)
    times = []
    for step in range(args.warmup + args.steps):
        start = time.perf_counter()
        x = torch.randint(0, 256, (args.micro_batch, args.seq_len + 1), generator=gen)
        logits = model(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), x[:, 1:].reshape(-1))
        loss.backward()
        engine.finish_backward()
        engine.prepare_step()
        engine.clip_grad_norm_(1.0)
        optimizer.step()
        engine.after_step()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    counters = engine.sharded.offload.counters if engine.sharded.offload is not None else None
    io = (counters.bytes_read + counters.bytes_written) if counters is not None else 0
    engine.detach(keep_optimizer_state=False)
    queue.put((rank, peak, statistics.median(times), state_bytes, io))
    dist.destroy_process_group()


def _run_mode(args: argparse.Namespace, mode: str) -> list[tuple]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_rank, args=(r, args.world_size, f"{tmp}/store", args, mode, queue))
                 for r in range(args.world_size)]
        for p in procs:
            p.start()
        results = sorted(queue.get(timeout=3600) for _ in procs)
        for p in procs:
            p.join()
    return results


def memory(args: argparse.Namespace) -> None:
    modes = args.modes.split(",")
    runs: dict[str, list[list[tuple]]] = {m: [] for m in modes}
    for round_ in range(args.rounds):
        for mode in modes:
            runs[mode].append(_run_mode(args, mode))
            print(f"round {round_} {mode}: {runs[mode][-1]}", file=sys.stderr, flush=True)
    state = runs["none"][0][0][3]
    base_peak = max(statistics.median(r[rank][1] for r in runs["none"]) for rank in range(args.world_size))
    base_time = statistics.median(statistics.median(x[2] for x in r) for r in runs["none"])
    print(f"\n{args.model}, stage {args.stage}, {args.world_size} ranks, AdamW state {state / 2**20:.0f} MiB per rank, "
          f"sub_group_size {args.sub_group}, micro-batch {args.micro_batch}x{args.seq_len}; "
          f"median of {args.rounds} interleaved rounds\n")
    print("| offload | peak RSS per rank (max over ranks) | drop vs none | drop / AdamW state | step time | vs none "
          "| swap I/O per rank |")
    print("| :-- | --: | --: | --: | --: | --: | --: |")
    for mode in modes:
        peak = max(statistics.median(r[rank][1] for r in runs[mode]) for rank in range(args.world_size))
        step = statistics.median(statistics.median(x[2] for x in r) for r in runs[mode])
        io = statistics.median(r[0][4] for r in runs[mode])
        drop = base_peak - peak
        print(f"| {mode} | {peak / 2**20:.0f} MiB | {drop / 2**20:.0f} MiB | {100 * drop / state:.0f}% | {step:.2f} s "
              f"| {step / base_time:.2f}x | {io / 2**20:.0f} MiB |")


# ------------------------------------------------------------------------------------------------ optimizer
def optimizer(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    contenders = {}
    for name, kwargs in (("torch AdamW fused (offload)", {"fused": True}), ("torch AdamW foreach", {"foreach": True})):
        p = torch.nn.Parameter(torch.randn(args.numel, generator=gen))
        contenders[name] = (p, torch.optim.AdamW([p], lr=1e-3, **kwargs))
    try:
        start = time.perf_counter()
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        p = torch.nn.Parameter(torch.randn(args.numel, generator=gen))
        contenders["DeepSpeedCPUAdam (0.19.8)"] = (p, DeepSpeedCPUAdam([p], lr=1e-3, adamw_mode=True))
        print(f"DeepSpeedCPUAdam import + first build/load: {time.perf_counter() - start:.1f} s", file=sys.stderr)
    except Exception as err:
        print(f"DeepSpeedCPUAdam unavailable: {type(err).__name__}: {err}", file=sys.stderr)
    grad = torch.randn(args.numel, generator=gen)
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(args.rounds):
        for name, (p, opt) in contenders.items():
            p.grad = grad
            opt.step()  # warm-up of this round
            start = time.perf_counter()
            for _ in range(args.steps):
                opt.step()
            times[name].append((time.perf_counter() - start) / args.steps)
    print(f"\nAdamW step on one fp32 shard of {args.numel:,} elements, {args.threads} thread(s); median of "
          f"{args.rounds} interleaved rounds of {args.steps} steps\n")
    print("| optimizer | step time | elements/s |")
    print("| :-- | --: | --: |")
    for name, ts in times.items():
        t = statistics.median(ts)
        print(f"| {name} | {1e3 * t:.1f} ms | {args.numel / t / 1e6:.0f} M |")


# ------------------------------------------------------------------------------------------------ disk
def _evict(fd: int) -> None:
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def _raw(directory: str, nbytes: int) -> tuple[float, float]:
    block = os.urandom(1 << 20) * 16  # 16 MiB writes
    fd, path = tempfile.mkstemp(dir=directory)
    os.unlink(path)
    try:
        start = time.perf_counter()
        for _ in range(nbytes // len(block)):
            os.write(fd, block)
        os.fsync(fd)
        write = time.perf_counter() - start
        _evict(fd)
        os.lseek(fd, 0, os.SEEK_SET)
        start = time.perf_counter()
        while os.read(fd, len(block)):
            pass
        return write, time.perf_counter() - start
    finally:
        os.close(fd)


def _swap(directory: str, nbytes: int, chunk: int) -> tuple[float, float]:
    numel = nbytes // 4
    file = SwapFile(directory, numel, torch.float32)
    data = torch.randn(chunk)
    scratch = bytearray(16 << 20)
    try:
        start = time.perf_counter()
        for lo in range(0, numel, chunk):  # as a step writes sub-groups out
            hi = min(lo + chunk, numel)
            file.tensor[lo:hi].copy_(data[: hi - lo])
            file.release(lo, hi)
        file.flush(0, numel)
        write = time.perf_counter() - start
        start = time.perf_counter()
        with ThreadPoolExecutor(1) as reader:  # as a step reads sub-groups in, the next one ahead
            ahead = reader.submit(file.prefetch, 0, min(chunk, numel), scratch)
            for lo in range(0, numel, chunk):
                hi = min(lo + chunk, numel)
                ahead.result()
                if hi < numel:
                    ahead = reader.submit(file.prefetch, hi, min(hi + chunk, numel), scratch)
                float(file.tensor[lo:hi].sum())
                file.release(lo, hi)
        return write, time.perf_counter() - start
    finally:
        file.close()


def disk(args: argparse.Namespace) -> None:
    nbytes = args.mib << 20
    results: dict[str, list[tuple[float, float]]] = {"raw sequential (os.write + fsync / os.read)": [],
                                                     "swap files (mmap, sub-groups)": []}
    for _ in range(args.rounds):
        results["raw sequential (os.write + fsync / os.read)"].append(_raw(args.dir, nbytes))
        results["swap files (mmap, sub-groups)"].append(_swap(args.dir, nbytes, args.sub_group))
    print(f"\n{args.mib} MiB under {args.dir}, cold reads (page cache dropped), sub-groups of {args.sub_group:,} "
          f"elements; median of {args.rounds} interleaved rounds\n")
    print("| path | write | read |")
    print("| :-- | --: | --: |")
    raw = None
    for name, rs in results.items():
        w = nbytes / statistics.median(r[0] for r in rs) / 2**20
        r = nbytes / statistics.median(x[1] for x in rs) / 2**20
        ratio = "" if raw is None else f" ({100 * w / raw[0]:.0f}% of raw)"
        ratio_r = "" if raw is None else f" ({100 * r / raw[1]:.0f}% of raw)"
        print(f"| {name} | {w:.0f} MiB/s{ratio} | {r:.0f} MiB/s{ratio_r} |")
        raw = raw or (w, r)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=["memory", "optimizer", "disk"])
    parser.add_argument("--model", default="gpt_125m")
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sub-group", type=int, default=1_000_000, help="sub_group_size in elements")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="nvme_path / the disk measured")
    parser.add_argument("--modes", default=",".join(MODES), help="memory: offload modes, 'none' first")
    parser.add_argument("--numel", type=int, default=1 << 24)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--mib", type=int, default=512)
    args = parser.parse_args()
    {"memory": memory, "optimizer": optimizer, "disk": disk}[args.part](args)


if __name__ == "__main__":
    main()
