"""Real experiments for lightning_zero: a byte-level GPT on the Python stdlib source, and a small MLP."""

from experiments.data import (
    DeterministicShardSampler,
    RandomTokenDataset,
    TextDataModule,
    TokenChunkDataset,
    load_corpus,
    markov_corpus,
    split_corpus,
)
from experiments.gpt import GPT, GPT_PRESETS, GPTConfig, GPTLightningModule, count_parameters
from experiments.mlp import MLPClassifier, TeacherDataModule, teacher_dataset

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
