"""ZeroStrategy on one CUDA device (skipped without a GPU): stages 0-3 train alike, offload with pinned
host memory (whose non-blocking copies are ordered by CUDA events, Note [asynchronous host copies] in
core/offload/copy_fence.py) equals the same stage without offload, and fp16 / bf16 mixed precision track fp32;
block-sparse attention trains through FlexAttention like dense attention masked by its layout; tensor-parallel
slices left on the CPU after a fit are gathered over NCCL (issue 41, item 6: one rank on one GPU, and a TP 2 fit
saved after it on two GPUs).

Every run trains a tiny transformer for 6 steps on ``cuda:0`` with ``devices=1`` (no process group), but the
NCCL ones.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_zero import ZeroPrecision, ZeroStrategy
from lightning_zero.core.settings.offload import OffloadConfig
from lightning_zero.core.settings.precision import LossScalerConfig
from tests.models import STAGE3_SHARDED, TinyTransformer, make_trainer, token_loader
from tests.unit.test_sparse_attention import CONFIGS as SPARSE_CONFIGS
from tests.unit.test_sparse_attention import _inputs as sparse_inputs
from tests.unit.test_sparse_attention import dense_reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

STEPS = 6


class FusedTiny(TinyTransformer):
    """AdamW with the fused kernel on both sides of an offload comparison (offload steps it on the CPU)."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        optimizer = super().configure_optimizers()
        for group in optimizer.param_groups:
            group["fused"], group["foreach"] = True, False
        return optimizer


class PinCheck(TinyTransformer):
    """Records, at every step, whether the offload's host buffers are pinned and where the params live."""

    def __init__(self) -> None:
        super().__init__("adamw")
        self.pinned: list[bool] = []
        self.devices: set[str] = set()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        store = self.trainer.strategy.engine.sharded.offload
        buffers = [*store.host_grads.values(), *self.trainer.strategy.engine.sharded.masters]
        if store.params is not None:
            buffers += list(store.params.homes.values())
        self.pinned.append(bool(buffers) and all(t.is_pinned() for t in buffers))
        self.devices.update(p.device.type for p in self.parameters() if p.requires_grad)


def _fit(model: TinyTransformer, stage: int, precision: str = "32-true", **kwargs: Any) -> TinyTransformer:
    # fp16: a loss scale that does not overflow at the start, so no step is skipped against the fp32 run
    scaler = LossScalerConfig(initial_scale_power=8) if precision == "16-mixed" else None
    strategy = ZeroStrategy(stage=stage, precision=ZeroPrecision(precision, loss_scaler=scaler), monitor=False,
                            **(STAGE3_SHARDED if stage == 3 else {}), **kwargs)
    make_trainer(strategy, devices=1, accelerator="gpu", max_steps=STEPS).fit(model, token_loader(n=48))
    return model


def _params(model: TinyTransformer) -> list[torch.Tensor]:
    return [p.detach().float().cpu() for p in model.parameters()]


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_every_stage_trains_as_stage_0_on_one_gpu(stage: int) -> None:
    reference = _fit(TinyTransformer("adamw"), 0)
    model = _fit(TinyTransformer("adamw"), stage)
    assert len(model.losses) == STEPS and model.losses[-1] < model.losses[0]
    # one device: the same sums in another layout (cuBLAS / reduction order may differ in the last bits)
    assert model.losses == pytest.approx(reference.losses, rel=1e-5)
    assert _max_diff(_params(model), _params(reference)) < 1e-4
    assert all(p.device.type == "cuda" for p in model.parameters())  # the module stays on its device


@pytest.mark.parametrize(("stage", "param_device"), [(1, "none"), (2, "none"), (3, "none"), (3, "cpu")])
def test_offload_with_pinned_memory_equals_no_offload(stage: int, param_device: str) -> None:
    reference = _fit(FusedTiny("adamw"), stage)
    offload = OffloadConfig(optimizer_device="cpu", param_device=param_device, pin_memory=True)
    model = _fit(FusedTiny("adamw"), stage, offload=offload)
    # the same fused AdamW kernel steps the same fp32 values on the CPU instead of the GPU: a copy that
    # raced the CPU (a gradient read before it landed, a shard overwritten while read) shows as a difference
    assert model.losses == pytest.approx(reference.losses, rel=1e-5)
    assert _max_diff(_params(model), _params(reference)) < 1e-4


