"""Hugging Face ``transformers`` causal LMs through the CLI (``model=hf_causal_lm``, glue layer): a local
``save_pretrained`` directory read without ``transformers`` (``directory``: what the launcher checks), the model as a
LightningModule loaded straight into stage 3's shards (``module``, Note [loading a Hugging Face checkpoint sharded]),
and a run's sharded checkpoint written back as a directory ``from_pretrained`` loads (``export``). Names are imported
on first use (Note [lazy package names] in ``core/lazy.py``): the launcher reads ``directory`` without Lightning.
"""

from lightning_zero.core.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        "lightning_zero.hf.directory": ("HFDirectory",),
        "lightning_zero.hf.export": ("export_pretrained",),
        "lightning_zero.hf.module": ("HFCausalLM",),
    },
)
