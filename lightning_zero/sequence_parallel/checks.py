"""The sequence-parallel size against what a run splits (the world, the model's heads, the data's length), refused
before any rank starts where it can be, each with the fix. Its combinations with the other parallel sizes are rules
of the settings tree (``core/settings/rules.py``)."""

from __future__ import annotations


def check_sequence_parallel(size: int, *, world_size: int | None = None, heads: int | None = None,
                            seq_len: int | None = None) -> None:
    """Raise ``ValueError`` naming the fix when ``size`` cannot split this run (what is known is checked).

    Args:
        size: ranks per sequence group.
        world_size: all ranks (devices x nodes): must be a multiple of ``size``.
        heads: attention heads of the model: divisible by ``size`` (each rank attends with ``heads / size``).
        seq_len: tokens per sample: divisible by ``size`` (each rank holds ``seq_len / size``).
    """
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"sequence_parallel must be a positive integer, got {size!r}")
    if size == 1:
        return
    if world_size is not None and world_size % size:
        raise ValueError(f"sequence_parallel={size} does not divide the {world_size} ranks: launch a multiple of "
                         f"{size} ranks (trainer.devices x trainer.num_nodes), or choose a size dividing {world_size}")
    if heads is not None and heads % size:
        fits = [n for n in range(1, heads + 1) if heads % n == 0]
        raise ValueError(f"the model's {heads} attention heads do not split over sequence_parallel={size}: choose a "
                         f"size dividing the heads ({fits}) or a model with a multiple of {size} heads")
    if seq_len is not None and seq_len % size:
        raise ValueError(f"a sequence of {seq_len} tokens does not split over sequence_parallel={size}: use a "
                         f"sequence length that is a multiple of {size} (data.seq_len / model.seq_len)")
