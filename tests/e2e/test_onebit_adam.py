"""1-bit Adam: the compressor, error feedback, the compressed all-reduce (2 and 3 ranks) and training.

Exactness: packing, error feedback and the compressed all-reduce are compared bitwise (or to fp32
rounding of a sum) against references written here from the algorithm's definition; the warm-up
is compared bitwise with torch's AdamW; training runs through Lightning on 2 gloo ranks.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_zero import OneBitAdam, ZeroEngine, ZeroStrategy
from lightning_zero.core.comm.compressed_allreduce import CompressedAllReduce, padded_numel
from lightning_zero.core.comm.compression import ErrorFeedback, compress, pack_signs, unpack_signs
from lightning_zero.core.comm.data_parallel import DataParallelComm
from lightning_zero.core.settings.zero import ZeroConfig
from tests.models import TinyTransformer, make_trainer, params_of, token_loader
from tests.pool import GlooPool, Pools


# ------------------------------------------------------------------------------------------ one process
def test_pack_unpack_round_trip() -> None:
    x = torch.randn(64)
    x[::7] = 0.0  # zero counts as positive
    packed = pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.numel() == 8
    assert torch.equal(unpack_signs(packed), torch.where(x >= 0, 1.0, -1.0))
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_signs(torch.ones(12))


def test_compress_keeps_the_norm_and_the_signs() -> None:
    x = torch.randn(4096)
    c = compress(x)
    assert c.nbytes == 4096 // 8 + 4
    y = c.decompress()
    assert torch.allclose(torch.linalg.vector_norm(y), torch.linalg.vector_norm(x), rtol=1e-5)
    assert torch.equal(torch.sign(y), torch.where(x >= 0, 1.0, -1.0))


def test_error_feedback_sums_to_the_true_value() -> None:
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(256, generator=gen) for _ in range(50)]
    channel, plain = ErrorFeedback(256), ErrorFeedback(256, enabled=False)
    sent = sum(channel.compress(x).decompress() for x in xs)
    sent_plain = sum(plain.compress(x).decompress() for x in xs)
    true = sum(xs)
    # what was sent plus what is still held is exactly what was meant (up to fp32 rounding of the sums)
    assert (sent + channel.residual - true).abs().max() < 1e-4
    # the residual stays bounded, so the running mean of what was sent converges to the true mean
    assert channel.residual.abs().max() < 10
    assert (sent - true).norm() < 0.2 * (sent_plain - true).norm()  # without feedback the error grows


def _adam_pair(freeze_step: int) -> tuple[list[torch.Tensor], list[torch.Tensor], OneBitAdam, torch.optim.AdamW]:
    torch.manual_seed(0)
    a = [torch.randn(5, 3, requires_grad=True), torch.randn(7, requires_grad=True)]
    b = [t.detach().clone().requires_grad_() for t in a]
    groups = lambda ps: [{"params": ps[:1], "weight_decay": 0.1}, {"params": ps[1:], "weight_decay": 0.0}]  # noqa: E731
    return a, b, OneBitAdam(groups(a), lr=1e-2, freeze_step=freeze_step), torch.optim.AdamW(groups(b), lr=1e-2)


def test_warm_up_is_adamw_bitwise_then_the_variance_freezes() -> None:
    a, b, onebit, adamw = _adam_pair(freeze_step=4)
    gen = torch.Generator().manual_seed(1)
    for step in range(1, 8):
        grads = [torch.randn(t.shape, generator=gen) for t in a]
        for p, q, g in zip(a, b, grads):
            p.grad, q.grad = g.clone(), g.clone()
        v_before = [onebit.state[p]["exp_avg_sq"].clone() for p in a] if step > 1 else None
        onebit.step()
        adamw.step()
        if step <= 4:
            assert all(torch.equal(p, q) for p, q in zip(a, b)), step  # the warm-up is AdamW, bit for bit
            assert not onebit.reduces_gradients_itself() or step == 4
        else:
            assert onebit.reduces_gradients_itself()
            assert all(torch.equal(onebit.state[p]["exp_avg_sq"], v) for p, v in zip(a, v_before)), step
            assert not all(torch.equal(p, q) for p, q in zip(a, b))  # AdamW keeps updating its variance
    assert onebit.steps_done == 7


def test_bad_arguments_and_stages_are_refused() -> None:
    p = [torch.nn.Parameter(torch.ones(3))]
    with pytest.raises(ValueError, match="freeze_step"):
        OneBitAdam(p, freeze_step=0)
    with pytest.raises(ValueError, match="betas"):
        OneBitAdam(p, betas=(0.9, 1.0))
    module = torch.nn.Linear(4, 4)
    for stage in (1, 2, 3):
        with pytest.raises(ValueError, match="ZeRO stage 0"):
            ZeroEngine(module, OneBitAdam(module.parameters()), ZeroConfig(stage=stage), DataParallelComm())


def test_padded_numel() -> None:
    assert padded_numel(1, 1) == 8 and padded_numel(17, 2) == 32 and padded_numel(48, 3) == 48
    with pytest.raises(ValueError, match="multiple of 16"):
        CompressedAllReduce(24, _FakeComm(2))


class _FakeComm(DataParallelComm):
    def __init__(self, world_size: int) -> None:
        super().__init__()
        self.world_size = world_size


# ------------------------------------------------------------------------------------------ 2 and 3 ranks
def allreduce_body(numel: int, steps: int) -> dict[str, Any]:
    """Every rank reduces its own random vectors; the reference re-does the algorithm from all inputs."""
    import torch.distributed as dist

    comm = DataParallelComm()
    n, rank = comm.world_size, comm.rank
    reducer = CompressedAllReduce(numel, comm)
    chunk = numel // n
    # the reference: every rank's worker residuals and every server's residual, simulated here
    worker_ref = [[ErrorFeedback(chunk) for _ in range(n)] for _ in range(n)]
    server_ref = [ErrorFeedback(chunk) for _ in range(n)]
    exact, same_everywhere, bytes_sent = True, True, []
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(numel, generator=gen)
        everyone = [torch.empty(numel) for _ in range(n)]
        dist.all_gather(everyone, x)  # plain collective: only to build the reference
        out = reducer(x)
        bytes_sent.append(reducer.last_bytes_sent)
        expected = []
        for q in range(n):
            received = [worker_ref[r][q].compress(everyone[r].view(n, chunk)[q]).decompress() for r in range(n)]
            mean = torch.stack(received).sum(0) / n
            expected.append(server_ref[q].compress(mean).decompress())
        exact &= torch.equal(out, torch.cat(expected))
        copies = [torch.empty(numel) for _ in range(n)]
        dist.all_gather(copies, out)
        same_everywhere &= all(torch.equal(c, out) for c in copies)
    fp32_allreduce = 2 * (n - 1) * numel * 4 // n
    return {"exact": exact, "same": same_everywhere, "bytes": bytes_sent, "fp32_bytes": fp32_allreduce}


@pytest.mark.distributed
def test_compressed_allreduce_two_ranks(gloo_pool) -> None:
    for result in gloo_pool.run("tests.e2e.test_onebit_adam:allreduce_body", numel=4096, steps=3):
        assert result["exact"] and result["same"]
        assert all(b * 20 <= result["fp32_bytes"] for b in result["bytes"]), result


@pytest.mark.distributed
def test_compressed_allreduce_three_ranks(gloo_pools: Pools) -> None:
    for result in gloo_pools.get(3).run("tests.e2e.test_onebit_adam:allreduce_body", numel=48 * 40, steps=3):
        assert result["exact"] and result["same"]
        assert all(b * 20 <= result["fp32_bytes"] for b in result["bytes"]), result


class OneBitTiny(TinyTransformer):
    """The test transformer with 1-bit Adam (freeze after 3 steps); records each step's traffic."""

    def __init__(self, freeze_step: int = 3, error_feedback: bool = True) -> None:
        super().__init__(record_grad_norm=True)
        self.freeze_step, self.error_feedback = freeze_step, error_feedback
        self.step_bytes: list[int] = []
        self.ratios: list[float | None] = []
        self._bytes_before = 0

    def configure_optimizers(self) -> torch.optim.Optimizer:
        names = dict(self.named_parameters())
        decay = [p for n, p in names.items() if p.dim() >= 2 and not n.startswith("unused") and p.requires_grad]
        rest = [p for n, p in names.items() if (p.dim() < 2 or n.startswith("unused")) and p.requires_grad]
        return OneBitAdam([{"params": decay, "weight_decay": 0.1}, {"params": rest}], lr=1e-2,
                          freeze_step=self.freeze_step, error_feedback=self.error_feedback)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._bytes_before = self.trainer.strategy.engine.comm.bytes_sent

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_end(outputs, batch, batch_idx)
        if (batch_idx + 1) % self.trainer.accumulate_grad_batches == 0:
            opt = self.trainer.optimizers[0]
            self.step_bytes.append(self.trainer.strategy.engine.comm.bytes_sent - self._bytes_before)
            self.ratios.append(opt.last_compression_ratio)


