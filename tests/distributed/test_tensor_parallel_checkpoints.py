"""Checkpoints with tensor parallelism (issue 31): saved at TP 2, resumed at TP 1 on 1 rank, at TP 1 x data 2 and
back at TP 2 (from a checkpoint written without TP), the losses following the uninterrupted TP-2 run; the sharded
format's TP record; ``convert`` giving the unsplit model; the element mapping of slices in one process."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero import ZeroStrategy
from lightning_zero.checkpoint import ShardedCheckpoint, convert_checkpoint
from lightning_zero.checkpoint.slices import SplitTag, slice_runs, split_of, whole_runs
from lightning_zero.models.gpt import GPTConfig, GPTLightningModule
from lightning_zero.tensor_parallel.layers import slice_tensor, unslice_tensors
from tests.models import RankSampler, make_trainer
from tests.pool import GlooPool

CONFIG = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=4, n_embd=32)
ACCUMULATE, BATCH, STEPS_PER_EPOCH, EPOCHS = 2, 4, 3, 3  # BATCH: the global batch of one micro-step
TOTAL = STEPS_PER_EPOCH * EPOCHS


# ------------------------------------------------------------------------------------------- one process
@pytest.mark.parametrize("dim,chunks,size", [(0, 1, 2), (0, 3, 2), (1, 1, 2), (1, 1, 4), (0, 3, 4), (0, 1, 1)])
def test_slice_and_whole_runs_map_every_element_once(dim: int, chunks: int, size: int) -> None:
    """The run mappings against torch's own slicing: every element of every slice, read through ``slice_runs``
    and (from the slices) through ``whole_runs``, for any range."""
    shape = [24, 12] if dim == 0 else [6, 8]
    whole = torch.arange(shape[0] * shape[1]).reshape(shape)
    slices = [slice_tensor(whole, SplitTag(dim, chunks, size, r)) for r in range(size)]
    assert torch.equal(unslice_tensors(slices, dim, chunks), whole)
    flat = whole.reshape(-1)
    for r, s in enumerate(slices):
        for start, end in [(0, s.numel()), (3, s.numel() - 5), (7, 8), (5, 5)]:
            got = torch.full((end - start,), -1)
            for at, w, n in slice_runs(shape, dim, chunks, size, r, start, end):
                got[at - start : at - start + n] = flat[w : w + n]
            assert torch.equal(got, s.reshape(-1)[start:end]), (r, start, end)
    for start, end in [(0, flat.numel()), (5, flat.numel() - 3), (11, 12)]:
        got = torch.full((end - start,), -1)
        for r, at, w, n in whole_runs(shape, dim, chunks, size, start, end):
            got[w - start : w - start + n] = slices[r].reshape(-1)[at : at + n]
        assert torch.equal(got, flat[start:end])


def test_the_tensor_parallel_record_round_trips_and_a_malformed_one_is_a_checkpoint_error() -> None:
    from lightning_zero.checkpoint import CheckpointError
    from lightning_zero.checkpoint.layout import TensorParallelRecord

    record = TensorParallelRecord(2, {"model.blocks.0.attn.qkv.weight": (0, 3)})
    plain = json.loads(json.dumps(record.to_json()))
    assert plain == {"size": 2, "split": {"model.blocks.0.attn.qkv.weight": {"dim": 0, "chunks": 3}}}
    assert TensorParallelRecord.from_json(plain) == record and TensorParallelRecord.from_json(None) is None
    with pytest.raises(CheckpointError, match="tensor_parallel record is malformed"):
        TensorParallelRecord.from_json({"size": 2})


# ------------------------------------------------------------------------------------------- distributed
class _Recorded(GPTLightningModule):
    """The GPT recording each micro-step's loss, averaged over the data ranks (the global batch's loss)."""

    def __init__(self) -> None:
        super().__init__(CONFIG, lr=1e-2, warmup_steps=0)
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        import torch.distributed as dist

        loss = self.loss(batch)
        value = loss.detach().clone()
        if dist.is_initialized():  # every rank of a TP group holds the same loss: the mean over all is the data mean
            dist.all_reduce(value)
            value /= dist.get_world_size()
        self.losses.append(float(value))
        return loss


def _loader(data_ranks: int, data_rank: int) -> DataLoader:
    """Epochs of STEPS_PER_EPOCH steps; data rank r takes samples r, r + D, ...: every layout's global batches
    hold the same samples, so the loss of the global batch is layout independent."""
    g = torch.Generator().manual_seed(1)
    n = STEPS_PER_EPOCH * ACCUMULATE * BATCH
    tokens = torch.randint(0, CONFIG.vocab_size, (n, CONFIG.seq_len + 1), generator=g)
    dataset = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    return DataLoader(dataset, batch_size=BATCH // data_ranks, sampler=RankSampler(n, data_rank, data_ranks))


class _SaveAtEpochEnd(pl.Callback):
    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_batch_end(self, trainer: pl.Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == trainer.num_training_batches - 1:  # the epoch's end, as Lightning resumes it
            trainer.save_checkpoint(self.path)  # during fit: the sharded format from the engine's shards


def _segment(stage: int, tp: int, epochs: int, devices: int, resume: Path | None = None,
             save: Path | None = None, checkpoint_format: str = "auto") -> tuple[_Recorded, ZeroStrategy, pl.Trainer]:
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.manual_seed(0)
    module = _Recorded()
    strategy = ZeroStrategy(stage=stage, tensor_parallel=tp if tp > 1 else None, checkpoint_format=checkpoint_format)
    trainer = make_trainer(strategy, devices=devices, max_steps=TOTAL, max_epochs=epochs, gradient_clip_val=0.3,
                           accumulate_grad_batches=ACCUMULATE, callbacks=[_SaveAtEpochEnd(save)] if save else [])
    data = devices // tp
    trainer.fit(module, _loader(data, rank // tp), ckpt_path=resume)
    return module, strategy, trainer


def resume_body(tmp: str) -> dict[str, Any]:
    """On 2 ranks: the uninterrupted TP-2 run (ZeRO 2); the same run saved after epoch 1 at TP 2 (ZeRO 3) and
    after fit (``trainer.save_checkpoint`` with the module still split); resumed at TP 1 x data 2 (ZeRO 2) for
    epoch 2, saved there, and resumed from that checkpoint (written without TP) at TP 2 (ZeRO 3) for epoch 3;
    the TP-2 checkpoint resumed at TP 2 (ZeRO 3); the consolidated format saved and resumed at TP 2 (ZeRO 1)."""
    import torch.distributed as dist

    tmp_path = Path(tmp)
    rank = dist.get_rank()
    whole, _, _ = _segment(2, 2, EPOCHS, 2)
    first, _, trainer = _segment(3, 2, 1, 2, save=tmp_path / "tp2")
    local = {n: p.detach().clone() for n, p in first.named_parameters()}
    tags = {n: split_of(p) for n, p in first.named_parameters()}
    trainer.save_checkpoint(tmp_path / "after_fit")  # the module split after teardown: saved unsplit
    x, y = _loader(1, 0).dataset[:BATCH]
    with torch.no_grad():
        eval_loss = float(first.loss((x, y)))  # the split model's forward (both TP ranks take part)
    second, _, _ = _segment(2, 1, 2, 2, resume=tmp_path / "tp2", save=tmp_path / "dp2")
    third, _, _ = _segment(3, 2, 3, 2, resume=tmp_path / "dp2")
    same, _, _ = _segment(3, 2, 2, 2, resume=tmp_path / "tp2")  # TP 2 -> TP 2 at ZeRO 3: each rank its slice
    # the consolidated format: unsplit on save (gathered over TP), cut to the slices on resume (ZeRO 1)
    _segment(1, 2, 1, 2, save=tmp_path / "tp2.ckpt", checkpoint_format="consolidated")
    fourth, _, _ = _segment(1, 2, 2, 2, resume=tmp_path / "tp2.ckpt", checkpoint_format="consolidated")
    return {"rank": rank, "whole": whole.losses, "first": first.losses, "second": second.losses,
            "third": third.losses, "same": same.losses, "fourth": fourth.losses, "local": local, "tags": tags,
            "eval_loss": eval_loss}


def _close(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) and a, (a, b)
    return max(abs(x - y) for x, y in zip(a, b))


@pytest.mark.slow
@pytest.mark.distributed
def test_a_tp2_checkpoint_resumes_at_tp1_on_one_rank_at_data2_and_back_at_tp2(gloo_pool: GlooPool,
                                                                             tmp_path: Path) -> None:
    results = gloo_pool.run("tests.distributed.test_tensor_parallel_checkpoints:resume_body", tmp=str(tmp_path),
                            _timeout_s=900)
    r0, r1 = sorted(results, key=lambda r: r["rank"])
    per_epoch = STEPS_PER_EPOCH * ACCUMULATE
    whole = r0["whole"]
    assert len(whole) == TOTAL * ACCUMULATE
    assert _close(r0["first"], whole[:per_epoch]) < 1e-6  # ZeRO 3 and ZeRO 2 at TP 2: the same run
    assert _close(r0["second"], whole[per_epoch : 2 * per_epoch]) < 1e-6  # TP 2 -> TP 1 x data 2
    assert _close(r0["third"], whole[2 * per_epoch :]) < 1e-6  # TP 1 x data 2 -> TP 2
    assert _close(r0["same"], whole[per_epoch : 2 * per_epoch]) < 1e-6  # TP 2 -> TP 2, ZeRO 3 (after setup)
    assert _close(r0["fourth"], whole[per_epoch : 2 * per_epoch]) < 1e-6  # consolidated, TP 2 -> TP 2
    consolidated = torch.load(tmp_path / "tp2.ckpt", weights_only=True)
    assert consolidated["state_dict"]["model.blocks.0.attn.qkv.weight"].shape == (3 * CONFIG.n_embd, CONFIG.n_embd)
    moments = consolidated["optimizer_states"][0]["state"]
    unsplit_shapes = sorted(tuple(p.shape) for p in GPTLightningModule(CONFIG).parameters())
    assert sorted(tuple(m["exp_avg"].shape) for m in moments.values()) == unsplit_shapes  # Adam's moments unsplit

    # the sharded format: split dims and the TP size recorded, slices written by each rank
    ckpt = ShardedCheckpoint(tmp_path / "tp2")
    assert ckpt.meta["version"] == 2 and ckpt.tensor_parallel is not None and ckpt.tensor_parallel.size == 2
    assert ckpt.tensor_parallel.split["model.blocks.0.attn.qkv.weight"] == (0, 3)
    assert ckpt.tensor_parallel.split["model.blocks.0.mlp.proj.weight"] == (1, 1)
    assert "model.ln_f.weight" not in ckpt.tensor_parallel.split
    assert ShardedCheckpoint(tmp_path / "dp2").tensor_parallel is None
    assert json.loads((tmp_path / "dp2" / "metadata.json").read_text())["version"] == 1  # without TP: format 1

    # convert gives the unsplit model: rank t's slice is the t-th part of each of q, k, v
    out = convert_checkpoint(tmp_path / "tp2", tmp_path / "model.safetensors")
    from safetensors.torch import load_file

    unsplit = load_file(out)
    qkv = unsplit["model.blocks.0.attn.qkv.weight"]
    assert qkv.shape == (3 * CONFIG.n_embd, CONFIG.n_embd)
    for r in (r0, r1):
        mine = r["local"]["model.blocks.0.attn.qkv.weight"]
        part = CONFIG.n_embd // 2
        for c in range(3):
            assert torch.equal(mine.chunk(3)[c], qkv.chunk(3)[c][r["rank"] * part : (r["rank"] + 1) * part])
        proj = unsplit["model.blocks.1.mlp.proj.weight"]
        assert torch.equal(r["local"]["model.blocks.1.mlp.proj.weight"], proj.chunk(2, dim=1)[r["rank"]])
        assert torch.equal(r["local"]["model.ln_f.weight"], unsplit["model.ln_f.weight"])
    assert r0["tags"]["model.blocks.0.attn.qkv.weight"] == SplitTag(0, 3, 2, 0)
    module = GPTLightningModule(CONFIG)
    module.load_state_dict(unsplit)  # the unsplit model, as a run without TP builds it
    x, y = _loader(1, 0).dataset[:BATCH]
    with torch.no_grad():
        assert abs(float(module.loss((x, y))) - r0["eval_loss"]) < 1e-6
    # saved after fit from the split module: the same unsplit model
    after = ShardedCheckpoint(tmp_path / "after_fit").state_dict()
    assert all(torch.equal(after[k], unsplit[k]) for k in unsplit)

    # TP 2 -> TP 1 on one rank (this process): epochs 2-3 follow the uninterrupted run
    single, _, _ = _segment(2, 1, 3, 1, resume=tmp_path / "tp2")
    assert _close(single.losses, whole[per_epoch:]) < 1e-6
