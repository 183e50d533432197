"""Fast tests of the experiment code (corpus, sampler, GPT presets/module, MLP); CPU only."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from experiments.data import (
    DeterministicShardSampler,
    RandomTokenDataset,
    TextDataModule,
    TokenChunkDataset,
    list_corpus_files,
    load_corpus,
    markov_corpus,
    split_corpus,
)
from experiments.gpt import GPT, GPT_PRESETS, GPTLightningModule, count_parameters, param_groups
from experiments.mlp import MLPClassifier, TeacherDataModule


def _trainer(**kwargs: object) -> pl.Trainer:
    defaults = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    return pl.Trainer(**{**defaults, **kwargs})


def test_corpus_loads_and_splits_deterministically() -> None:
    files = list_corpus_files()
    assert files and all(f.suffix == ".py" for f in files)
    assert not any(part in ("site-packages", "test", "tests") for f in files for part in f.parts[-3:-1])
    a, b = load_corpus(max_bytes=100_000), load_corpus(max_bytes=100_000)
    assert a.dtype == torch.uint8 and len(a) == 100_000 and torch.equal(a, b)
    train, val = split_corpus(a, 0.05)
    assert len(val) == 5_000 and torch.equal(torch.cat([train, val]), a)


def test_corpus_from_user_file(tmp_path) -> None:
    (tmp_path / "x.txt").write_bytes(b"hello world")
    assert bytes(load_corpus(tmp_path / "x.txt").tolist()) == b"hello world\n"
    assert bytes(load_corpus(tmp_path, pattern="*.txt").tolist()) == b"hello world\n"


def test_targets_are_inputs_shifted_by_one() -> None:
    data = load_corpus(max_bytes=10_000)
    ds = TokenChunkDataset(data, seq_len=32)
    assert len(ds) == (10_000 - 1) // 32
    for i in (0, 7, len(ds) - 1):
        x, y = ds[i]
        assert x.shape == y.shape == (32,) and x.dtype == torch.long
        assert torch.equal(x[1:], y[:-1])
        assert torch.equal(y, data[i * 32 + 1 : i * 32 + 33].long())
    x2, y2 = RandomTokenDataset(4, 16, seed=3)[2]
    assert torch.equal(x2[1:], y2[:-1]) and torch.equal(RandomTokenDataset(4, 16, seed=3)[2][0], x2)


@pytest.mark.parametrize("n,world", [(100, 2), (101, 4), (7, 1)])
def test_sampler_rank_shards_disjoint_and_cover(n: int, world: int) -> None:
    shards = [DeterministicShardSampler(n, world, r, seed=5) for r in range(world)]
    idx = [list(s) for s in shards]
    assert all(len(i) == len(s) == n // world for i, s in zip(idx, shards))
    flat = [j for i in idx for j in i]
    assert len(set(flat)) == len(flat) == (n // world) * world  # disjoint; only the < world tail dropped
    # union of the ranks' k-th micro-batches == k-th global batch of a single-process run
    single = list(DeterministicShardSampler(n, 1, 0, seed=5))
    assert sorted(flat) == sorted(single[: len(flat)])
    assert idx == [list(DeterministicShardSampler(n, world, r, seed=5)) for r in range(world)]
    for s in shards:
        s.set_epoch(1)
    if n > 10:
        assert [list(s) for s in shards] != idx
    padded = [list(DeterministicShardSampler(n, world, r, shuffle=False, drop_last=False)) for r in range(world)]
    assert set(j for i in padded for j in i) == set(range(n))


def test_datamodule_uses_deterministic_sampler() -> None:
    dm = TextDataModule(seq_len=16, micro_batch_size=4, max_bytes=20_000, deterministic_order=True)
    dm.setup("fit")
    loader = dm.train_dataloader()
    assert isinstance(loader.sampler, DeterministicShardSampler)
    first = next(iter(loader))
    assert torch.equal(first[0], next(iter(dm.train_dataloader()))[0])
    synth = TextDataModule(seq_len=16, max_bytes=5_000, synthetic=True)
    synth.setup()
    assert torch.equal(markov_corpus(5_000)[:100], synth.train_dataset.data[:100])


def test_preset_parameter_counts() -> None:
    expected = {  # name: (low, high)
        "gpt_tiny": (0.05e6, 0.2e6),
        "gpt_1m": (0.8e6, 1.3e6),
        "gpt_small": (5e6, 8e6),
        "gpt_20m": (18e6, 24e6),
        "gpt_50m": (45e6, 56e6),
        "gpt_125m": (110e6, 140e6),
        "gpt_350m": (320e6, 380e6),
        "gpt_1b": (0.9e9, 1.2e9),
    }
    assert set(GPT_PRESETS) == set(expected)
    for name, (low, high) in expected.items():
        assert low <= count_parameters(name) <= high, name
    assert count_parameters(GPT_PRESETS["gpt_tiny"]) == sum(
        p.numel() for p in GPT(GPT_PRESETS["gpt_tiny"]).parameters()
    )


def test_gpt_tiny_forward_backward_and_weight_tying() -> None:
    torch.manual_seed(0)
    model = GPT(GPT_PRESETS["gpt_tiny"])
    assert isinstance(model.blocks, torch.nn.ModuleList) and len(model.blocks) == 2
    assert model.lm_head.weight is model.tok_emb.weight
    x = torch.randint(0, 256, (2, 64))
    logits = model(x)
    assert logits.shape == (2, 64, 256)
    torch.nn.functional.cross_entropy(logits.reshape(-1, 256), x.reshape(-1)).backward()
    assert model.tok_emb.weight.grad is not None and model.blocks[0].attn.qkv.weight.grad is not None
    # causality: changing a later token does not change earlier logits
    x2 = x.clone()
    x2[:, -1] = (x2[:, -1] + 1) % 256
    assert torch.allclose(model(x2)[:, :-1], logits[:, :-1], atol=1e-5)
    untied = GPTLightningModule("gpt_tiny", model_overrides={"tie_weights": False}).model
    assert untied.lm_head.weight is not untied.tok_emb.weight
    groups = param_groups(model, 0.1)
    n_decay = sum(p.numel() for p in groups[0]["params"])
    assert n_decay + sum(p.numel() for p in groups[1]["params"]) == count_parameters("gpt_tiny")
    assert any(p is model.pos_emb.weight for p in groups[1]["params"])


def test_configure_model_path_matches_init_path() -> None:
    torch.manual_seed(1)
    eager = GPTLightningModule("gpt_tiny")
    torch.manual_seed(1)
    lazy = GPTLightningModule("gpt_tiny", build_in_configure_model=True)
    assert lazy.model is None
    lazy.configure_model()
    built = lazy.model
    lazy.configure_model()
    assert lazy.model is built  # idempotent
    sd_e, sd_l = eager.state_dict(), lazy.state_dict()
    assert sd_e.keys() == sd_l.keys() and all(torch.equal(sd_e[k], sd_l[k]) for k in sd_e)
    assert all(isinstance(v, (str, int, float, bool, list, dict, type(None))) for v in eager.hparams.values())


def test_trainer_gpt_tiny_loss_falls() -> None:
    pl.seed_everything(0)
    dm = TextDataModule(seq_len=32, micro_batch_size=8, max_bytes=200_000, deterministic_order=True)
    model = GPTLightningModule("gpt_tiny", lr=3e-3, warmup_steps=5, scheduler="cosine")
    trainer = _trainer(max_steps=30, limit_val_batches=4)
    before = trainer.validate(model, dm, verbose=False)[0]["val_loss"]
    trainer = _trainer(max_steps=30, limit_val_batches=4, val_check_interval=30)
    trainer.fit(model, dm)
    after = trainer.callback_metrics["val_loss"].item()
    assert trainer.global_step == 30
    assert after < before - 1.0, (before, after)


def test_mlp_classifier_learns() -> None:
    pl.seed_everything(0)
    dm = TeacherDataModule(num_train=1024, num_val=512, deterministic_order=True)
    model = MLPClassifier(build_in_configure_model=True)
    trainer = _trainer(max_epochs=2)
    trainer.fit(model, dm)
    assert trainer.callback_metrics["val_acc"].item() > 0.5