def _fit(model: Any, strategy: Any, steps: int, ckpt_dir: str | None = None, resume: str | None = None,
         **kwargs: Any) -> dict[str, Any]:
    saver = [ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=5, save_top_k=-1)] if ckpt_dir else []
    trainer = make_trainer(strategy, max_steps=steps, gradient_clip_val=0.05, callbacks=saver,
                           enable_checkpointing=bool(saver), **kwargs)
    trainer.fit(model, token_loader(n=80), ckpt_path=resume)  # 5 steps an epoch: the checkpoint ends one
    return {"losses": model.losses, "params": params_of(model), "norms": model.grad_norms,
            "bytes": getattr(model, "step_bytes", []), "ratios": getattr(model, "ratios", [])}


def training_body(tmp: str) -> dict[str, Any]:
    adamw = TinyTransformer("adamw", record_grad_norm=True)
    reference = _fit(adamw, ZeroStrategy(stage=0), 3, accumulate_grad_batches=2)
    onebit = _fit(OneBitTiny(), ZeroStrategy(stage=0), 8, ckpt_dir=tmp, accumulate_grad_batches=2)
    resumed = _fit(OneBitTiny(), ZeroStrategy(stage=0), 8, resume=str(Path(tmp) / "epoch=0-step=5.ckpt"),
                   accumulate_grad_batches=2)
    bf16 = _fit(OneBitTiny(), ZeroStrategy(stage=0), 6, precision="bf16-mixed")
    return {"reference": reference, "onebit": onebit, "resumed": resumed, "bf16": bf16}


