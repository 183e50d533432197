"""Optimizer offload benchmarks: memory relief, step time, CPU optimizer speed and swap throughput.

Three parts, each printing a markdown table (docs/benchmarks.md holds a run's output):

* ``memory``: a GPT trained by ``ZeroEngine`` on ``--world-size`` gloo ranks (fresh processes per
  mode, modes interleaved over ``--rounds``): peak RSS per rank and step time without offload,
  with ``offload_optimizer="cpu"`` / ``"nvme"`` and (``--stage 3``) ``param_cpu`` / ``param_nvme``
  (parameter shards too); the drop of the training peak (VmHWM reset after setup) is compared
  with the bytes offloaded (the rank's AdamW moments, plus its parameter shard for ``param_*``).
* ``optimizer``: AdamW steps on one fp32 shard of ``--numel`` elements: torch's fused CPU kernel
  (what offload uses), torch's foreach, and DeepSpeed's ``DeepSpeedCPUAdam`` when DeepSpeed can be
  imported (an optional peer, never a dependency: run this script with an interpreter that has it).
* ``disk``: raw sequential write (+ fsync) and cold read of a file, beside the swap files' write-out
  and cold read-in of the same bytes (Note [swap files] in core/offload/file_store.py), interleaved.

    python benchmarks/bench_offload.py memory --model gpt_125m --rounds 3
    python benchmarks/bench_offload.py memory --model gpt_125m --stage 3 --modes none,param_nvme
    python benchmarks/bench_offload.py optimizer --numel 16777216 --rounds 5
    python benchmarks/bench_offload.py disk --mib 512 --rounds 3 --dir /tmp
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_zero.core.common.choices import ZeroStage
from lightning_zero.core.offload.host_store import return_freed_memory
from lightning_zero.core.offload.swap_file import SwapFile
from lightning_zero.core.settings.offload import OffloadConfig

MODES = ("none", "cpu", "nvme")


# ------------------------------------------------------------------------------------------------ memory
def _status(*keys: str) -> dict[str, int]:
    """Fields of /proc/self/status in bytes (VmHWM: peak RSS; RssAnon / RssFile: anonymous / file-backed RSS)."""
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return {k: int(fields[k].split()[0]) * 1024 for k in keys}


def _offload(mode: str, args: argparse.Namespace) -> OffloadConfig | None:
    """``none``, ``cpu`` / ``nvme`` (optimizer offload), ``param_cpu`` / ``param_nvme`` (stage 3: parameters too)."""
    if mode == "none":
        return None
    where = mode.removeprefix("param_")
    return OffloadConfig(optimizer_device=where, param_device=where if mode.startswith("param_") else "none",
                         nvme_path=args.dir, sub_group_size=args.sub_group)


def _rank(rank: int, world: int, store: str, args: argparse.Namespace, mode: str, queue) -> None:
    import torch.distributed as dist

    from lightning_zero import ZeroConfig, ZeroEngine
    from lightning_zero.core.comm.data_parallel import DataParallelComm
    from lightning_zero.models.gpt import GPT, resolve_config

    torch.set_num_threads(1)
    if args.same_allocator:  # what "nvme" offload sets (Note [freed memory]), in every mode: the drop is the offload's
        return_freed_memory()
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = GPT(resolve_config(args.model, {"seq_len": args.seq_len}))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)  # the same kernel in every mode
    stage = ZeroStage.of(args.stage)
    config = ZeroConfig(stage=stage, **({"param_persistence_threshold": 0} if stage.shards_parameters else {}))
    engine = ZeroEngine(model, optimizer, config, DataParallelComm(dist.group.WORLD), offload=_offload(mode, args))
    state_bytes = 8 * sum(g.shard_numel for g in engine.groups)  # AdamW's two fp32 moments of this rank's shard
    shard_bytes = sum(g.shard_numel * g.flat.element_size() for u in engine.units if not u.persistent
                      for g in u.groups)  # stage 3: this rank's parameter shards
    setup_peak = _status("VmHWM")["VmHWM"]
    with open("/proc/self/clear_refs", "w") as f:  # reset VmHWM: the peak of training alone from here
        f.write("5")
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
    end = _status("VmHWM", "RssAnon", "RssFile")
    offload = engine.sharded.offload
    io = 0
    if offload is not None:
        io = offload.counters.bytes_read + offload.counters.bytes_written
        if offload.params is not None:
            io += offload.params.counters.bytes_in + offload.params.counters.bytes_out
    io //= args.warmup + args.steps
    engine.detach(keep_optimizer_state=False)
    queue.put((rank, end["VmHWM"], statistics.median(times), state_bytes, io, setup_peak, shard_bytes,
               end["RssAnon"], end["RssFile"]))
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

    def field(mode: str, i: int) -> float:  # max over ranks of the median over rounds
        return max(statistics.median(r[rank][i] for r in runs[mode]) for rank in range(args.world_size))

    state, shard = runs["none"][0][0][3], runs["none"][0][0][6]
    base_time = statistics.median(statistics.median(x[2] for x in r) for r in runs["none"])
    print(f"\n{args.model}, stage {args.stage}, {args.world_size} ranks, AdamW state {state / 2**20:.0f} MiB per rank"
          f"{f', parameter shard {shard / 2**20:.0f} MiB per rank' if shard else ''}, sub_group_size "
          f"{args.sub_group}, micro-batch {args.micro_batch}x{args.seq_len}; median of {args.rounds} interleaved "
          "rounds. Training peak: VmHWM over the steps (reset after setup); offloaded: AdamW state, plus the "
          "parameter shard for param_* modes\n")
    print("| offload | peak RSS: setup | training | whole run | drop vs none (whole run) | drop / offloaded | "
          "training peak drop / offloaded | RssAnon / RssFile at end | step time | vs none | I/O per rank and step |")
    print("| :-- | --: | --: | --: | --: | --: | --: | --: | --: | --: | --: |")
    base_peak, base_train = max(field("none", 1), field("none", 5)), field("none", 1)
    for mode in modes:
        peak = max(field(mode, 1), field(mode, 5))
        step = statistics.median(statistics.median(x[2] for x in r) for r in runs[mode])
        moved = state + (shard if mode.startswith("param_") else 0)
        drop = base_peak - peak
        print(f"| {mode} | {field(mode, 5) / 2**20:.0f} MiB | {field(mode, 1) / 2**20:.0f} MiB | "
              f"{peak / 2**20:.0f} MiB | {drop / 2**20:.0f} MiB | "
              f"{100 * drop / moved:.0f}% of {moved / 2**20:.0f} MiB | "
              f"{100 * (base_train - field(mode, 1)) / moved:.0f}% | {field(mode, 7) / 2**20:.0f} / "
              f"{field(mode, 8) / 2**20:.0f} MiB | {step:.2f} s | {step / base_time:.2f}x | "
              f"{statistics.median(r[0][4] for r in runs[mode]) / 2**20:.0f} MiB |")


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
    parser.add_argument("--default-allocator", dest="same_allocator", action="store_false",
                        help="memory: leave glibc's dynamic mmap threshold in the modes without nvme offload")
    parser.add_argument("--numel", type=int, default=1 << 24)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--mib", type=int, default=512)
    args = parser.parse_args()
    {"memory": memory, "optimizer": optimizer, "disk": disk}[args.part](args)


if __name__ == "__main__":
    main()
