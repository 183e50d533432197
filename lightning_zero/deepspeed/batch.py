"""DeepSpeed's batch-size triple: ``train_batch_size = micro-batch x accumulation steps x data-parallel size``.

Two of the three keys suffice (DeepSpeed derives the third); one of ``train_batch_size`` /
``train_micro_batch_size_per_gpu`` alone means no accumulation. The triple can only be checked
once the data-parallel world size is known: :meth:`BatchSizes.resolve` takes it.
"""

from __future__ import annotations

from dataclasses import dataclass

TBS, MICRO, GAS = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"


@dataclass(frozen=True)
class ResolvedBatch:
    """The complete triple for one world size."""

    train_batch_size: int
    micro_batch_size: int
    accumulation_steps: int
    world_size: int


@dataclass(frozen=True)
class BatchSizes:
    """The batch keys as the config gives them (``None``: not given)."""

    train_batch_size: int | None = None
    micro_batch_size: int | None = None
    accumulation_steps: int | None = None

    def __post_init__(self) -> None:
        for key, value in self._items():
            if value is not None and value < 1:
                raise ValueError(f"`{key}` must be a positive integer, got {value!r}.")
        if self.accumulation_steps is not None and self.train_batch_size is None and self.micro_batch_size is None:
            raise ValueError(f"`{GAS}` alone does not define a batch size: also give `{TBS}` or `{MICRO}` "
                             "(two of the three keys suffice).")

    def _items(self) -> list[tuple[str, int | None]]:
        return [(TBS, self.train_batch_size), (MICRO, self.micro_batch_size), (GAS, self.accumulation_steps)]

    @property
    def gives_accumulation(self) -> bool:
        """Whether the keys fix the accumulation steps (given, or derived from ``train_batch_size``)."""
        return self.accumulation_steps is not None or self.train_batch_size is not None

    @property
    def given(self) -> bool:
        """Whether the config gives any batch key."""
        return any(v is not None for _, v in self._items())

    def resolve(self, world_size: int) -> ResolvedBatch | None:
        """The full triple for ``world_size`` data-parallel ranks (``None`` when no key is given).

        Raises:
            ValueError: the keys cannot hold at this world size; the message says what would fix it.
        """
        tbs, micro, gas = self.train_batch_size, self.micro_batch_size, self.accumulation_steps
        if tbs is None and micro is None:
            return None
        if world_size < 1:
            raise ValueError(f"the data-parallel world size must be >= 1, got {world_size}.")
        if tbs is None:
            assert micro is not None
            gas = gas or 1
            return ResolvedBatch(micro * gas * world_size, micro, gas, world_size)
        if micro is not None and gas is not None:
            if tbs != micro * gas * world_size:
                raise ValueError(self._mismatch(world_size))
            return ResolvedBatch(tbs, micro, gas, world_size)
        known_name, known = (MICRO, micro) if micro is not None else (GAS, gas or 1)
        per_step = known * world_size
        if tbs % per_step:
            raise ValueError(self._not_divisible(world_size, known_name, known))
        other = tbs // per_step
        if micro is not None:
            return ResolvedBatch(tbs, micro, other, world_size)
        return ResolvedBatch(tbs, other, gas or 1, world_size)

    def _mismatch(self, world_size: int) -> str:
        tbs, micro, gas = self.train_batch_size, self.micro_batch_size, self.accumulation_steps
        assert tbs is not None and micro is not None and gas is not None
        product = micro * gas * world_size
        fits = f", or run on {tbs // (micro * gas)} data-parallel ranks" if tbs % (micro * gas) == 0 else ""
        return (f"{TBS}={tbs} does not equal {MICRO}={micro} x {GAS}={gas} x data-parallel world size "
                f"{world_size} = {product}. Fix: {TBS}={product}, or drop one of the three keys (two suffice; "
                f"the third is derived){fits}.")

    def _not_divisible(self, world_size: int, known_name: str, known: int) -> str:
        tbs = self.train_batch_size
        assert tbs is not None
        per_step = known * world_size
        low, high = (tbs // per_step) * per_step, (tbs // per_step + 1) * per_step
        sizes = [n for n in range(1, tbs // known + 1) if (tbs // known) % n == 0] if tbs % known == 0 else []
        what = f"{known_name}={known}" if known_name != GAS or self.accumulation_steps else "1 accumulation step"
        choices = " or ".join(str(v) for v in (low, high) if v > 0)
        ranks = f", or a data-parallel world size in {sizes}" if sizes else ""
        return (f"{TBS}={tbs} is not divisible by {what} x data-parallel world size {world_size} = {per_step}, "
                f"so the other batch key cannot be derived. Fix: {TBS}={choices} (a multiple of {per_step}){ranks}.")
