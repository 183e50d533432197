"""A Hugging Face checkpoint larger than a rank's memory limit, loaded sharded and fine-tuned at ZeRO stage 3 through
the CLI, each rank in its own cgroup v1 memory group (the limit the kernel enforces; run as root).

A Llama of ``--hidden`` x ``--layers`` (random weights, a BPE tokenizer trained here: no download) is saved by
``save_pretrained`` in safetensors shards; ``lightning-zero train model=hf_causal_lm model.path=DIR zero=stage3`` then
trains it on ``--ranks`` ranks, each rank placing itself in a memory group limited to ``--limit`` x the checkpoint's
bytes before it imports anything (``lightning_zero/testing/cgroups.py``). The model is built on the meta device and
each tensor streamed from the files into its owner's shard (Note [loading a Hugging Face checkpoint sharded]); with
``--offload param_nvme`` the parameter shards, the fp32 master and AdamW's state live in swap files (ZeRO-Infinity),
so a rank holds its gradient shard, a gathered unit or two and what the process itself needs. Printed: per rank, the
group's peak charge (``memory.max_usage_in_bytes``: the process and the page cache it read or wrote), its peak
resident set (``VmHWM``), the out-of-memory kills (0: it ran under the limit), each over the checkpoint's bytes.

    sudo python benchmarks/bench_hf_loading.py --hidden 1280 --layers 30 --limit 0.85 --offload param_nvme
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from threading import Thread

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_zero.hf.directory import HFDirectory
from lightning_zero.testing.cgroups import cgroups_available, rank_groups
from lightning_zero.testing.hf_models import save_causal_lm


def build(work: Path, hidden: int, layers: int) -> Path:
    """The checkpoint directory (made once per shape) and a corpus beside it."""
    text = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text()
    (work / "corpus.txt").write_text(text * 4)
    out = work / f"llama_h{hidden}_l{layers}"
    if not (out / "model.safetensors.index.json").is_file():
        save_causal_lm(out, "llama", text, hidden=hidden, layers=layers, heads=max(2, hidden // 64), positions=128,
                       max_shard_size="200MB")
    return out


def run(args: argparse.Namespace) -> dict:
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model = build(work, args.hidden, args.layers)
    directory = HFDirectory(model)
    model_bytes = directory.weight_bytes()
    limit = int(args.limit * model_bytes)
    run_dir = work / f"run_{int(time.time())}"
    budget = int(args.budget * model_bytes) if args.budget else None
    groups, env = rank_groups(f"lz_bench_hf_{os.getpid()}", args.ranks, None if budget else limit, work / "site",
                              run_dir / "peaks")
    overrides = ["model=hf_causal_lm", f"model.path={model}", "data=text_file", f"data.path={work / 'corpus.txt'}",
                 f"data.seq_len={args.seq_len}", "data.micro_batch_size=1", "data.max_val_samples=2",
                 f"zero=stage{args.stage}",
                 f"trainer.devices={args.ranks}", f"trainer.max_steps={args.steps}", "trainer.max_time=null",
                 "trainer.val_check_interval=null", "trainer.validate_at_start=false", "trainer.validate_at_end=false",
                 "trainer.checkpoint.enabled=false", "logger=none", f"hydra.run.dir={run_dir}"]
    if budget:  # the limit set when the fit is set up, before the model is built: its charge then + budget
        overrides += ["+callbacks.budget._target_=lightning_zero.testing.cgroups.MemoryBudget",
                      f"+callbacks.budget.budget_bytes={budget}"]
    if args.precision != "fp32":
        overrides.append(f"precision={args.precision}")
    if args.sgd:  # SGD without momentum: no optimizer state
        overrides += ["model.optimizer=sgd", "model.betas=[0.0,0.999]", "model.lr=1e-3"]
    if args.live:  # gathered parameters at once: DeepSpeed's stage3_max_live_parameters and its two companions
        overrides += [f"zero.max_live_parameters={args.live}", f"zero.prefetch_bucket_size={args.live // 2}",
                      "zero.max_reuse_distance=0", f"zero.reduce_bucket_size={args.live // 4}"]
    if args.offload != "none":
        overrides += [f"offload={args.offload}", f"offload.nvme_path={work / 'swap'}"]
        (work / "swap").mkdir(exist_ok=True)
    began = time.perf_counter()
    anon = [0] * len(groups)
    with subprocess.Popen([sys.executable, "-m", "lightning_zero", "train", *overrides], env={**os.environ, **env},
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        tail = Thread(target=lambda: setattr(proc, "output", proc.stdout.read()), daemon=True)  # type: ignore[union-attr]
        tail.start()
        while proc.poll() is None and time.perf_counter() - began < args.timeout:
            for i, group in enumerate(groups):  # the anonymous memory charged: what the page cache cannot give back
                anon[i] = max(anon[i], group.stat("total_rss"))
            time.sleep(0.05)
        if proc.poll() is None:
            proc.kill()
        tail.join()
        done = subprocess.CompletedProcess(proc.args, proc.wait(), getattr(proc, "output", ""), "")
    seconds = time.perf_counter() - began
    ranks = []
    for r, group in enumerate(groups):
        peak_file = run_dir / "peaks" / f"vmhwm_rank{r}"
        start = run_dir / f"budget_rank{r}.json"
        ranks.append({"rank": r, "group_peak": group.peak, "anon_peak": anon[r], "vmhwm": int(peak_file.read_text())
                      if peak_file.is_file() else None, "oom_kills": group.oom_kills,
                      "budget": json.loads(start.read_text()) if start.is_file() else None})
        group.remove()
    result = {"params": directory.num_parameters(), "model_bytes": model_bytes, "limit": limit, "ranks": ranks,
              "ranks_n": args.ranks, "stage": args.stage, "precision": args.precision,
              "optimizer": "sgd" if args.sgd else "adamw",
              "returncode": done.returncode, "seconds": seconds, "offload": args.offload,
              "steps": json.loads((run_dir / "result.json").read_text())["global_step"] if done.returncode == 0 else 0}
    if done.returncode != 0:
        result["tail"] = (done.stdout + done.stderr)[-3000:]
    return result


def report(r: dict) -> str:
    gb = 1e9
    m = r["model_bytes"]
    budget = [x["budget"] for x in r["ranks"] if x["budget"]]
    extra = budget[0]["limit"] - budget[0]["start"] if budget else 0
    limit = (f"each rank's limit set at setup to its charge then + {extra / gb:.3f} GB ({extra / m:.2f}x)"
             if budget else
             f"limit per rank {r['limit'] / gb:.3f} GB ({r['limit'] / m:.2f}x), from the rank's start")
    lines = [f"checkpoint: {r['params'] / 1e6:.1f}M parameters, {m / gb:.3f} GB of safetensors; {limit}; "
             f"{r['ranks_n']} ranks, ZeRO stage {r['stage']}, precision={r['precision']}, optimizer={r['optimizer']}, "
             f"offload={r['offload']}; "
             f"exit code {r['returncode']}, {r['steps']} steps in {r['seconds']:.0f} s", "",
             "| rank | charged at setup | peak charged | peak / model bytes | (peak - setup) / model bytes | "
             "anonymous peak | VmHWM | OOM kills |", "|---|---|---|---|---|---|---|---|"]
    for x in r["ranks"]:
        hwm, start = x["vmhwm"], (x["budget"] or {}).get("start")
        lines.append(f"| {x['rank']} | " + (f"{start / gb:.3f} GB" if start else "-")
                     + f" | {x['group_peak'] / gb:.3f} GB | {x['group_peak'] / m:.2f} | "
                     + (f"{(x['group_peak'] - start) / m:.2f}" if start else "-")
                     + f" | {x['anon_peak'] / gb:.3f} GB | " + (f"{hwm / gb:.3f} GB" if hwm else "-")
                     + f" | {x['oom_kills']} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=1280)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--stage", type=int, default=3, help="the ZeRO stage (a control: 2 holds the whole model per rank)")
    p.add_argument("--limit", type=float, default=0.85, help="each rank's memory limit over the checkpoint's bytes")
    p.add_argument("--budget", type=float, default=0.0,
                   help="instead of --limit: each rank may add this x the checkpoint's bytes from the model's "
                   "construction on (the limit is set then: the charge of its imports and the Trainer + this)")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "bf16_true"])
    p.add_argument("--sgd", action="store_true", help="SGD without momentum (no optimizer state) instead of AdamW")
    p.add_argument("--offload", default="none", choices=["none", "param_cpu", "param_nvme"])
    p.add_argument("--live", type=int, default=0,
                   help="zero.max_live_parameters (prefetch: half of it, reduce buckets: a quarter, "
                   "max_reuse_distance 0); 0: the defaults")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--work", default="/tmp/lz_bench_hf")
    p.add_argument("--timeout", type=int, default=3600)
    p.add_argument("--json", help="write the result here too")
    args = p.parse_args()
    if not cgroups_available():
        print("needs root and the cgroup v1 memory hierarchy (/sys/fs/cgroup/memory)", file=sys.stderr)
        return 2
    result = run(args)
    print(report(result))
    if "tail" in result:
        print(result["tail"], file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0 if result["returncode"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
