"""Tensor parallel (issue 31) semantics beyond parity at dropout 0: dropout streams (replicated activations
share a mask across the TP group, split ones do not), the fp16 overflow decision of a TP group, and the
refusals of heads that do not split and of 1-bit Adam x TP. Cheap: one process, or the 2-rank gloo pool."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.checkpoint import checkpoint

from lightning_zero import ZeroStrategy
from lightning_zero.models.gpt import GPTLightningModule
from lightning_zero.models.gpt_blocks import CausalSelfAttention
from lightning_zero.tensor_parallel import split_dim
from lightning_zero.tensor_parallel.rng import SplitRegionRNG
from tests.distributed.test_tensor_parallel import CONFIG, RecordedLosses, _loader, _Recorded
from tests.models import make_trainer
from tests.pool import GlooPool

DROPOUT = replace(CONFIG, dropout=0.2)


# ------------------------------------------------------------------------------------------- one process
def _attention_grads(tp_rank: int, recompute: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The attention output, its input's gradient and the default generator's state after, with the split
    stream of TP rank ``tp_rank`` on the q/k/v projection (as ``apply_plan`` attaches it)."""
    torch.manual_seed(0)
    attn = CausalSelfAttention(replace(DROPOUT, dropout=0.5)).train()
    attn.qkv.tp_rng = SplitRegionRNG(tp_rank)
    x = torch.randn(2, DROPOUT.seq_len, DROPOUT.n_embd, requires_grad=True)
    torch.manual_seed(123)  # the step's default stream: the same on every TP rank
    y = checkpoint(attn, x, use_reentrant=False) if recompute else attn(x)
    after = torch.get_rng_state()
    y.sum().backward()
    assert x.grad is not None
    return y.detach(), x.grad, after


def test_split_region_masks_differ_per_tp_rank_and_recompute_draws_the_forward_masks() -> None:
    """Heads split over TP ranks draw their own masks (rank 0's and rank 1's attention differ from the same
    input), the default stream advances alike on every TP rank (replicated dropout after stays in sync), and
    activation checkpointing (ZeRO's ``activation_checkpointing``, a pipeline's interval) recomputes the
    forward's masks: its input gradient is the one without recompute."""
    y0, g0, after0 = _attention_grads(0, recompute=False)
    y1, _, after1 = _attention_grads(1, recompute=False)
    assert not torch.equal(y0, y1)  # different masks on the split heads
    assert torch.equal(after0, after1)  # the replicated stream is untouched by the rank's own stream
    y0c, g0c, after0c = _attention_grads(0, recompute=True)
    assert torch.equal(y0, y0c) and torch.equal(after0, after0c)
    assert torch.equal(g0, g0c), float((g0 - g0c).abs().max())


# ------------------------------------------------------------------------------------------- distributed
class _Dropout(GPTLightningModule):
    def __init__(self) -> None:
        super().__init__(DROPOUT, lr=1e-2, warmup_steps=0)
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.losses.append(float(loss.detach()))
        return loss


def dropout_body(stage: int, rank_seeds: bool) -> dict[str, Any]:
    """TP 2 on 2 ranks with dropout 0.2, 4 steps: this rank's losses and replicated parameters (layer norms,
    position embedding, biases after the row-parallel sums). ``rank_seeds``: every rank's default generator
    seeded differently after the model is built, as processes that nobody seeded (no ``seed_everything``)."""
    import torch.distributed as dist

    torch.manual_seed(0)
    module = _Dropout()
    if rank_seeds:
        torch.manual_seed(1000 + dist.get_rank())
    strategy = ZeroStrategy(stage=stage, tensor_parallel=2)
    trainer = make_trainer(strategy, devices=2, max_steps=4, gradient_clip_val=1.0)
    trainer.fit(module, _loader(1))
    replicated = {n: p.detach().clone() for n, p in module.named_parameters() if split_dim(p) is None}
    return {"losses": module.losses, "replicated": replicated}


