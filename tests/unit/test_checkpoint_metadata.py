"""The sharded checkpoint's metadata records (Note [metadata records] in checkpoint/layout.py): the JSON on
disk is what format 1 always wrote, and a checkpoint written before the records existed still loads.

``tests/data/checkpoint_format1_stage2`` was written by commit c909405 (``tests/data/write_format1_checkpoint.py``:
stage 2, two ranks, TinyTransformer with AdamW, after step 2), its ``.expected.safetensors`` is what that code
read back from it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from safetensors.torch import load_file

from lightning_zero import ZeroStrategy
from lightning_zero.checkpoint import (
    CheckpointError,
    ShardedCheckpoint,
    consolidate_checkpoint,
    materialize_optimizer_state,
)
from lightning_zero.checkpoint.layout import FlatGroupRecord, ParamPlace, ShardPlace
from tests.models import TinyTransformer, make_trainer, token_loader

OLD = Path(__file__).resolve().parents[1] / "data" / "checkpoint_format1_stage2"
EXPECTED = OLD.with_name(OLD.name + ".expected.safetensors")


def test_records_write_the_json_format_1_has_always_had() -> None:
    """Same keys, same order, lists not tuples: byte-identical ``json.dumps`` of every group."""
    groups = json.loads((OLD / "metadata.json").read_text())["groups"]
    assert len(groups) == 2
    for i, plain in enumerate(groups):
        record = FlatGroupRecord.from_json(plain, i)
        assert json.dumps(record.to_json()) == json.dumps(plain)
    first = FlatGroupRecord.from_json(groups[0], 0)
    assert first.shards == (ShardPlace(0, 0, 780), ShardPlace(1, 780, 1560)) and first.optimizer_group == 0
    assert first.params[0] == ParamPlace("emb.weight", 0, (17, 12))


def test_a_malformed_group_is_a_checkpoint_error(tmp_path: Path) -> None:
    ckpt = Path(shutil.copytree(OLD, tmp_path / "ckpt"))
    meta = json.loads((ckpt / "metadata.json").read_text())
    del meta["groups"][1]["shards"]
    (ckpt / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"Flat group 1 of the checkpoint's metadata is malformed \(KeyError"):
        ShardedCheckpoint(ckpt)


def test_a_checkpoint_written_before_the_records_reads_back_bitwise() -> None:
    expected = load_file(EXPECTED)
    state = consolidate_checkpoint(OLD)
    assert sorted(state) == sorted(k.removeprefix("sd.") for k in expected if k.startswith("sd."))
    assert all(torch.equal(state[k], expected[f"sd.{k}"]) for k in state)
    optimizer = materialize_optimizer_state(ShardedCheckpoint(OLD).optimizer_states()[0])
    read = {f"opt.{i}.{k}": torch.as_tensor(v) for i, s in optimizer["state"].items() for k, v in s.items()}
    assert sorted(read) == sorted(k for k in expected if k.startswith("opt."))
    assert all(torch.equal(read[k], expected[k]) for k in read)


class _Loaded(Callback):
    """The weights and optimizer state right after the resume loaded them (before any step)."""

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}
        self.steps: list[int] = []

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.weights = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
        self.steps.append(trainer.global_step)


def test_a_checkpoint_written_before_the_records_resumes_into_shards_on_one_rank() -> None:
    """Loading into shards (``owned.py``: ranges read across both old rank files) at another world size."""
    expected = load_file(EXPECTED)
    loaded = _Loaded()
    trainer = make_trainer(ZeroStrategy(stage=2), devices=1, max_steps=3, callbacks=[loaded])
    trainer.fit(TinyTransformer("adamw"), token_loader(n=48, batch_size=8), ckpt_path=str(OLD))
    assert loaded.steps == [2]
    assert sorted(loaded.weights) == sorted(k.removeprefix("sd.") for k in expected if k.startswith("sd."))
    assert all(torch.equal(v, expected[f"sd.{k}"]) for k, v in loaded.weights.items())
