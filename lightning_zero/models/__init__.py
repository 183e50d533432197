"""The reference models and data the ``lightning-zero train`` CLI builds: a byte-level GPT, a small MLP,
and their datasets / LightningDataModules (``model=`` and ``data=`` options).

They live here, below ``config/`` and the estimator, so that those tools never import the
``experiments`` package (the top layer, which re-exports them under their old names).

Public pieces: ``GPT``, ``GPTConfig``, ``GPT_PRESETS``, ``GPTLightningModule``, ``count_parameters``,
``gpt_param_init`` (``gpt``, with ``gpt_config``: the shape and presets, ``gpt_blocks``: one block, ``gpt_model``:
the model without Lightning); ``MLPClassifier``, ``TeacherDataModule`` (``mlp``, with ``mlp_parts``: its layers and
task without Lightning); ``TextDataModule``, ``ShardedDataModule``, ``TokenChunkDataset``, ``RandomTokenDataset``,
``DeterministicShardSampler`` (``data``). They are imported on first use (Note [lazy package names] in
``core/lazy.py``): the config checks read ``gpt_config``, ``gpt_model`` and ``mlp_parts`` without
Lightning.
"""

from lightning_zero.core.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        "lightning_zero.models.data": (
            "DeterministicShardSampler",
            "RandomTokenDataset",
            "ShardedDataModule",
            "TextDataModule",
            "TokenChunkDataset",
        ),
        "lightning_zero.models.gpt": ("GPTLightningModule",),
        "lightning_zero.models.gpt_model": ("GPT", "count_parameters", "gpt_param_init"),
        "lightning_zero.models.gpt_config": ("GPT_PRESETS", "GPTConfig"),
        "lightning_zero.models.mlp": ("MLPClassifier", "TeacherDataModule"),
    },
)