@pytest.mark.distributed
@pytest.mark.parametrize("rank_seeds", [False, True], ids=["seeded", "unseeded"])
def test_replicated_parameters_stay_identical_across_tp_ranks_with_dropout(gloo_pool: GlooPool,
                                                                           rank_seeds: bool) -> None:
    """The residual stream's dropout (after the row-parallel sums, on the embeddings) must draw the same mask
    on both TP ranks, or the replicated parameters drift apart silently: bitwise equal after 4 steps, and
    the same losses on both ranks, whether or not the processes' generators were seeded alike."""
    results = gloo_pool.run("tests.distributed.test_tensor_parallel_semantics:dropout_body", stage=1,
                            rank_seeds=rank_seeds)
    a, b = results
    assert a["losses"] == b["losses"], (a["losses"], b["losses"])
    assert len(a["replicated"]) > 4 and a["replicated"].keys() == b["replicated"].keys()
    differ = {n: float((a["replicated"][n] - b["replicated"][n]).abs().max())
              for n in a["replicated"] if not torch.equal(a["replicated"][n], b["replicated"][n])}
    assert not differ, differ


POISONED = "model.blocks.0.mlp.fc.weight"  # column-parallel: each TP rank holds its own half


class _Poisoned(GPTLightningModule):
    """The GPT whose rank ``rank`` alone gets ``value`` (an inf) in its slice of a split weight's gradient at batch
    1 (``config``: the GPT's shape, ``CONFIG``'s by default)."""

    def __init__(self, rank: int = 1, value: float = float("inf"), config: Any = CONFIG) -> None:
        super().__init__(config, lr=1e-2, warmup_steps=0)
        self._poison_now, self._rank, self._value = False, rank, value

    def on_train_start(self) -> None:  # after the plan replaced the layer: hook this rank's slice
        self.get_parameter(POISONED).register_hook(self._poison)

    def _poison(self, grad: torch.Tensor) -> torch.Tensor:
        if not self._poison_now:
            return grad
        self._poison_now = False
        grad = grad.clone()
        grad[0, 1] = self._value
        return grad

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        import torch.distributed as dist

        self._poison_now = batch_idx == 1 and dist.get_rank() == self._rank
        return self.loss(batch)


def overflow_body(stage: int) -> list[dict[str, Any]]:
    """fp16, TP 2 on 2 ranks, 3 steps, hysteresis 1: per step, whether this rank's parameters changed, its
    loss scale before and after, its skipped-step count, and its split weight's shape."""

    from lightning_zero import ZeroPrecision
    from lightning_zero.core.settings.precision import LossScalerConfig

    steps: list[dict[str, Any]] = []

    class Recorder(pl.Callback):
        def on_train_batch_start(self, trainer: Any, module: Any, *args: Any) -> None:
            steps.append({"before": [p.detach().clone() for p in module.parameters()],
                          "scale_before": trainer.strategy.loss_scale})

        def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
            before = steps[-1].pop("before")
            after = [p.detach().clone() for p in module.parameters()]
            steps[-1].update(same=all(torch.equal(a, b) for a, b in zip(before, after, strict=True)),
                             scale_after=trainer.strategy.loss_scale, skipped=trainer.strategy.skipped_steps,
                             shape=tuple(module.get_parameter(POISONED).shape))

    torch.manual_seed(0)
    scaler = LossScalerConfig(initial_scale_power=8, hysteresis=1)  # 2**8: the tiny GPT never overflows
    strategy = ZeroStrategy(stage=stage, tensor_parallel=2, precision=ZeroPrecision("16-mixed", loss_scaler=scaler))
    make_trainer(strategy, devices=2, max_steps=3, callbacks=[Recorder()]).fit(_Poisoned(), _loader(1))
    return steps


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [1, 3])
def test_an_inf_in_one_tp_ranks_slice_skips_the_step_and_backs_off_on_every_rank(gloo_pool: GlooPool,
                                                                                  stage: int) -> None:
    """fp16: TP rank 1 alone sees an inf in its slice of a split gradient at step 1; both ranks skip that step
    (no parameter changes) and halve the scale together, and both step before and after."""
    results = gloo_pool.run("tests.distributed.test_tensor_parallel_semantics:overflow_body", stage=stage)
    for rank, steps in enumerate(results):
        assert [s["same"] for s in steps] == [False, True, False], (rank, steps)
        assert [(s["scale_before"], s["scale_after"]) for s in steps] == [(256.0, 256.0), (256.0, 128.0),
                                                                          (128.0, 128.0)], (rank, steps)
        assert [s["skipped"] for s in steps] == [0, 1, 1], (rank, steps)
        assert steps[0]["shape"] == (2 * CONFIG.n_embd, CONFIG.n_embd)  # the slice: (4 n_embd) x n_embd cut in two


