"""Real experiments for lightning_zero: a byte-level GPT on the Python stdlib source, and a small MLP.

The models and data live in :mod:`lightning_zero.models` (the CLI builds them); this package keeps
their old import paths: ``experiments`` re-exports them, and ``experiments.gpt``, ``experiments.mlp``
and ``experiments.data`` are those modules themselves (registered below, so no copy can drift).
"""

import sys

from lightning_zero.models import data, gpt, mlp
from lightning_zero.models.data import (
    DeterministicShardSampler,
    RandomTokenDataset,
    TextDataModule,
    TokenChunkDataset,
    load_corpus,
    markov_corpus,
    split_corpus,
)
from lightning_zero.models.gpt import GPT, GPT_PRESETS, GPTConfig, GPTLightningModule, count_parameters
from lightning_zero.models.mlp import MLPClassifier, TeacherDataModule, teacher_dataset

__all__ = [
    "GPT",
    "GPT_PRESETS",
    "DeterministicShardSampler",
    "GPTConfig",
    "GPTLightningModule",
    "MLPClassifier",
    "RandomTokenDataset",
    "TeacherDataModule",
    "TextDataModule",
    "TokenChunkDataset",
    "count_parameters",
    "load_corpus",
    "markov_corpus",
    "split_corpus",
    "teacher_dataset",
]

for _name, _module in (("data", data), ("gpt", gpt), ("mlp", mlp)):
    sys.modules[f"{__name__}.{_name}"] = _module