@pytest.mark.distributed
@pytest.mark.slow
def test_training_with_onebit_adam(gloo_pool, tmp_path) -> None:
    ranks = gloo_pool.run("tests.e2e.test_onebit_adam:training_body", tmp=str(tmp_path))
    for rank, r in enumerate(ranks):
        ref, got = r["reference"], r["onebit"]
        # warm-up (3 optimizer steps = 6 micro-batches): exactly AdamW on all-reduced gradients
        assert got["losses"][:6] == ref["losses"], rank
        assert got["norms"][:3] == ref["norms"], rank
        # steps 4-8 send <= 1/20 of a warm-up step; step 5 also saved the checkpoint (its traffic counts too)
        warm, compressed = got["bytes"][:3], got["bytes"][3:4] + got["bytes"][5:]
        assert len(got["bytes"]) == 8 and all(b * 20 <= min(warm) for b in compressed), got["bytes"]
        assert all(ratio is not None and ratio >= 20 for ratio in got["ratios"][3:]), got["ratios"]
        # clipping at 0.05 stays active after the freeze, with one norm on every rank
        assert all(n > 0.05 for n in got["norms"]), got["norms"]
        # resuming from step 5 repeats the uninterrupted run exactly (residuals and frozen variance restored)
        assert r["resumed"]["losses"] == got["losses"][10:], (r["resumed"]["losses"], got["losses"][10:])
        assert all(torch.equal(a, b) for a, b in zip(r["resumed"]["params"], got["params"]))
        assert all(torch.isfinite(torch.tensor(r["bf16"]["losses"])))
    for run in ("onebit", "resumed", "bf16"):  # the averaged momentum keeps every rank's parameters equal
        assert all(torch.equal(a, b) for a, b in zip(ranks[0][run]["params"], ranks[1][run]["params"])), run
    assert ranks[0]["onebit"]["norms"] == ranks[1]["onebit"]["norms"]



