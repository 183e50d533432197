"""What each rank writes into a sharded checkpoint: its shards (views, never copies) and the metadata.

See Note [sharded checkpoint format] in format.py for the layout. Every tensor collected here is
the training state's own storage (a parameter, master or optimizer-state shard, or the list of a
master's pieces); ``tensor_file.write_file`` writes it from there (Note [streamed safetensors]).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightning_zero.checkpoint.layout import (
    FORMAT_NAME,
    MODEL_KEYS,
    PLAIN_VERSION,
    FlatGroupRecord,
    ParamPlace,
    ShardPlace,
    dtype_name,
    rank_file,
)
from lightning_zero.checkpoint.plain import to_plain
from lightning_zero.checkpoint.rng import capture_rng

if TYPE_CHECKING:
    from lightning_zero.core.zero.engine import ZeroEngine

Tensors = dict[str, "torch.Tensor | list[torch.Tensor]"]


@dataclass(frozen=True)
class StageLayout:
    """Where one pipeline stage's engine sits in a checkpoint that every stage writes a part of.

    Note [pipelined shards]
        Each pipeline stage's engine holds its own flat groups, so each stage describes its own:
        stage ``s``'s groups are numbered from ``group_offset`` on (the groups of the stages
        before it come first), their shards name the files of the stage's data-parallel ranks
        (``file_of``), parameters carry the unsplit model's state-dict keys and optimizer indices.
        A parameter several stages hold (a tied embedding and head) is written by each of them
        but referred to only from the first (``owns``). The stages' descriptions are merged on
        rank 0 (``pipeline/checkpoint.py``) into one ``metadata.json`` of the ordinary format, so
        the checkpoint reads back with or without a pipeline, at any world size.

    Attributes:
        group_offset: the checkpoint index of this engine's first flat group.
        file_of: data-parallel rank -> the global rank whose file holds that rank's shards.
        key_of: parameter -> its state-dict key in the unsplit module.
        index_of: parameter -> its index in the unsplit optimizer's state dict.
        owns: whether this stage's copy of a parameter is the one the checkpoint refers to.
        param_groups: the unsplit optimizer's param groups (parameters of every stage).
        whole: tensors written whole into this rank's file, by key (the unsplit module's buffers, on
            one rank only).
    """

    group_offset: int
    file_of: Callable[[int], int]
    key_of: Mapping[nn.Parameter, str]
    index_of: Mapping[nn.Parameter, int]
    owns: Callable[[nn.Parameter], bool]
    param_groups: list[list[nn.Parameter]]
    whole: Mapping[str, torch.Tensor]


def collect(
    checkpoint: Mapping[str, Any], engine: ZeroEngine | None, rank: int, world_size: int,
    layout: StageLayout | None = None,
) -> tuple[Tensors, dict[str, Any] | None, dict[str, Any]]:
    """This rank's tensors, and on rank 0 the metadata and the Lightning state's tensors.

    With an engine at stage >= 1 the model and optimizer come from the shards; otherwise (stage
    0, or no engine) rank 0 writes ``checkpoint['state_dict']`` / ``['optimizer_states']`` whole.
    With a ``layout`` (a pipeline stage) every rank returns the metadata of its own stage's part
    (Note [pipelined shards]).
    Returns ``(tensors, metadata or None, extra)``; ``extra["__header__"]`` is the rank file's header.
    """
    tensors: Tensors = {}
    meta: dict[str, Any] = {"format": FORMAT_NAME, "version": PLAIN_VERSION, "world_size": world_size,
                            "files": [rank_file(r) for r in range(world_size)], "groups": []}
    with_optimizer = "optimizer_states" in checkpoint
    if engine is not None and engine.config.stage.shards_optimizer:
        meta["stage"] = int(engine.config.stage)  # a plain number in the file
        _collect_shards(engine, rank, world_size, with_optimizer, tensors, meta, layout)
    else:
        meta["stage"] = int(engine.config.stage) if engine is not None else None
        if rank == 0:
            _collect_whole(checkpoint, with_optimizer, tensors, meta)
    rng_tensors: dict[str, torch.Tensor] = {}
    rng_plain = to_plain(capture_rng(), rng_tensors, "RNG state")
    tensors.update({f"rng.{k}": v for k, v in rng_tensors.items()})
    header = {"rng": json.dumps(rng_plain), "format": FORMAT_NAME, "version": str(PLAIN_VERSION)}
    if rank != 0:
        return tensors, meta if layout is not None else None, {"__header__": header}
    extra: dict[str, Any] = {}
    rest = {k: v for k, v in checkpoint.items() if k not in MODEL_KEYS}
    meta["lightning"] = to_plain(rest, extra, "checkpoint")
    return tensors, meta, {"__header__": header, **extra}


def _flat_ref(gi: int, kind: str, slot: Any, dtype: torch.dtype | None = None) -> dict[str, Any]:
    return {"flat": gi, "kind": kind, "offset": slot.offset, "numel": slot.numel, "shape": list(slot.shape),
            "dtype": dtype_name(dtype) if dtype is not None else None}


def _optimizer_shard(engine: ZeroEngine, fi: int) -> dict[str, Any]:
    """A flat group's optimizer state: per-element keys as the list of the master's pieces' state
    tensors (written end to end: no concatenated copy), others (``step``) from the first piece."""
    sharded = engine.sharded
    pieces = sharded.pieces_of[fi]
    states = [sharded.optimizer.state.get(p, {}) for p in pieces]
    out: dict[str, Any] = {}
    for key in states[0] if states else ():
        values = [st.get(key) for st in states]
        if all(isinstance(v, torch.Tensor) and v.shape == p.shape for v, p in zip(values, pieces)):
            out[key] = [v.reshape(-1) for v in values]
        else:
            out[key] = values[0]
    return out


def _collect_shards(
    engine: ZeroEngine, rank: int, world_size: int, with_optimizer: bool, tensors: Tensors, meta: dict[str, Any],
    layout: StageLayout | None,
) -> None:
    from lightning_zero.core.zero.optimizer import original_index

    sharded = engine.sharded
    separate = engine.separate_master
    master_dtype = engine.dtypes.master_dtype
    trainable = {id(g): fi for fi, g in enumerate(engine.groups)}
    index = original_index(sharded) if sharded is not None else {}
    offset, file_of, name_of = 0, (lambda r: r), engine.names.get
    if layout is not None:  # a pipeline stage: Note [pipelined shards]
        offset, file_of, index, name_of = layout.group_offset, layout.file_of, layout.index_of, layout.key_of.get
    dp_size = engine.comm.world_size if layout is not None else world_size
    where: dict[torch.Tensor, dict[str, Any]] = {}  # parameter -> its state-dict ref
    opt_state: dict[str, dict[str, Any]] = {}
    for li, g in enumerate(engine.all_groups):
        gi, fi = li + offset, trainable.get(id(g))
        has_master = separate and fi is not None and sharded is not None
        tensors[f"g{gi}.param"] = g.own_shard()
        if has_master:
            tensors[f"g{gi}.master"] = sharded.masters[fi]
        opt_keys: list[str] = []
        scalars: dict[str, Any] = {}
        if with_optimizer and fi is not None and sharded is not None:
            for key, value in sorted(_optimizer_shard(engine, fi).items()):
                if isinstance(value, list):
                    tensors[f"g{gi}.opt.{key}"] = value
                    opt_keys.append(key)
                elif isinstance(value, torch.Tensor):
                    tensors[f"g{gi}.scalar.{key}"] = value
                    scalars[key] = {"file": file_of(0), "key": f"g{gi}.scalar.{key}"}
                else:
                    scalars[key] = {"value": to_plain(value, {}, f"optimizer state {key!r}")}
        record = FlatGroupRecord(
            padded_numel=g.padded_numel,
            shards=tuple(ShardPlace(file_of(r), *g.shard_range(r)) for r in range(dp_size)),
            dtype=dtype_name(g.dtype),
            master=has_master,
            optimizer_group=g.optimizer_group,
            params=tuple(ParamPlace(name_of(s.param), s.offset, tuple(s.shape)) for s in g.slots),
        )
        meta["groups"].append(record.to_json())  # Note [metadata records] in layout.py
        for s in g.slots:
            if layout is not None and not layout.owns(s.param):
                continue  # a tied parameter: the first stage holding it is referred to
            cast = master_dtype if separate and not has_master and g.dtype.is_floating_point else None
            where[s.param] = _flat_ref(gi, "master" if has_master else "param", s, cast)
            if opt_keys or scalars:
                opt_state[str(index[s.param])] = {**{k: _flat_ref(gi, f"opt.{k}", s) for k in opt_keys}, **scalars}
    if layout is not None:  # its own parameters by unsplit key, and layout.whole (Note [pipelined shards])
        meta["state_dict"] = [[layout.key_of[p], ref] for p, ref in where.items()]
        for key, value in layout.whole.items():
            tensors[f"sd.{key}"] = value.detach()
            meta["state_dict"].append([key, {"file": rank, "key": f"sd.{key}"}])
    else:
        meta["state_dict"] = _module_entries(engine, rank, where, tensors)
    meta["optimizers"] = []
    if with_optimizer and sharded is not None:
        param_groups = layout.param_groups if layout is not None else sharded.original_params
        groups = [{**sharded.group_options(i), "params": [index[p] for p in params_]}
                  for i, params_ in enumerate(param_groups)]
        meta["optimizers"].append({"param_groups": to_plain(groups, {}, "optimizer param_groups"),
                                   "state": opt_state})


def _module_entries(
    engine: ZeroEngine, rank: int, where: dict[torch.Tensor, dict[str, Any]], tensors: Tensors
) -> list[list[Any]]:
    """The engine module's state-dict entries: parameters from the flat groups, the rest whole on rank 0."""
    params = dict(engine.module.named_parameters(remove_duplicate=False))
    entries = []
    for key, value in engine.module.state_dict(keep_vars=True).items():
        p = params.get(key)
        if p is not None and p in where:
            entries.append([key, where[p]])
            continue
        if rank == 0:
            value = value.detach()
            if engine.separate_master and value.is_floating_point():
                value = value.to(engine.dtypes.master_dtype)
            tensors[f"sd.{key}"] = value
        entries.append([key, {"file": 0, "key": f"sd.{key}"}])
    return entries


def _collect_whole(
    checkpoint: Mapping[str, Any], with_optimizer: bool, tensors: Tensors, meta: dict[str, Any]
) -> None:
    entries = []
    for key, value in checkpoint.get("state_dict", {}).items():
        tensors[f"sd.{key}"] = value
        entries.append([key, {"file": 0, "key": f"sd.{key}"}])
    meta["state_dict"] = entries
    meta["optimizers"] = []
    for j, state in enumerate(checkpoint.get("optimizer_states", []) if with_optimizer else []):
        refs: dict[str, dict[str, Any]] = {}
        for idx, per_param in state.get("state", {}).items():
            refs[str(idx)] = {}
            for key, value in per_param.items():
                if isinstance(value, torch.Tensor):
                    tensors[f"o{j}.{idx}.{key}"] = value
                    refs[str(idx)][key] = {"file": 0, "key": f"o{j}.{idx}.{key}"}
                else:
                    refs[str(idx)][key] = {"value": to_plain(value, {}, f"optimizer state {key!r}")}
        meta["optimizers"].append({"param_groups": to_plain(state.get("param_groups", []), {}, "param_groups"),
                                   "state": refs})
