"""A sharded checkpoint as one file: a plain state dict (streamed to ``.safetensors``) or a
Lightning checkpoint; and a consolidated Lightning checkpoint (one file, e.g. an expert-parallel run's, whose
experts are unsplit) as a plain state dict. No process group is needed."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from lightning_zero.checkpoint.layout import parse_dtype
from lightning_zero.checkpoint.reader import ShardedCheckpoint, materialize_optimizer_state
from lightning_zero.checkpoint.tensor_file import Entry, own_bytes, write_file


def consolidate_checkpoint(path: str | os.PathLike, prefix: str = "") -> dict[str, torch.Tensor]:
    """The whole model of a sharded checkpoint as one ``state_dict`` (no process group needed).

    Trainable parameters come from the fp32 master where there was one, so the values are those
    training would continue from; with a 16-bit master-less policy (``bf16-true``) they keep their
    dtype. Keys are the LightningModule's; ``prefix`` keeps only keys under it, with the prefix
    removed (e.g. ``prefix="model."`` for a module that wraps the plain model as ``self.model``).
    """
    state = ShardedCheckpoint(path).state_dict()
    return {k[len(prefix):]: state[k] for k in state if k.startswith(prefix)}


def convert_checkpoint(path: str | os.PathLike, out: str | os.PathLike, lightning: bool = False,
                       prefix: str = "") -> Path:
    """Write a sharded checkpoint as one file (a consolidated ``.ckpt`` file: its ``state_dict`` as a plain one).

    ``out`` ending in ``.safetensors``: the fp32 state dict in safetensors, streamed (one tensor
    read and written at a time: the memory of the largest tensor, whatever the model's size);
    otherwise a ``torch.save`` file of it (held whole in memory, as ``torch.save`` needs).
    ``lightning=True``: a normal Lightning checkpoint (state dict, optimizer state in
    ``torch.optim``'s per-parameter layout, loops, callbacks, schedulers, hyper-parameters) that
    ``LightningModule.load_from_checkpoint`` and any strategy open (also held whole).
    """
    _refuse_deepspeed(path)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if Path(path).is_file():
        return _convert_consolidated(Path(path), out, lightning, prefix)
    ckpt = ShardedCheckpoint(path)
    if lightning:
        if prefix:
            raise ValueError("`prefix` applies to plain state dicts, not to a Lightning checkpoint.")
        data: dict[str, Any] = ckpt.lightning_state()
        data["state_dict"] = ckpt.state_dict().materialize()
        data["optimizer_states"] = [materialize_optimizer_state(o) for o in ckpt.optimizer_states()]
        torch.save(own_bytes(data), out)  # each tensor its own bytes, not the flat buffer it views
        return out
    if out.suffix == ".safetensors":
        entries = []
        for key, ref in ckpt.state_dict().refs.items():
            if key.startswith(prefix):
                dtype = parse_dtype(ref.get("dtype")) or ckpt.ref_dtype(ref)
                entries.append(Entry(key[len(prefix):], dtype, tuple(ckpt.ref_shape(ref)),
                                     lambda ref=ref: ckpt.read(ref)))
        write_file(out, entries)
    else:
        torch.save(own_bytes(consolidate_checkpoint(path, prefix)), out)
    return out


def _convert_consolidated(path: Path, out: Path, lightning: bool, prefix: str) -> Path:
    """A consolidated Lightning checkpoint's ``state_dict`` (keys under ``prefix``, without it) as a plain file."""
    if lightning:
        raise ValueError(f"{os.fspath(path)!r} is a consolidated Lightning checkpoint already: open it as it is, or "
                         "convert it without --lightning to a plain state dict")
    data = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    if not isinstance(data, dict) or not isinstance(data.get("state_dict"), dict):
        raise ValueError(f"{os.fspath(path)!r} is neither a sharded checkpoint directory nor a Lightning checkpoint "
                         "with a state_dict")
    state = {k[len(prefix):]: v for k, v in data["state_dict"].items() if k.startswith(prefix)}
    if out.suffix == ".safetensors":
        write_file(out, [Entry(k, v.dtype, tuple(v.shape), lambda v=v: v) for k, v in state.items()])
    else:
        torch.save(own_bytes(state), out)
    return out


def _refuse_deepspeed(path: str | os.PathLike) -> None:
    p = Path(path)
    markers = (p / "latest").is_file() or any(p.glob("*_optim_states.pt")) or any(p.glob("*/*_optim_states.pt"))
    if p.is_dir() and markers:
        raise NotImplementedError(
            f"{os.fspath(path)!r} looks like a DeepSpeed ZeRO checkpoint. Reading DeepSpeed checkpoints is not "
            "implemented yet (it needs a restricted unpickler for DeepSpeed's .pt files); use DeepSpeed's "
            "`zero_to_fp32.py` and load the result with `strategy.load_full_state_dict(...)`."
        )