# ------------------------------------------------------------------------------------------ configs
def test_deepspeed_json_builds_onebit_adam_and_notes_backend_keys() -> None:
    from lightning_zero.deepspeed.optim import optimizer_recipe

    params = {"lr": 1e-3, "freeze_step": 40, "betas": [0.9, 0.99], "cuda_aware": False, "comm_backend_name": "nccl"}
    with pytest.warns(UserWarning, match="comm_backend_name.*cuda_aware.*ignored"):
        recipe = optimizer_recipe("OneBitAdam", params)
    assert recipe.cls is OneBitAdam and recipe.kwargs == {"lr": 1e-3, "freeze_step": 40, "betas": (0.9, 0.99)}
    built = recipe.build([torch.nn.Parameter(torch.ones(2))])
    assert isinstance(built, OneBitAdam) and built.freeze_step == 40
    for bad, match in (({"amsgrad": True}, "amsgrad"), ({"max_grad_norm": 1.0}, "gradient_clipping"),
                       ({"bias_correction": False}, "bias_correction"), ({"momentum": 0.9}, "momentum")):
        with pytest.raises(ValueError, match=match):
            optimizer_recipe("OneBitAdam", bad)


def test_cli_refuses_onebit_adam_beyond_stage_0_before_launch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_zero.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["train", "experiment=gpt_tiny", "model.optimizer=onebit_adam", "zero=stage2"]) == 2
    assert "model.optimizer=onebit_adam runs with ZeRO stage 0" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing started


@pytest.mark.slow
def test_cli_trains_the_gpt_experiment_with_onebit_adam(tmp_path: Path, gloo_pool: GlooPool) -> None:
    """The command in this process, its ranks in the session's pool (Note [shared launches] in tests/launches.py)."""
    import json

    from tests.in_pool import run_in_process

    args = ["experiment=gpt_tiny", "zero=stage0", "model.optimizer=onebit_adam", "model.freeze_step=2",
            "trainer.max_steps=6", "trainer.log_every_n_steps=3", "trainer.enable_model_summary=false"]
    done = run_in_process(["train", *args], tmp_path, gloo_pool)
    assert done.returncode == 0, done.output[-4000:]
    (result,) = tmp_path.glob("outputs/*/*/result.json")
    assert json.loads(result.read_text())["global_step"] == 6
    # the dashboard shows the traffic and the compression ratio once the warm-up is over
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(result.parent / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    ratios = {e.step: e.value for e in acc.Scalars("traffic/compression_ratio")}
    sent = {e.step: e.value for e in acc.Scalars("traffic/bytes_per_step")}
    assert set(ratios) == {3, 6} and all(r >= 20 for r in ratios.values()), ratios
    # step 3 averages 2 warm-up steps and 1 compressed one; steps 4-6 are all compressed
    assert set(sent) >= {3, 6} and sent[6] * 10 < sent[3], sent


def test_a_warm_up_that_outlasts_the_run_is_named_with_its_fix() -> None:
    opt = OneBitAdam([torch.nn.Parameter(torch.zeros(2))], freeze_step=30)
    assert "freeze_step=10" in opt.warmup_outlasts(20)  # the documented example once ran 20 steps of freeze_step=30
    assert opt.warmup_outlasts(30) is not None
    assert opt.warmup_outlasts(31) is None and opt.warmup_outlasts(-1) is None  # compresses, or no step limit


def warmup_warning_body() -> dict[str, Any]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(OneBitTiny(freeze_step=10), ZeroStrategy(stage=0), 2)
    warned = [str(w.message) for w in caught if "is ever compressed" in str(w.message)]
    return {"rank": dist.get_rank(), "warned": warned}


@pytest.mark.distributed
def test_a_python_api_run_whose_warm_up_outlasts_it_warns_once(gloo_pool: Any) -> None:
    """The Hydra path warns before launch; the Python API and DeepSpeed JSON runs warn at setup (rank 0 only)."""
    results = sorted(gloo_pool.run("tests.e2e.test_onebit_adam:warmup_warning_body"), key=lambda r: r["rank"])
    assert [len(r["warned"]) for r in results] == [1, 0], results
    assert "Fix: freeze_step=1 " in results[0]["warned"][0]
