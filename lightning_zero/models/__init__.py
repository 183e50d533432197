"""The reference models and data the ``lightning-zero train`` CLI builds: a byte-level GPT, a small MLP,
and their datasets / LightningDataModules (``model=`` and ``data=`` options).

They live here, below ``config/`` and the estimator, so that those tools never import the
``experiments`` package (the top layer, which re-exports them under their old names).

Public pieces: ``GPT``, ``GPTConfig``, ``GPT_PRESETS``, ``GPTLightningModule``, ``count_parameters``,
``gpt_param_init`` (``gpt``, with ``gpt_config``: the shape and presets, ``gpt_blocks``: one block);
``MLPClassifier``, ``TeacherDataModule`` (``mlp``); ``TextDataModule``, ``ShardedDataModule``,
``TokenChunkDataset``, ``RandomTokenDataset``, ``DeterministicShardSampler`` (``data``).
"""

from lightning_zero.models.data import (
    DeterministicShardSampler,
    RandomTokenDataset,
    ShardedDataModule,
    TextDataModule,
    TokenChunkDataset,
)
from lightning_zero.models.gpt import GPT, GPTLightningModule, count_parameters, gpt_param_init
from lightning_zero.models.gpt_config import GPT_PRESETS, GPTConfig
from lightning_zero.models.mlp import MLPClassifier, TeacherDataModule

__all__ = ["GPT", "GPT_PRESETS", "DeterministicShardSampler", "GPTConfig", "GPTLightningModule", "MLPClassifier",
           "RandomTokenDataset", "ShardedDataModule", "TeacherDataModule", "TextDataModule", "TokenChunkDataset",
           "count_parameters", "gpt_param_init"]
