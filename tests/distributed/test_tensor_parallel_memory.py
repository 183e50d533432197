"""Tensor parallel is what makes a layer bigger than a rank fit (issue 31): under a memory limit below one
layer's whole parameters + gradients, 2 ranks train it with TP 2 and fail without it (ZeRO-3 still gathers
the layer whole to compute it).

The limit is ``RLIMIT_DATA`` (the process's private writable memory, where tensors live), set relative to
the rank's current ``VmData`` as in tests/e2e/test_large_models.py; the failure is checked by the allocator's
own error.
"""

from __future__ import annotations

import re
import resource
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero import TensorParallelConfig, ZeroStrategy
from lightning_zero.testing.memory import proc_status_bytes
from tests.models import make_trainer
from tests.pool import GlooPool

DIM = 6144  # one Linear(6144, 6144): 37.8M parameters, 151 MB in fp32
LAYER_BYTES = (DIM * DIM + DIM) * 4
# Just below the layer's whole parameters + gradients, what computing it unsplit holds (ZeRO-3's step also
# keeps this rank's shards: 2.5 x the layer in all). Above what building it needs, with TP or without: the
# layer whole once per rank plus this rank's half cut from it (Note [slice after build]; ZeRO-3's sharded
# construction likewise holds one unit whole while it keeps its shard), 1.5 x the layer, plus the fit's own
# allocations (new process groups' threads, Lightning).
LIMIT = int(0.97 * 2 * LAYER_BYTES)


class OneWideLayer(pl.LightningModule):
    """A model that is one wide layer (its output all-gathered under TP), trained with plain SGD, so that
    the layer, not the optimizer state, is what does not fit. Built in ``configure_model``: without TP, ZeRO-3
    constructs it shard by shard (never whole on a rank, tests/e2e/test_large_models.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.wide: nn.Linear | None = None
        self.reached_training = False

    def configure_model(self) -> None:
        if self.wide is None:  # on the meta device under ZeRO-3, sharded as it is built
            self.wide = nn.Linear(DIM, DIM)

    def tensor_parallel_plan(self) -> dict[str, str]:
        return {"wide": "colwise_gather_output"}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.reached_training = True
        x, y = batch
        return nn.functional.mse_loss(torch.tanh(self.wide(x)), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def limited_fit_body(tensor_parallel: int) -> dict[str, Any]:
    """Under ``RLIMIT_DATA`` = VmData + LIMIT: whether the layer's whole params + grads could be allocated,
    then the model built and 2 steps, at ZeRO-3 without TP or at TP 2; the error if the fit raised."""
    import gc

    gc.collect()
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    out: dict[str, Any] = {"error": None}
    try:
        resource.setrlimit(resource.RLIMIT_DATA, (proc_status_bytes("VmData") + LIMIT, hard))
        try:  # the limit really is below one layer's parameters and gradients, whole
            torch.empty(2 * LAYER_BYTES // 4)
            out["layer_fits"] = True
        except (RuntimeError, MemoryError):
            out["layer_fits"] = False
        torch.manual_seed(0)
        model = OneWideLayer()
        if tensor_parallel > 1:  # TP slices the built weights (Note [slice after build]): built whole once per rank
            model.configure_model()
        g = torch.Generator().manual_seed(1)
        data = TensorDataset(torch.randn(8, DIM, generator=g), torch.rand(8, DIM, generator=g))
        tp = TensorParallelConfig(tensor_parallel) if tensor_parallel > 1 else None
        # without TP: ZeRO-3, the most ZeRO partitions; with TP 2 on 2 ranks there is one data rank, and stage 1
        # (at one data rank stages 2 and 3 keep a bucket's or a unit's whole gradient beside their gradient
        # shard, which is the whole: more memory, not less)
        strategy = (ZeroStrategy(stage=1, tensor_parallel=tp) if tp else
                    ZeroStrategy(stage=3, param_persistence_threshold=0, gather_on_teardown=False))
        trainer = make_trainer(strategy, devices=2, max_steps=2)
        try:
            trainer.fit(model, DataLoader(data, batch_size=4))
        except RuntimeError as err:
            out["error"] = str(err)
        out["steps"] = trainer.global_step
        out["reached_training"] = model.reached_training
        out["rank_params"] = sum(p.numel() for p in model.parameters())
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
        gc.collect()
    return out


@pytest.mark.distributed
@pytest.mark.slow
def test_a_layer_bigger_than_the_memory_limit_trains_with_tp2_and_fails_without(gloo_pool: GlooPool) -> None:
    """Without TP, ZeRO-3 on 2 ranks builds the layer as shards (setup fits) but gathers it whole to compute it:
    the first step runs out of memory (the allocator's error). With TP 2 each rank computes with its half."""
    without = gloo_pool.run("tests.distributed.test_tensor_parallel_memory:limited_fit_body", tensor_parallel=1,
                            _timeout_s=300)
    with_tp = gloo_pool.run("tests.distributed.test_tensor_parallel_memory:limited_fit_body", tensor_parallel=2,
                            _timeout_s=300)
    for r in without:
        assert r["layer_fits"] is False, r
        assert r["reached_training"] and r["steps"] == 0, r  # set up fine, failed inside the first step
        assert r["error"] is not None and "can't allocate memory" in r["error"], r
        tried = int(re.search(r"you tried to allocate (\d+) bytes", r["error"]).group(1))
        assert tried >= DIM * DIM * 4, r  # the layer's whole weight or gradient, not some small allocation
    for r in with_tp:
        assert r["layer_fits"] is False, r
        assert r["error"] is None and r["steps"] == 2, r
        assert r["rank_params"] == DIM * DIM // 2 + DIM // 2, r  # this rank's half of the layer
