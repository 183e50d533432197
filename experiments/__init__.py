"""Real experiments for lightning_zero: a byte-level GPT on the Python stdlib source, and a small MLP.

The models and data live in :mod:`lightning_zero.models` (the CLI builds them); this package keeps
their old import paths (``experiments``, ``experiments.gpt``, ``experiments.mlp``, ``experiments.data``).
"""

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
