"""The sharded checkpoint format: its description, and the names other layers import.

Note [sharded checkpoint format]
    A checkpoint named ``NAME`` is a symlink ``NAME -> NAME.v<K>`` to a directory holding

        metadata.json             format name and version, stage, world size, the layout of
                                  every flat group, where each state-dict key and optimizer
                                  state lives, and the plain Lightning state (loops, callbacks,
                                  LR schedulers, loss scaler, hyper-parameters; Note [plain
                                  checkpoint data])
        extra.safetensors         the tensors inside that Lightning state
        rank-RRRRR.safetensors    one per rank: that rank's shards ``g<i>.param``,
                                  ``g<i>.master`` (separate master only), ``g<i>.opt.<key>``
                                  (per-element optimizer state), ``g<i>.scalar.<key>`` (e.g.
                                  ``step``); rank 0 also holds whole tensors (``sd.<key>``:
                                  buffers and parameters outside flat groups; with stage 0 or
                                  without an engine: everything); the header's metadata holds
                                  the rank's RNG states

    With tensor parallelism (format version 2; a checkpoint without TP is written as version 1,
    and both are read) each TP rank writes its own slices, ``metadata.json`` records the TP size
    and every split key's dimension (``tensor_parallel``), and a split tensor is referred to as the
    whole made of its slices (Note [TP slices in checkpoints] in slices.py).

    Flat group ``i``'s shard of rank ``r`` covers elements ``[r*S, (r+1)*S)`` of its padded
    buffer (Note [flat shard layout]; a pipeline stage's groups name its own ranks' files, Note
    [pipelined shards] in collect.py); ``metadata.json`` lists every parameter's names, offset
    and shape, so a parameter's whole value (or any slice of it) is read back from the shards
    that overlap it, with ``safe_open(...).get_slice``, at any world size or stage. The
    canonical optimizer layout is torch's per-parameter ``state_dict`` (the one
    ``full_optimizer_state`` produces), assembled lazily the same way.

    Saving is atomic: every rank writes into ``NAME.tmp-<uuid>``; the ranks agree that all of
    them succeeded; rank 0 renames the directory to ``NAME.v<K>`` and replaces the symlink
    ``NAME`` with ``os.replace`` (atomic), then removes the version it replaced. A crash or an
    error before that leaves ``NAME`` pointing at the previous complete version.

    Reading never unpickles: JSON and safetensors only; any other file in the directory, a
    metadata file that is not JSON, a shard that is not safetensors are refused.

    Memory: a rank writes its shards from their own storage and reads back only the slices it
    owns, a bounded piece at a time (Note [streamed safetensors] in tensor_file.py, and
    Note [owned slices] in owned.py), so neither saving nor resuming holds a second copy of the
    training state.

    Where each part lives: ``layout.py`` (names), ``rng.py`` (RNG states), ``collect.py`` (what a
    rank writes), ``tensor_file.py`` (safetensors I/O), ``publish.py`` (atomic save),
    ``reader.py`` (opening, lazy whole tensors, ranges), ``owned.py`` (loading into shards),
    ``convert.py`` (one-file output, streamed), ``slices.py`` (TP slices of whole tensors).
"""

from __future__ import annotations

from lightning_zero.checkpoint.collect import collect
from lightning_zero.checkpoint.layout import EXTRA, FORMAT_NAME, FORMAT_VERSION, METADATA, rank_file
from lightning_zero.checkpoint.owned import load_owned_optimizer_state, load_owned_state_dict
from lightning_zero.checkpoint.publish import new_temporary, publish, remove, save_sharded, write_rank
from lightning_zero.checkpoint.reader import (
    LazyOptimizerState,
    LazyStateDict,
    ShardedCheckpoint,
    is_sharded_checkpoint,
    materialize_optimizer_state,
)
from lightning_zero.checkpoint.rng import capture_rng, restore_rng

__all__ = [
    "EXTRA", "FORMAT_NAME", "FORMAT_VERSION", "METADATA", "LazyOptimizerState", "LazyStateDict",
    "ShardedCheckpoint", "capture_rng", "collect", "is_sharded_checkpoint", "load_owned_optimizer_state",
    "load_owned_state_dict", "materialize_optimizer_state", "new_temporary", "publish", "rank_file", "remove",
    "restore_rng", "save_sharded", "write_rank",
]
