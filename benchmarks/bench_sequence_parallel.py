"""Sequence parallelism (DeepSpeed-Ulysses, issue 33): three measurements of the GPT experiment split over a
sequence group of P gloo ranks on this machine, each printed as a markdown table for docs/benchmarks.md:

* ``longest``: the longest sequence gpt_tiny's shape trains one step at, each rank under a fixed
  ``RLIMIT_DATA`` (as ``bench_sparse_attention.py longest``), at P = 1, 2, 4, dense and sparse attention,
  doubling the length until a run fails or passes the time cap;
* ``traffic``: the all-to-all bytes one rank sends per training step (counted at the call, what
  ``all_to_all_single`` really sends to other ranks) against the formula ``8 B T H (P - 1) / P^2`` elements
  per layer;
* ``step``: the step time (forward, backward, SGD) at P = 2 and 4 against the unsplit run at the same length.

Every configuration runs in fresh processes (P ranks, gloo over localhost, one torch thread each).

Run: python benchmarks/bench_sequence_parallel.py longest --limit-mb 192 --max-length 65536 --start 1024
     python benchmarks/bench_sequence_parallel.py traffic --length 4096
     python benchmarks/bench_sequence_parallel.py step --length 4096 --steps 5
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from lightning_zero.testing.memory import proc_status_bytes

BLOCK, LOCAL = 64, 16  # the sparse layout of bench_sparse_attention.py: fixed, windows of 16 blocks of 64


def _config(length: int, sparse: bool):
    from lightning_zero.models.gpt import GPT_PRESETS

    section = {"mode": "fixed", "block": BLOCK, "num_local_blocks": LOCAL, "attention": "unidirectional"}
    return replace(GPT_PRESETS["gpt_tiny"], seq_len=length, sparse_attention=section if sparse else None)


def _worker(kind: str, length: int, limit_mb: int, steps: int) -> dict[str, float]:
    """One rank: ``steps`` SGD steps of the GPT on one sample of ``length`` tokens, split over the world."""
    import resource
    from datetime import timedelta

    import torch.distributed as dist

    torch.set_num_threads(1)
    if limit_mb:
        _soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
        resource.setrlimit(resource.RLIMIT_DATA, (proc_status_bytes("VmData") + limit_mb * 2**20, hard))
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    try:
        return measure(kind, length, steps)
    finally:
        dist.destroy_process_group()


def measure(kind: str, length: int, steps: int) -> dict[str, float]:
    """One rank of an initialised process group (a worker's, or the test suite's pool): the measurements of
    ``steps`` SGD steps of the GPT on one sample of ``length`` tokens, split over the world."""
    import torch.distributed as dist

    from lightning_zero.models.gpt import GPT
    from lightning_zero.sequence_parallel import SequenceGroup

    sg = SequenceGroup.of(None)
    torch.manual_seed(0)
    model = GPT(_config(length, kind == "sparse"))
    if sg.size > 1:
        model.use_sequence_group(sg)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randint(0, 256, (1, length + 1), generator=torch.Generator().manual_seed(1))
    times = []
    for _ in range(steps):
        sg.traffic.reset()
        dist.barrier()
        start = time.perf_counter()
        logits = model(sg.slice(x[:, :-1]))
        loss = sg.loss(logits, sg.slice(x[:, 1:]))
        if sg.size > 1:  # ZeRO's average over data x sequence (here: the sequence group)
            loss.backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= sg.size
        else:
            loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
    return {"seconds": statistics.median(times), "loss": float(loss), "bytes": sg.traffic.bytes_sent,
            "calls": sg.traffic.calls, "peak_mb": proc_status_bytes("VmHWM") / 2**20}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(size: int, args: list[str], timeout: float) -> dict:
    """``size`` ranks of this script's worker; rank 0's result, or the first failure."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": str(size),
           "OMP_NUM_THREADS": "1"}
    command = [sys.executable, os.path.abspath(__file__), "_worker", *args]
    procs = [subprocess.Popen(command, env={**env, "RANK": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for r in range(size)]
    deadline, results = time.monotonic() + timeout, []
    try:
        for p in procs:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            lines = [line for line in out.splitlines() if line.startswith("{")]
            if p.returncode or not lines:
                tail = (err.strip().splitlines() or ["failed"])[-1]
                return {"error": "out of memory" if "memory" in err.lower() or p.returncode < 0 else tail[:100]}
            results.append(json.loads(lines[-1]))
    except subprocess.TimeoutExpired:
        return {"error": f"over {timeout:.0f} s"}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results[0]


def longest(limit_mb: int, max_length: int, timeout: float, start: int, kinds: list[str]) -> None:
    print(f"\nload average {os.getloadavg()}; gpt_tiny's shape (2 layers, 4 heads, n_embd 64), batch 1, one "
          f"training step, each rank under RLIMIT_DATA = {limit_mb} MB above its data size at start\n")
    print("| attention | P | longest sequence trained | per rank | first failure |")
    print("|---|---|---|---|---|")
    for kind in kinds:
        for size in (1, 2, 4):
            length, ok, failure = start, 0, "none up to the cap"
            while length <= max_length:
                r = _launch(size, [kind, str(length), str(limit_mb), "1"], timeout)
                if "error" in r:
                    failure = f"{length}: {r['error']}"
                    break
                ok, length = length, length * 2
            print(f"| {kind} | {size} | {ok} | {ok // size} | {failure} |", flush=True)


def traffic(length: int, timeout: float) -> None:
    config = _config(length, False)
    print(f"\nload average {os.getloadavg()}; gpt_tiny's shape at {length} tokens, batch 1, fp32; bytes one rank "
          "sends to the others in one training step (all layers, forward + backward)\n")
    print("| P | all-to-alls | bytes sent (counted) | formula 8 B T H (P-1)/P^2 x 4 bytes x layers | ratio |")
    print("|---|---|---|---|---|")
    for size in (2, 4):
        r = _launch(size, ["dense", str(length), "0", "1"], timeout)
        if "error" in r:
            print(f"| {size} | - | {r['error']} | - | - |")
            continue
        formula = 8 * 1 * length * config.n_embd * (size - 1) / size**2 * 4 * config.n_layer
        print(f"| {size} | {r['calls']} | {r['bytes']:,} | {formula:,.0f} | {r['bytes'] / formula:.3f} |", flush=True)


def step(length: int, steps: int, timeout: float) -> None:
    print(f"\nload average {os.getloadavg()}; gpt_tiny's shape at {length} tokens, batch 1, fp32, one torch thread "
          f"per rank; median of {steps} steps (forward, backward, gradient all-reduce, SGD)\n")
    print("| attention | P | step s | vs unsplit | peak RSS per rank MB | loss |")
    print("|---|---|---|---|---|---|")
    for kind in ("dense", "sparse"):
        base = None
        for size in (1, 2, 4):
            r = _launch(size, [kind, str(length), "0", str(steps)], timeout)
            if "error" in r:
                print(f"| {kind} | {size} | {r['error']} | - | - | - |")
                continue
            base = base or r["seconds"]
            print(f"| {kind} | {size} | {r['seconds']:.3f} | {r['seconds'] / base:.2f}x | {r['peak_mb']:.0f} | "
                  f"{r['loss']:.5f} |", flush=True)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_worker":
        a = sys.argv[2:]
        print(json.dumps(_worker(a[0], int(a[1]), int(a[2]), int(a[3]))))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    a = sub.add_parser("longest")
    a.add_argument("--limit-mb", type=int, default=192)
    a.add_argument("--max-length", type=int, default=65536)
    a.add_argument("--start", type=int, default=1024, help="the first length tried (then doubled)")
    a.add_argument("--kinds", nargs="+", default=["dense", "sparse"], choices=["dense", "sparse"])
    b = sub.add_parser("traffic")
    b.add_argument("--length", type=int, default=4096)
    c = sub.add_parser("step")
    c.add_argument("--length", type=int, default=4096)
    c.add_argument("--steps", type=int, default=5)
    for p in (a, b, c):
        p.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()
    if args.what == "longest":
        longest(args.limit_mb, args.max_length, args.timeout, args.start, args.kinds)
    elif args.what == "traffic":
        traffic(args.length, args.timeout)
    else:
        step(args.length, args.steps, args.timeout)


if __name__ == "__main__":
    main()
