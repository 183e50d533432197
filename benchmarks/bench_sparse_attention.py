"""Block-sparse attention against dense SDPA (issue 32), three measurements, each printed as a
markdown table for docs/benchmarks.md:

* ``attention``: forward + backward time and peak RSS growth of ``SparseSelfAttention`` (a fixed,
  unidirectional layout, about 2 % dense at 16k tokens) run by the row-group executor and by the
  block-sparse kernel, against causal SDPA and against SDPA given the same layout as a mask, at
  each length; every (length, method) runs in a fresh process (a clean ``VmHWM``), the methods
  interleaved inside each round; the medians of the rounds are reported, and the ratios are those
  of the medians. The timed pass runs after the module's plan for the length is built and cached
  (built once per length, as the layout); the peak is the timed pass's, the module's kept state
  counted, and building the module (its layout) is reported on its own (``build MB``). Density:
  the attended (query, key) token pairs over all ``L x L`` pairs;
* ``longest``: the longest sequence a GPT (gpt_tiny's shape) trains one step at under a fixed
  ``RLIMIT_DATA``, sparse against dense, doubling the length until a run fails or passes the time cap;
* ``quality``: the GPT's validation loss with local + global (fixed) sparse attention against dense
  after the same steps on the same data.

Run: python benchmarks/bench_sparse_attention.py attention --lengths 1024 4096 16384 32768 --rounds 3 --threads 1
     python benchmarks/bench_sparse_attention.py longest --limit-mb 512
     python benchmarks/bench_sparse_attention.py quality --steps 150
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.nn.functional as F

from lightning_zero.sparse_attention import FixedSparsityConfig, SparseSelfAttention
from lightning_zero.testing.memory import proc_status_bytes, reset_peak_rss

HEADS, HEAD_DIM = 4, 64
BLOCK, LOCAL = 8, 32  # fixed layout: windows of 32 blocks of 8 tokens, one global block per window (2.3 % at 16k)
MASKED_MAX = 4096  # SDPA with an explicit mask materialises (L, L) scores: longer ones are skipped
BLOCK_SPARSE_MAX = 4096  # the block-sparse kernel at block 8: minutes per run beyond this
METHODS = ("row_groups", "block_sparse", "sdpa_causal", "sdpa_masked")


def layout_config(heads: int = HEADS, block: int = BLOCK, local: int = LOCAL) -> FixedSparsityConfig:
    return FixedSparsityConfig(heads, block=block, num_local_blocks=local, attention="unidirectional")


def token_density(layout: torch.Tensor, block: int, causal: bool = True) -> float:
    """Attended (query, key) token pairs over all ``L x L`` pairs, for head 0 (a causal diagonal block
    counts its lower triangle)."""
    layout = layout[0].bool()
    pairs = int(layout.sum()) * block * block
    if causal:
        pairs -= int(layout.diagonal().sum()) * block * (block - 1) // 2
    return pairs / float(layout.shape[0] * block) ** 2


def _attention_worker(method: str, length: int, threads: int) -> dict[str, float]:
    """One timed forward + backward (after one untimed pass at 1k tokens), and the peak RSS growth."""
    if threads:
        torch.set_num_threads(threads)
    ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD: big frees go back to the OS
    torch.manual_seed(0)
    # the module's own state (its layout, its cached plan) counts: the baseline is taken before it is built, and
    # causal SDPA, which needs no layout, builds none
    base = proc_status_bytes("VmRSS")
    executor = method if method in ("row_groups", "block_sparse") else "auto"
    reset_peak_rss()
    sparse = None if method == "sdpa_causal" else SparseSelfAttention(layout_config(), max_seq_length=length,
                                                                      causal=True, executor=executor)
    build_mb = (proc_status_bytes("VmHWM") - base) / 2**20

    def run(n: int) -> None:
        q, k, v = (torch.randn(1, HEADS, n, HEAD_DIM, requires_grad=True) for _ in range(3))
        if method in ("row_groups", "block_sparse"):
            out = sparse(q, k, v)
        elif method == "sdpa_causal":
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            layout = sparse.get_layout(n).bool()
            mask = layout.repeat_interleave(BLOCK, 1).repeat_interleave(BLOCK, 2) & torch.ones(
                n, n, dtype=torch.bool).tril()
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out.backward(torch.ones_like(out))

    run(1024)
    if method == "row_groups":  # the module caches its plan per length, as it caches the layout: built once
        sparse._row_group_batches(length, 1, torch.device("cpu"))
    elif method == "block_sparse":
        sparse._row_chunks(length, HEADS, torch.device("cpu"))
    reset_peak_rss()
    start = time.perf_counter()
    run(length)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "peak_mb": (proc_status_bytes("VmHWM") - base) / 2**20, "build_mb": build_mb}


def _spawn(args: list[str], timeout: float) -> dict | None:
    try:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), *args], capture_output=True, text=True,
                              timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"over {timeout:.0f} s"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1][:120]}
    return json.loads(lines[-1])


def attention(lengths: list[int], rounds: int, threads: int) -> None:
    methods = METHODS
    results: dict[tuple[int, str], list[dict]] = {}
    for _ in range(rounds):
        for length in lengths:
            for method in methods:
                if (method == "sdpa_masked" and length > MASKED_MAX) or (method == "block_sparse"
                                                                       and length > BLOCK_SPARSE_MAX):
                    continue
                results.setdefault((length, method), []).append(
                    _spawn(["_attention", method, str(length), str(threads)], timeout=1200) or {})
    density = {n: token_density(layout_config().make_layout(n), BLOCK) for n in lengths}
    print(f"\nload average {os.getloadavg()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"{threads or torch.get_num_threads()} thread(s) per run; heads {HEADS}, head_dim {HEAD_DIM}, batch 1, "
          f"fp32; fixed layout block {BLOCK}, num_local_blocks {LOCAL}, unidirectional; median of {rounds} round(s); "
          "density = attended (query, key) token pairs / L^2 (causal)\n")
    print("| tokens | density | row groups s | block-sparse kernel s | causal SDPA s | masked SDPA s | "
          "row groups vs causal | vs masked | row groups peak MB | block-sparse peak MB | causal SDPA peak MB | "
          "masked SDPA peak MB | row groups build MB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")

    def med(length: int, method: str, key: str) -> float | None:
        runs = [r[key] for r in results.get((length, method), []) if key in r]
        return statistics.median(runs) if runs else None

    def fmt(x: float | None, digits: int = 2) -> str:
        return "-" if x is None else f"{x:.{digits}f}"

    def ratio(slow: float | None, fast: float | None) -> str:
        return f"{slow / fast:.2f}x" if slow and fast else "-"

    for n in lengths:
        s, bs, c, m = (med(n, meth, "seconds") for meth in methods)
        ps, pb, pc, pm = (med(n, meth, "peak_mb") for meth in methods)
        print(f"| {n} | {density[n]:.1%} | {fmt(s)} | {fmt(bs)} | {fmt(c)} | {fmt(m)} | "
              f"{ratio(c, s)} | {ratio(m, s)} | {fmt(ps, 0)} | "
              f"{fmt(pb, 0)} | {fmt(pc, 0)} | {fmt(pm, 0)} | {fmt(med(n, 'row_groups', 'build_mb'), 0)} |")
    errors = {k: r["error"] for k, v in results.items() for r in v if "error" in r}
    if errors:
        print("\nfailed runs:", errors)


# the GPT's layout: each SparseSelfAttention keeps its layout as bits, heads x (L / block)^2 / 8 bytes (one head's
# when the heads share it)
LONGEST_BLOCK, LONGEST_LOCAL = 64, 16


def _gpt_config(length: int, sparse: bool, block: int = LONGEST_BLOCK, local: int = LONGEST_LOCAL):
    from lightning_zero.models.gpt import GPT_PRESETS

    section = {"mode": "fixed", "block": block, "num_local_blocks": local, "attention": "unidirectional"}
    return replace(GPT_PRESETS["gpt_tiny"], seq_len=length, sparse_attention=section if sparse else None)


def _longest_worker(kind: str, length: int, limit_mb: int, block: int, local: int) -> dict[str, float]:
    import resource

    from lightning_zero.models.gpt import GPT

    _soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    resource.setrlimit(resource.RLIMIT_DATA, (proc_status_bytes("VmData") + limit_mb * 2**20, hard))
    torch.manual_seed(0)
    model = GPT(_gpt_config(length, kind == "sparse", block, local))
    x = torch.randint(0, 256, (1, length + 1))
    start = time.perf_counter()
    logits = model(x[:, :-1])
    F.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1)).backward()
    return {"seconds": time.perf_counter() - start}


def longest(limit_mb: int, max_length: int, timeout: float, block: int, local: int,
            kinds: tuple[str, ...] = ("dense", "sparse"), start: int = 1024) -> None:
    print(f"\nload average {os.getloadavg()}; GPT gpt_tiny shape (2 layers, 4 heads, n_embd 64), batch 1, one "
          f"training step under RLIMIT_DATA = {limit_mb} MB above the process's data size at start; sparse: fixed, "
          f"block {block}, num_local_blocks {local}, unidirectional, executor auto (row groups)\n")
    print("| attention | longest sequence trained | first failure |")
    print("|---|---|---|")
    best = {}
    for kind in kinds:
        length, ok, failure = start, 0, "none up to the cap"
        while length <= max_length:
            r = _spawn(["_longest", kind, str(length), str(limit_mb), str(block), str(local)], timeout=timeout)
            if r is None or "error" in r:
                failure = f"{length}: {(r or {}).get('error', 'failed')}"
                break
            ok, length = length, length * 2
        best[kind] = ok
        print(f"| {kind} | {ok} | {failure} |")
    if best.get("dense"):
        print(f"\nsparse / dense: {best['sparse'] / best['dense']:.1f}x")


def quality(steps: int) -> None:
    import lightning.pytorch as pl

    from lightning_zero.models.data import TextDataModule
    from lightning_zero.models.gpt import GPTLightningModule

    print(f"\nGPT gpt_tiny shape, seq_len 256, batch 8, {steps} steps of AdamW (lr 3e-3, warmup 10), python "
          "stdlib text, the same seed and data order; sparse: fixed, block 16, num_local_blocks 4, one global "
          "block per window, unidirectional\n")
    print("| attention | val loss at start | val loss after | ")
    print("|---|---|---|")
    section = {"mode": "fixed", "block": 16, "num_local_blocks": 4, "attention": "unidirectional"}
    for kind in ("dense", "sparse"):
        pl.seed_everything(0)
        dm = TextDataModule(seq_len=256, micro_batch_size=8, max_bytes=2_000_000, deterministic_order=True)
        config = replace(_gpt_config(256, False), sparse_attention=section if kind == "sparse" else None)
        model = GPTLightningModule(config, lr=3e-3, warmup_steps=10)
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, limit_val_batches=8,
                             val_check_interval=steps, num_sanity_val_steps=0)
        start = trainer.validate(model, dm, verbose=False)[0]["val_loss"]
        trainer.fit(model, dm)
        print(f"| {kind} | {start:.4f} | {trainer.callback_metrics['val_loss'].item():.4f} |")


def run_worker(args: list[str]) -> dict:
    """One measurement of a worker process (``_attention ...`` / ``_longest ...``): what it prints as JSON."""
    worker = {"_attention": lambda a: _attention_worker(a[0], int(a[1]), int(a[2])),
              "_longest": lambda a: _longest_worker(a[0], int(a[1]), int(a[2]), int(a[3]), int(a[4]))}[args[0]]
    return worker(args[1:])


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1].startswith("_"):  # a worker process
        print(json.dumps(run_worker(sys.argv[1:])))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    a = sub.add_parser("attention")
    a.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    a.add_argument("--rounds", type=int, default=3)
    a.add_argument("--threads", type=int, default=0, help="torch threads per run (0: torch's default)")
    b = sub.add_parser("longest")
    b.add_argument("--limit-mb", type=int, default=512)
    b.add_argument("--max-length", type=int, default=65536)
    b.add_argument("--timeout", type=float, default=600)
    b.add_argument("--block", type=int, default=LONGEST_BLOCK)
    b.add_argument("--local", type=int, default=LONGEST_LOCAL)
    b.add_argument("--kinds", nargs="+", choices=("dense", "sparse"), default=["dense", "sparse"])
    b.add_argument("--start", type=int, default=1024, help="the first length tried (then doubled)")
    c = sub.add_parser("quality")
    c.add_argument("--steps", type=int, default=150)
    args = parser.parse_args()
    if args.what == "attention":
        attention(args.lengths, args.rounds, args.threads)
    elif args.what == "longest":
        longest(args.limit_mb, args.max_length, args.timeout, args.block, args.local, tuple(args.kinds), args.start)
    else:
        quality(args.steps)


if __name__ == "__main__":
    main()
