"""A run's sharded checkpoint of a ``model=hf_causal_lm`` model written back as a directory that
``AutoModelForCausalLM.from_pretrained`` loads: the trained weights in safetensors shards (each tensor streamed from
the checkpoint's rank files: the memory of the largest tensor, whatever the model's size) with their index, the
source's ``config.json`` (and ``generation_config.json``), and its tokenizer."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning_zero.checkpoint.layout import parse_dtype
from lightning_zero.checkpoint.reader import ShardedCheckpoint
from lightning_zero.checkpoint.tensor_file import Entry, write_file
from lightning_zero.hf.directory import CONFIG_FILE, INDEX_FILE, SINGLE_FILE, HFDirectory

EXTRA_CONFIG_FILES = ("generation_config.json",)
DEFAULT_SHARD_BYTES = 2 * 1024**3  # transformers' save_pretrained default is 5 GB; smaller files load as fast


def _shards(entries: list[Entry], max_bytes: int) -> list[list[Entry]]:
    """Entries in order, cut into files of at most ``max_bytes`` (a tensor larger than that alone in its file)."""
    out: list[list[Entry]] = [[]]
    size = 0
    for e in entries:
        if out[-1] and size + e.nbytes > max_bytes:
            out.append([])
            size = 0
        out[-1].append(e)
        size += e.nbytes
    return out


def export_pretrained(checkpoint: str | os.PathLike, out: str | os.PathLike, source: str | os.PathLike | None = None,
                      config: Mapping[str, Any] | str | None = None, tokenizer: str | os.PathLike | None = None,
                      prefix: str = "model.", max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """Write ``checkpoint`` (a lightning_zero sharded checkpoint of :class:`~lightning_zero.hf.HFCausalLM`) as a
    ``save_pretrained`` directory ``out``.

    Args:
        checkpoint: the sharded checkpoint directory (e.g. ``<run dir>/checkpoints/last.ckpt``).
        out: the directory to write (created).
        source: the directory the run started from (``model.path``): its config and tokenizer are copied.
        config: without ``source``, the run's ``model.config`` (a ``config.json`` / directory, or a mapping).
        tokenizer: a tokenizer directory to copy (default: ``source``'s tokenizer).
        prefix: the LightningModule's attribute holding the transformers model, with its dot.
        max_shard_bytes: the largest safetensors file.

    Returns:
        ``out``.
    """
    ckpt = ShardedCheckpoint(checkpoint)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    entries = []
    for key, ref in ckpt.state_dict().refs.items():
        if key.startswith(prefix):
            dtype = parse_dtype(ref.get("dtype")) or ckpt.ref_dtype(ref)
            entries.append(Entry(key[len(prefix):], dtype, tuple(ckpt.ref_shape(ref)), lambda ref=ref: ckpt.read(ref)))
    if not entries:
        raise ValueError(f"{checkpoint} holds no weights under {prefix!r}: it is not a checkpoint of "
                         "model=hf_causal_lm.")
    shards = _shards(entries, max_shard_bytes)
    metadata = {"format": "pt"}  # what from_pretrained expects of a safetensors file
    if len(shards) == 1:
        write_file(out / SINGLE_FILE, shards[0], metadata)
    else:
        weight_map = {}
        for i, shard in enumerate(shards, start=1):
            name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            write_file(out / name, shard, metadata)
            weight_map.update({e.name: name for e in shard})
        index = {"metadata": {"total_size": sum(e.nbytes for e in entries)}, "weight_map": weight_map}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    _write_config(out, source, config)
    tokenizer_dir = Path(tokenizer) if tokenizer else (Path(source) if source else None)
    if tokenizer_dir is not None:
        for file in HFDirectory(tokenizer_dir).tokenizer_files():
            shutil.copy2(file, out / file.name)
    return out


def _write_config(out: Path, source: str | os.PathLike | None, config: Mapping[str, Any] | str | None) -> None:
    if source is not None:
        for name in (CONFIG_FILE, *EXTRA_CONFIG_FILES):
            if (Path(source) / name).is_file():
                shutil.copy2(Path(source) / name, out / name)
        return
    if isinstance(config, str) and Path(config).is_file():
        shutil.copy2(config, out / CONFIG_FILE)
        return
    from lightning_zero.hf.module import hf_config

    hf_config(None, config).save_pretrained(str(out))
