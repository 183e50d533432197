"""Checkpoints of pipeline x tensor parallel (issue 31): pipeline 2 x TP 2 on 4 ranks saved in the sharded format
(each rank its slices of its stage), resumed at the same layout, at pipeline 2 x TP 1 on 2 ranks and at TP 1
without a pipeline on one rank, the losses following the uninterrupted pipeline 2 x TP 2 run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_zero import PipelineConfig, ZeroStrategy
from lightning_zero.checkpoint import ShardedCheckpoint
from tests.distributed.test_tensor_parallel_checkpoints import (
    ACCUMULATE,
    CONFIG,
    EPOCHS,
    STEPS_PER_EPOCH,
    TOTAL,
    _close,
    _loader,
    _Recorded,
    _SaveAtEpochEnd,
    _segment,
)
from tests.models import make_trainer
from tests.pool import GlooPool, Pools


class _PipelinedRecorded(_Recorded):
    """The tests' GPT with each pipelined batch's loss recorded (the last stage's ranks see it)."""

    def on_pipeline_loss(self, stage: str, loss: torch.Tensor, batch: Any) -> None:
        if stage == "train":
            self.losses.append(float(loss))


def _pipelined(epochs: int, resume: Path | None = None, save: Path | None = None, tp: int = 2) -> list[float]:
    torch.manual_seed(0)
    module = _PipelinedRecorded()
    pipeline = PipelineConfig(stages=2, micro_batches=2, schedule="1f1b", partition_method="uniform")
    strategy = ZeroStrategy(stage=1, tensor_parallel=tp, pipeline=pipeline)
    trainer = make_trainer(strategy, devices=2 * tp, max_steps=TOTAL, max_epochs=epochs, gradient_clip_val=0.3,
                           accumulate_grad_batches=ACCUMULATE, callbacks=[_SaveAtEpochEnd(save)] if save else [])
    trainer.fit(module, _loader(1, 0), ckpt_path=resume)
    return module.losses


def resume_body(tmp: str) -> dict[str, Any]:
    """On 4 ranks (stage 0: ranks 0, 1; stage 1: ranks 2, 3): the uninterrupted run, the same run saved after
    epoch 1, and that checkpoint resumed at the same layout for epoch 2."""
    import torch.distributed as dist

    tmp_path = Path(tmp)
    whole = _pipelined(EPOCHS)
    first = _pipelined(1, save=tmp_path / "pp2tp2")
    same = _pipelined(2, resume=tmp_path / "pp2tp2")
    return {"rank": dist.get_rank(), "whole": whole, "first": first, "same": same}


def resume_tp1_body(tmp: str) -> list[float]:
    """On 2 ranks (one per stage): the pipeline 2 x TP 2 checkpoint resumed at pipeline 2 x TP 1 for epoch 2."""
    return _pipelined(2, resume=Path(tmp) / "pp2tp2", tp=1)


@pytest.mark.slow
@pytest.mark.distributed
def test_a_pipeline2_by_tp2_checkpoint_resumes_at_the_same_layout_and_at_tp1_on_one_rank(
        tmp_path: Path, gloo_pool: GlooPool, gloo_pools: Pools) -> None:
    results = gloo_pools.get(4).run("tests.distributed.test_pipeline_tensor_parallel_checkpoints:resume_body",
                                    tmp=str(tmp_path), _timeout_s=900)
    per_epoch = STEPS_PER_EPOCH * ACCUMULATE
    recorded = [r for r in sorted(results, key=lambda r: r["rank"]) if r["whole"]]
    assert recorded, "no rank recorded the pipelined losses"
    for r in recorded:
        whole = r["whole"]
        assert len(whole) == TOTAL * ACCUMULATE
        assert _close(r["first"], whole[:per_epoch]) < 1e-6
        assert _close(r["same"], whole[per_epoch : 2 * per_epoch]) < 1e-6  # pp2 x tp2 -> pp2 x tp2

    # the sharded format of the unsplit model: the TP record, split tensors as parts of each stage's TP ranks
    ckpt = ShardedCheckpoint(tmp_path / "pp2tp2")
    assert ckpt.meta["version"] == 2 and ckpt.tensor_parallel is not None and ckpt.tensor_parallel.size == 2
    assert ckpt.tensor_parallel.split["model.blocks.0.attn.qkv.weight"] == (0, 3)  # stage 0
    assert ckpt.tensor_parallel.split["model.blocks.1.mlp.proj.weight"] == (1, 1)  # stage 1
    assert "model.ln_f.weight" not in ckpt.tensor_parallel.split
    state = ckpt.state_dict()
    assert state["model.blocks.1.attn.qkv.weight"].shape == (3 * CONFIG.n_embd, CONFIG.n_embd)

    # pipeline 2 x TP 2 -> pipeline 2 x TP 1 on the session's 2-rank pool (no new launch): epoch 2 follows
    pp2tp1 = gloo_pool.run("tests.distributed.test_pipeline_tensor_parallel_checkpoints:resume_tp1_body",
                           tmp=str(tmp_path))
    for losses in pp2tp1:  # both stages' ranks record the pipelined loss
        assert _close(losses, recorded[0]["whole"][per_epoch : 2 * per_epoch]) < 1e-6, (losses, recorded[0]["whole"])

    # pipeline 2 x TP 2 -> TP 1 without a pipeline on one rank (this process): epochs 2-3 follow the whole run
    single, _, _ = _segment(2, 1, EPOCHS, 1, resume=tmp_path / "pp2tp2")
    assert _close(single.losses, recorded[0]["whole"][per_epoch:]) < 1e-6