# ------------------------------------------------------------------------------------------- refusals
def test_heads_or_kv_heads_that_do_not_split_are_refused_with_the_sizes_that_would() -> None:
    """``check_heads`` (run by the strategy before the plan changes anything): the GPT's ``n_head`` and a
    Hugging Face config's ``num_attention_heads`` / ``num_key_value_heads``, each naming the fix."""
    from types import SimpleNamespace

    from torch import nn

    from lightning_zero.tensor_parallel.plan import check_heads

    gpt = GPTLightningModule(CONFIG)  # 4 heads
    check_heads(gpt, 2)
    check_heads(gpt, 4)
    with pytest.raises(ValueError, match=r"4 attention heads do not split over tensor_parallel=3: choose a "
                                         r"tensor-parallel size dividing 4"):
        check_heads(gpt, 3)
    hf = nn.Module()
    hf.model = nn.Module()
    hf.model.config = SimpleNamespace(num_attention_heads=8, num_key_value_heads=2)  # GQA, HF's names
    check_heads(hf, 2)
    with pytest.raises(ValueError, match=r"^model: 2 KV heads do not split over tensor_parallel=4: choose a "
                                         r"tensor-parallel size dividing 2$"):
        check_heads(hf, 4)
    hf.model.config.num_key_value_heads = None  # HF: no GQA, as many KV heads as heads
    check_heads(hf, 8)


def onebit_body() -> str:
    """A fit of the GPT with 1-bit Adam at TP 2: the error it stops with (before any step)."""
    import torch.distributed as dist

    module = GPTLightningModule(CONFIG, optimizer="onebit_adam", warmup_steps=0)
    trainer = make_trainer(ZeroStrategy(stage=0, tensor_parallel=2), devices=2, max_steps=1)
    try:
        trainer.fit(module, _loader(1))
    except ValueError as e:
        return f"{dist.get_rank()}: {e}"
    return "trained"


@pytest.mark.distributed
def test_one_bit_adam_with_tp_is_refused_at_setup_naming_the_fix(gloo_pool: GlooPool) -> None:
    for rank, message in enumerate(gloo_pool.run("tests.distributed.test_tensor_parallel_semantics:onebit_body")):
        assert message.startswith(f"{rank}: tensor_parallel with 1-bit Adam is not built yet"), message
        assert "use AdamW / Adam / SGD, or drop tensor_parallel" in message, message


# ------------------------------------------------------------------------------------------- plans
class _Stack(RecordedLosses):
    """Two column- then row-parallel pairs for ``plan='auto'`` in an ``nn.Sequential`` (a LayerNorm between)."""

    def __init__(self) -> None:
        super().__init__()
        from torch import nn

        self.net = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8), nn.LayerNorm(8), nn.Linear(8, 16),
                                 nn.Tanh(), nn.Linear(16, 4))

    def loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)


