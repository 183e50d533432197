"""The six sparsity configs give DeepSpeed's layouts (tests/deepspeed_sparsity_config.py, vendored)
on a grid of arguments: equal block for block, random blocks included under the same ``random.seed``;
with a private ``seed`` the fixed part is equal and each row holds its random draws."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from lightning_zero import sparse_attention as ours
from tests import deepspeed_sparsity_config as ds

SEQ_LENS = (16 * 7, 16 * 16, 16 * 21)  # 7, 16, 21 blocks: short last windows included


def _grid() -> list[tuple[str, dict]]:
    cases: list[tuple[str, dict]] = [("DenseSparsityConfig", {"num_heads": 2})]
    for local, glob, attention, horizontal, per_head, patterns in itertools.product(
            (4, 6), (1, 2), ("bidirectional", "unidirectional"), (False, True), (False, True), (1, 2)):
        if (horizontal and attention == "unidirectional") or (patterns > 1 and not per_head) or local % glob:
            continue
        cases.append(("FixedSparsityConfig", dict(
            num_heads=4, different_layout_per_head=per_head, num_local_blocks=local, num_global_blocks=glob,
            attention=attention, horizontal_global_attention=horizontal, num_different_global_patterns=patterns)))
    for rnd, windows, (starts, ends), attention, horizontal, per_head in itertools.product(
            (0, 2), ([4], [2, 3, 5]), (([0], None), ([1, 9], None), ([0, 5], [2, 8])),
            ("bidirectional", "unidirectional"), (False, True), (False, True)):
        if horizontal and attention == "unidirectional":
            continue
        cases.append(("VariableSparsityConfig", dict(
            num_heads=3, different_layout_per_head=per_head, num_random_blocks=rnd, local_window_blocks=windows,
            global_block_indices=starts, global_block_end_indices=ends, attention=attention,
            horizontal_global_attention=horizontal)))
    for rnd, window, glob, attention, per_head in itertools.product(
            (0, 1), (3, 5), (1, 2), ("bidirectional", "unidirectional"), (False, True)):
        cases.append(("BigBirdSparsityConfig", dict(
            num_heads=3, different_layout_per_head=per_head, num_random_blocks=rnd,
            num_sliding_window_blocks=window, num_global_blocks=glob, attention=attention)))
    for window, (starts, ends), attention, per_head in itertools.product(
            (3, 4), (([0], None), ([2, 30], None), ([1, 5], [3, 9])), ("bidirectional", "unidirectional"),
            (False, True)):
        cases.append(("BSLongformerSparsityConfig", dict(
            num_heads=2, different_layout_per_head=per_head, num_sliding_window_blocks=window,
            global_block_indices=starts, global_block_end_indices=ends, attention=attention)))
    for window, attention in itertools.product((1, 3, 4, 7), ("bidirectional", "unidirectional")):
        cases.append(("LocalSlidingWindowSparsityConfig",
                      dict(num_heads=2, num_sliding_window_blocks=window, attention=attention)))
    return cases


@pytest.mark.parametrize("name,kwargs", _grid(), ids=lambda x: x if isinstance(x, str) else "")
def test_layouts_equal_deepspeed(name: str, kwargs: dict) -> None:
    for seq_len, block in itertools.product(SEQ_LENS, (16,)):
        random.seed(seq_len)
        expected = getattr(ds, name)(block=block, **kwargs).make_layout(seq_len)
        random.seed(seq_len)
        got = getattr(ours, name)(block=block, **kwargs).make_layout(seq_len)
        assert got.dtype == expected.dtype and got.shape == expected.shape
        assert torch.equal(got, expected), f"{name}({kwargs}) at seq_len {seq_len}"


@pytest.mark.parametrize("name,kwargs", [
    ("VariableSparsityConfig", dict(num_heads=2, num_random_blocks=3, local_window_blocks=[4])),
    ("BigBirdSparsityConfig", dict(num_heads=2, num_random_blocks=2, different_layout_per_head=True)),
    ("BigBirdSparsityConfig", dict(num_heads=2, num_random_blocks=1, attention="unidirectional")),
])
def test_seeded_random_blocks_keep_the_fixed_part_and_the_count_per_row(name: str, kwargs: dict) -> None:
    seq_len = 16 * 20
    fixed = getattr(ds, name)(**{**kwargs, "num_random_blocks": 0}).make_layout(seq_len)
    reference = getattr(ds, name)(**kwargs).make_layout(seq_len)
    layouts = [getattr(ours, name)(**kwargs, seed=s).make_layout(seq_len) for s in (1, 1, 2)]
    assert torch.equal(layouts[0], layouts[1]) and not torch.equal(layouts[0], layouts[2])  # the seed decides
    for layout in layouts:
        assert torch.equal(layout * fixed, fixed)  # the fixed part is there
        extra = (layout - fixed).sum(-1)  # random blocks outside the fixed part, per row
        ref_extra = (reference - fixed).sum(-1)
        assert extra.max() <= kwargs["num_random_blocks"] and ref_extra.max() <= kwargs["num_random_blocks"]
        # every row holds its distinct random draws (row r of a unidirectional layout draws from r + 1 blocks)
        population = torch.arange(1, layout.shape[1] + 1) if kwargs.get("attention") == "unidirectional" else \
            torch.full((layout.shape[1],), layout.shape[1])
        assert (layout.sum(-1) >= population.clamp(max=kwargs["num_random_blocks"])).all()
        assert extra.sum() > 0  # and some of them fall outside the fixed part
        if kwargs.get("attention") == "unidirectional":
            assert torch.equal(layout, torch.tril(layout))


@pytest.mark.parametrize("make,match", [
    (lambda: ours.FixedSparsityConfig(4, num_local_blocks=4, num_global_blocks=3), "multiple of num_global"),
    (lambda: ours.FixedSparsityConfig(4, attention="unidirectional", horizontal_global_attention=True),
     "bidirectional"),
    (lambda: ours.FixedSparsityConfig(4, num_different_global_patterns=2), "different_layout_per_head"),
    (lambda: ours.BSLongformerSparsityConfig(2, global_block_indices=[3], global_block_end_indices=[2]), "smaller"),
    (lambda: ours.DenseSparsityConfig(2, block=16).make_layout(40), "pad_to_block_size"),
    (lambda: ours.BigBirdSparsityConfig(2, num_sliding_window_blocks=9).make_layout(64), "exceeds"),
])
def test_bad_arguments_are_refused_with_the_reason(make, match: str) -> None:
    with pytest.raises((ValueError, NotImplementedError), match=match):
        make()
