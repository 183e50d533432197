"""Draw docs/img/sparse_layout_*.png: head 0's ``make_layout`` of each sparsity config, as
docs/sparse_attention.md shows them. Run: python docs/img/make_sparse_layouts.py"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from lightning_zero.sparse_attention import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    LocalSlidingWindowSparsityConfig,
    VariableSparsityConfig,
)

SEQ_LEN, BLOCK = 512, 16  # 32 x 32 blocks
CONFIGS = {
    "dense": DenseSparsityConfig(1, block=BLOCK),
    "fixed": FixedSparsityConfig(1, block=BLOCK, num_local_blocks=4, num_global_blocks=1),
    "fixed_unidirectional": FixedSparsityConfig(1, block=BLOCK, num_local_blocks=4, attention="unidirectional"),
    "variable": VariableSparsityConfig(1, block=BLOCK, num_random_blocks=2, local_window_blocks=[2, 4, 8],
                                       global_block_indices=[0, 16], seed=0),
    "bigbird": BigBirdSparsityConfig(1, block=BLOCK, num_random_blocks=2, num_sliding_window_blocks=3,
                                     num_global_blocks=1, seed=0),
    "bslongformer": BSLongformerSparsityConfig(1, block=BLOCK, num_sliding_window_blocks=5,
                                               global_block_indices=[0, 16]),
    "local_sliding_window": LocalSlidingWindowSparsityConfig(1, block=BLOCK, num_sliding_window_blocks=5),
}


def main() -> None:
    out = Path(__file__).resolve().parent
    for name, config in CONFIGS.items():
        layout = config.make_layout(SEQ_LEN)[0]
        fig, ax = plt.subplots(figsize=(3, 3), dpi=100)
        ax.imshow(layout.numpy(), cmap="Blues", vmin=0, vmax=1.3, interpolation="nearest")
        ax.set_title(f"{name}: {layout.float().mean():.0%} of blocks", fontsize=9)
        ax.set_xlabel("key block", fontsize=8)
        ax.set_ylabel("query block", fontsize=8)
        ax.tick_params(labelsize=7)
        fig.tight_layout()
        fig.savefig(out / f"sparse_layout_{name}.png")
        plt.close(fig)
        print(os.path.relpath(out / f"sparse_layout_{name}.png"))


if __name__ == "__main__":
    main()