def plans_body() -> dict[str, Any]:
    """TP 2, 3 steps each: the GPT under its own plan and under the same plan written by a user in torch's
    styles (torchtitan's ``RowwiseParallel(input_layouts=Replicate())`` on the token embedding; ours for the fused
    q/k/v, where torch has no style), and an ``nn.Sequential`` stack under ``plan='auto'`` with the
    unsplit stack trained in this process on the same batches."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_zero import TensorParallelConfig
    from lightning_zero.tensor_parallel import Colwise

    torch_style = {"model.tok_emb": RowwiseParallel(input_layouts=Replicate()),
                   "model.blocks.*.attn.qkv": Colwise(chunks=3),
                   "model.blocks.*.attn.proj": RowwiseParallel(), "model.blocks.*.mlp.fc": ColwiseParallel(),
                   "model.blocks.*.mlp.proj": RowwiseParallel(), "model.lm_head": ColwiseParallel()}
    out: dict[str, Any] = {}
    for name, plan in (("named", None), ("torch", torch_style)):
        torch.manual_seed(0)
        module = _Recorded()
        strategy = ZeroStrategy(stage=1, tensor_parallel=TensorParallelConfig(2, plan=plan))
        make_trainer(strategy, devices=2, max_steps=3).fit(module, _loader(1))
        out[name] = {"losses": module.losses, "split": list(strategy._run.tensor.split) if strategy._run.tensor else []}
    g = torch.Generator().manual_seed(3)
    data = TensorDataset(torch.randn(12, 8, generator=g), torch.randn(12, 4, generator=g))
    torch.manual_seed(0)
    reference = _Stack()
    opt = reference.configure_optimizers()
    for batch in DataLoader(data, batch_size=4):
        loss = reference.loss(batch)
        reference.losses.append(float(loss))
        loss.backward()
        opt.step()
        opt.zero_grad()
    torch.manual_seed(0)
    stack = _Stack()
    strategy = ZeroStrategy(stage=1, tensor_parallel=TensorParallelConfig(2, plan="auto"))
    make_trainer(strategy, devices=2, max_steps=3).fit(stack, DataLoader(data, batch_size=4))
    out["auto"] = {"losses": stack.losses, "reference": reference.losses, "split": list(strategy._run.tensor.split),
                   "shapes": {n: tuple(p.shape) for n, p in stack.named_parameters()}}
    return out


@pytest.mark.distributed
def test_a_torch_style_plan_and_auto_train_as_the_named_plan_and_the_unsplit_model(gloo_pool: GlooPool) -> None:
    """The GPT's plan given as a dict in torch's vocabulary splits the same modules and gives the very losses of
    the named plan; ``plan='auto'`` on a Sequential stack splits both Linear pairs and follows the unsplit
    stack (losses within 1e-6 relative)."""
    for out in gloo_pool.run("tests.distributed.test_tensor_parallel_semantics:plans_body"):
        assert out["torch"]["split"] == out["named"]["split"] and len(out["named"]["split"]) == 10, out
        assert out["torch"]["losses"] == out["named"]["losses"] and len(out["named"]["losses"]) == 3, out
        auto = out["auto"]
        assert auto["split"] == ["net.0", "net.2", "net.4", "net.6"], auto
        assert auto["shapes"]["net.0.weight"] == (16, 8) and auto["shapes"]["net.6.weight"] == (4, 8), auto
        assert auto["shapes"]["net.6.bias"] == (4,)  # added once, after the row-parallel sum
        rel = [abs(a - b) / abs(b) for a, b in zip(auto["losses"], auto["reference"], strict=True)]
        assert len(rel) == 3 and max(rel) < 1e-6, (auto["losses"], auto["reference"])


def test_a_dropout_between_a_column_and_a_row_parallel_layer_draws_the_tp_ranks_masks() -> None:
    """``plan='auto'`` on a stack: the dropout inside the split region draws per-TP-rank masks (TP rank 1's
    differ from rank 0's on the same input), the one after the row-parallel sum stays on the default stream,
    which both ranks leave in the same state."""
    from torch import nn

    from lightning_zero.tensor_parallel.collectives import TPGroup
    from lightning_zero.tensor_parallel.plan import apply_plan, auto_plan, resolve_plan
    from lightning_zero.tensor_parallel.rng import SplitRegionDropout

    stack = nn.Sequential(nn.Linear(8, 64), nn.GELU(), nn.Dropout(0.5), nn.Linear(64, 8), nn.Dropout(0.5))
    apply_plan(stack, resolve_plan(stack, auto_plan(stack), "plan='auto'"), TPGroup.single())
    assert isinstance(stack[2], SplitRegionDropout) and type(stack[4]) is nn.Dropout
    x = torch.randn(4, 8)
    outputs, states = [], []
    for rank in (0, 1):
        stack[2].tp_rng = SplitRegionRNG(rank)
        torch.manual_seed(5)
        outputs.append(stack[:3](x))  # the split activations after their dropout
        states.append(torch.get_rng_state())
    assert not torch.equal(outputs[0] == 0, outputs[1] == 0)  # different masks
    assert torch.equal(states[0], states[1])