def test_offload_buffers_are_pinned_and_the_parameters_stay_on_the_gpu() -> None:
    model = _fit(PinCheck(), 3, offload=OffloadConfig(optimizer_device="cpu", param_device="cpu", pin_memory=True))
    assert model.pinned == [True] * STEPS
    assert model.devices == {"cuda"}


@pytest.mark.parametrize("stage", [0, 2, 3])
@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_mixed_precision_tracks_fp32_and_leaves_fp32_weights(stage: int, precision: str) -> None:
    reference = _fit(TinyTransformer("adamw"), stage)
    model = _fit(TinyTransformer("adamw"), stage, precision)
    assert all(torch.isfinite(torch.tensor(model.losses)))
    # 16-bit activations: the loss within a few percent of fp32's at every step
    assert model.losses == pytest.approx(reference.losses, rel=5e-2)
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # the fp32 masters came back
    # the same updates up to 16-bit noise: on average far below one step's size (lr 1e-2)
    moved = torch.cat([(a - b).abs().flatten() for a, b in zip(_params(model), _params(reference))])
    assert moved.mean().item() < 2e-3, moved.mean().item()


def test_fp16_with_pinned_offload_equals_fp16_without() -> None:
    def fp16(**kwargs: Any) -> tuple[TinyTransformer, ZeroStrategy]:
        model = TinyTransformer("adamw")
        scaler = LossScalerConfig(initial_scale_power=8)  # no overflow at the start: every step is taken
        strategy = ZeroStrategy(stage=2, precision=ZeroPrecision("16-mixed", loss_scaler=scaler), monitor=False,
                                **kwargs)
        make_trainer(strategy, devices=1, accelerator="gpu", max_steps=STEPS).fit(model, token_loader(n=48))
        return model, strategy

    reference, _ = fp16()
    model, strategy = fp16(offload=OffloadConfig(optimizer_device="cpu", pin_memory=True))
    assert strategy.skipped_steps == 0
    # the unscale and the norm read the pinned copies of the fp16 gradients once they landed
    assert model.losses == pytest.approx(reference.losses, rel=1e-3)
    assert _max_diff(_params(model), _params(reference)) < 1e-3


# Sparse attention trains on CUDA through FlexAttention (Note [executor choice]): forward and backward against
# dense attention masked by the layout, for every sparsity config, with key padding and causal masking.
SPARSE_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", sorted(SPARSE_CONFIGS))
def test_flex_sparse_attention_trains_on_cuda_like_masked_dense_attention(name: str, dtype: torch.dtype) -> None:
    from lightning_zero.sparse_attention import SparseSelfAttention

    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 tolerance is fp32's, not TF32's
    causal = name in ("fixed_uni", "sliding")
    module = SparseSelfAttention(SPARSE_CONFIGS[name](), key_padding_mask_mode="mul", max_seq_length=128,
                                 causal=causal, executor="flex")
    q, k, v = (t.detach().to("cuda").requires_grad_() for t in sparse_inputs(dtype, length=128))
    keep = torch.ones(q.shape[0], 128)
    keep[1, 100:] = 0  # the second row's last 28 keys are padding
    out = module(q, k, v, key_padding_mask=keep.to("cuda"))
    qr, kr, vr = (t.detach().double().cpu().requires_grad_() for t in (q, k, v))
    ref = dense_reference(qr, kr, vr, module.get_layout(128), causal, torch.where(keep == 0, float("-inf"), 0.0))
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out.backward(grad.to(dtype).to("cuda"))
    ref.backward(grad)
    tol = SPARSE_TOLERANCE[dtype]
    assert (out.double().cpu() - ref).abs().max().item() <= tol * max(1.0, ref.abs().max().item())
    for mine, theirs in ((q.grad, qr.grad), (k.grad, kr.grad), (v.grad, vr.grad)):
        assert (mine.double().cpu() - theirs).abs().max().item() <= tol * max(1.0, theirs.abs().max().item())


