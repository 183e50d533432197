"""A Hugging Face checkpoint larger than what a rank may use loads and trains at ZeRO stage 3 through the CLI, under a
limit the kernel enforces: each rank in its own cgroup v1 memory group (``lightning_zero/testing/cgroups.py``, as
root), the limit set when the fit is set up, before the model is built, to the rank's charge then (its imports, the
Trainer) plus 0.9x the checkpoint's bytes (``MemoryBudget``, a callback given by ``_target_``). A 132M-parameter Llama
(0.53 GB of fp32 safetensors, 3 shards) is built on the meta device and streamed shard by shard, then fine-tuned 2
steps in bf16 (``precision=bf16_true``, SGD without momentum: no optimizer state). Without cgroups (not root) the same
budget is an ``RLIMIT_DATA`` over the rank's data segment at setup, with the resident peak measured. A whole model per
rank, or any rank reading the checkpoint whole, would exceed the limit. docs/benchmarks.md has the figures and a run
whose limit (0.9x the checkpoint) counts from the rank's start."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from lightning_zero.hf.directory import HFDirectory
from lightning_zero.testing.cgroups import cgroups_available, rank_groups, rank_peaks

REPO = Path(__file__).resolve().parents[2]
BUDGET = 0.9  # x the checkpoint's bytes, from the model's construction on


def _run_over_budget(tmp_path: Path) -> dict:
    """The checkpoint written, then its 2-rank fine-tuning under the budget: the exit code and output, the model's
    bytes, the budget, whether cgroups held the ranks and what each group was charged at most."""
    text = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text()
    (tmp_path / "corpus.txt").write_text(text * 4)
    # written by a process of its own: a random model drawn here would draw from the test process's generator,
    # which the test running in the main thread meanwhile seeds and draws from (Note [background lane])
    subprocess.run([sys.executable, "-c", "import sys; from lightning_zero.testing.hf_models import save_causal_lm; "
                    "save_causal_lm(sys.argv[1], 'llama', open(sys.argv[2]).read(), hidden=1024, layers=14, "
                    "heads=16, positions=128, max_shard_size='200MB')", str(tmp_path / "llama"),
                    str(Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py")],
                   env={**os.environ, "PYTHONPATH": str(REPO)}, check=True, capture_output=True, timeout=600)
    model = tmp_path / "llama"
    model_bytes = HFDirectory(model).weight_bytes()
    assert model_bytes > 500e6 and len(list(model.glob("*.safetensors"))) >= 3
    budget = int(BUDGET * model_bytes)
    run = tmp_path / "run"
    if cgroups_available():  # the kernel's limit: a memory group per rank
        groups, env = rank_groups(f"lz_test_hf_{os.getpid()}", 2, None, tmp_path / "site", run / "peaks")
    else:  # RLIMIT_DATA, and the resident peak measured
        groups, env = [], rank_peaks(tmp_path / "site", run / "peaks")
    try:
        done = subprocess.run(
            [sys.executable, "-m", "lightning_zero", "train", "model=hf_causal_lm", f"model.path={model}",
             "data=text_file", f"data.path={tmp_path / 'corpus.txt'}", "data.seq_len=32", "data.micro_batch_size=1",
             "data.max_val_samples=2", "zero=stage3", "precision=bf16_true", "model.optimizer=sgd",
             "model.betas=[0.0,0.999]", "zero.max_live_parameters=10000000", "zero.prefetch_bucket_size=5000000",
             "zero.max_reuse_distance=0", "zero.reduce_bucket_size=2500000", "trainer.max_steps=2",
             "trainer.max_time=null", "trainer.val_check_interval=null", "trainer.validate_at_start=false",
             "trainer.validate_at_end=false", "trainer.checkpoint.enabled=false", "logger=none",
             "+callbacks.budget._target_=lightning_zero.testing.cgroups.MemoryBudget",
             f"+callbacks.budget.budget_bytes={budget}", f"hydra.run.dir={run}"],
            env={**os.environ, **env}, capture_output=True, text=True, timeout=600, check=False)
        charged = [(g.peak, g.oom_kills) for g in groups]
    finally:
        for group in groups:
            group.remove()
    return {"code": done.returncode, "output": done.stdout + done.stderr, "model_bytes": model_bytes,
            "budget": budget, "cgroups": bool(groups), "charged": charged, "run": run}


@pytest.mark.slow
@pytest.mark.lane(run=_run_over_budget)  # processes of their own (Note [background lane] in tests/lane.py)
def test_a_checkpoint_larger_than_a_ranks_budget_loads_and_trains_at_stage_3(lane_result: dict) -> None:
    model_bytes, budget, run, charged = (lane_result[k] for k in ("model_bytes", "budget", "run", "charged"))
    groups = lane_result["cgroups"]
    assert lane_result["code"] == 0, lane_result["output"][-5000:]
    assert json.loads((run / "result.json").read_text())["global_step"] == 2
    for rank in range(2):
        limits = json.loads((run / f"budget_rank{rank}.json").read_text())
        assert limits["how"] == ("cgroup" if groups else "rlimit")
        assert limits["limit"] - limits["start"] == budget < model_bytes
        if groups:
            peak, kills = charged[rank]
            assert kills == 0 and peak <= limits["limit"]
            print(f"rank {rank}: charged {limits['start'] / 1e9:.3f} GB at setup, peak {peak / 1e9:.3f} GB: "
                  f"{(peak - limits['start']) / model_bytes:.2f}x the checkpoint's {model_bytes / 1e9:.3f} GB")
        hwm = int((run / "peaks" / f"vmhwm_rank{rank}").read_text())
        print(f"rank {rank}: resident peak {hwm / 1e9:.3f} GB")