# Tensor parallel on NCCL (issue 41, item 6): Lightning's teardown moves the split module to the CPU; saving after
# the fit (trainer.save_checkpoint, lightning_module_state_dict()) all-gathers its slices over the TP group, which
# NCCL refused for CPU tensors. The gather now runs on the group's device and hands back CPU tensors.
def test_tp_slices_left_on_the_cpu_are_gathered_over_nccl(tmp_path: Any) -> None:
    """One rank, a one-rank NCCL group: a column-parallel layer on the CPU, unsplit through the group."""
    import torch.distributed as dist
    from torch import nn

    from lightning_zero.core.mesh import ParallelDims
    from lightning_zero.tensor_parallel.checkpoint import TensorParallelCheckpoint
    from lightning_zero.tensor_parallel.collectives import TPGroup
    from lightning_zero.tensor_parallel.layers import ColumnParallelLinear

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        tp = TPGroup(dist.new_group([0]), 1, 0)
        assert tp.device == torch.device("cuda", 0)
        layer = nn.Sequential(ColumnParallelLinear(nn.Linear(4, 8), tp, {}, "0"))  # on the CPU, as after teardown
        state = TensorParallelCheckpoint(tp, ParallelDims(1), 0).unsplit_state_dict(layer.state_dict(), layer)
        assert state["0.weight"].device.type == "cpu" and torch.equal(state["0.weight"], layer[0].weight.detach())
    finally:
        dist.destroy_process_group()


def _tp_fit_then_save(rank: int, port: int, out: str) -> None:
    """One of two NCCL ranks: a TP 2 fit of the tiny GPT, then ``trainer.save_checkpoint`` and
    ``lightning_module_state_dict()`` after it; rank 0 writes the unsplit shapes to ``out``."""
    import json
    import os

    import torch.distributed as dist

    from lightning_zero.models.gpt import GPTConfig, GPTLightningModule

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank),
                      LOCAL_RANK=str(rank), NODE_RANK="0")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=2)
    config = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=4, n_embd=32)
    tokens = torch.randint(0, 64, (16, 17), generator=torch.Generator().manual_seed(1))
    loader = torch.utils.data.DataLoader(list(zip(tokens[:, :-1], tokens[:, 1:])), batch_size=4)
    torch.manual_seed(0)
    module = GPTLightningModule(config, warmup_steps=0)
    trainer = make_trainer(ZeroStrategy(stage=1, tensor_parallel=2, monitor=False), devices=2, accelerator="gpu",
                           max_steps=2)
    trainer.fit(module, loader)
    trainer.save_checkpoint(f"{out}/after_fit.ckpt")
    state = trainer.strategy.lightning_module_state_dict()
    if rank == 0:
        with open(f"{out}/shapes.json", "w") as f:
            json.dump({k: list(v.shape) for k, v in state.items()}, f)
    dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank: two GPUs")
def test_a_tp2_fit_on_nccl_saves_after_the_fit(tmp_path: Any) -> None:
    """TP 2 on two GPUs: the save after the fit writes the checkpoint and the state dict is the unsplit one."""
    import json
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_tp_fit_then_save, args=(port, str(tmp_path)), nprocs=2)
    shapes = json.loads((tmp_path / "shapes.json").read_text())
    assert shapes["model.lm_head.weight"] == [64, 32] and shapes["model.blocks.0.attn.qkv.weight"] == [96, 32]
    assert (tmp_path / "after_fit.ckpt").exists()


def test_the_teardown_gather_on_a_gpu_counts_the_devices_memory() -> None:
    """Note [memory pools]: a CUDA gather draws from the device (free plus the caching allocator's unused memory),
    named by the device's UUID, so ranks sharing one GPU sum their needs (the stage-3 fits above get their weights
    back through it: ``test_every_stage_trains_as_stage_0_on_one_gpu``)."""
    from lightning_zero.core.stage3.memory_room import memory_pools

    (pool,) = memory_pools(torch.device("cuda:0"))
    free, total = torch.cuda.mem_get_info(0)
    assert pool.key.startswith("cuda:") and free <= pool.room <= total and "CUDA device cuda:0" in pool.what
