"""Pipeline stages beside ZeRO stages 0-3 (issue 18).

Parity: the pipelined fit with 2 stages on 2 ranks against the unsplit model in plain PyTorch on one
process; with 2 stages x 2 data-parallel ranks on 4 against a real 2-rank data-parallel ZeroStrategy
run at the same ZeRO stage (computed in the shared pool; every 4-rank case in one 4-rank launch).
The model ties its embedding to its output head, so the tie crosses the first and last stage.
Tolerances: losses within 1e-5 relative with AdamW, parameters within 1e-6 with SGD (observed: ~2e-7), 5 steps.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_zero import PipelineConfig, ZeroStrategy
from lightning_zero.core.stage3.sharded_unit import UnitState
from lightning_zero.pipeline.model import plan_split
from lightning_zero.pipeline.partition import layer_weights, partition
from tests.in_pool import run_in_process
from tests.models import make_trainer
from tests.pipeline_models import PipeLM, loader, param_bytes, reference
from tests.pool import GlooPool, Pools

STEPS, BATCH = 5, 8


# ------------------------------------------------------------------------------------------ single process
def test_partition_methods_balance_their_weight() -> None:
    layers = PipeLM(n_blocks=3, tie=False).pipeline_layers()  # Embed 104, 3 x Block 72, Head 16 + 117
    assert partition(layer_weights(layers, "uniform"), 2) == [0, 2, 5]  # 2 | 3 layers
    assert partition(layer_weights(layers, "parameters"), 2) == [0, 3, 5]  # 248 | 205 parameters
    layers = PipeLM(n_blocks=6, tie=False).pipeline_layers()
    assert partition(layer_weights(layers, "type:Block"), 3) == [0, 3, 5, 8]  # two blocks per chunk
    assert partition([5, 1, 1, 1, 1, 5], 2) == [0, 3, 6]
    with pytest.raises(ValueError, match="matches no layer class; the classes are"):
        layer_weights(layers, "type:Conv")
    with pytest.raises(ValueError, match="8 pipeline layers, fewer than the 9 pipeline chunks"):
        partition([1] * 8, 9)


def test_config_refuses_bad_values_with_the_fix() -> None:
    with pytest.raises(ValueError, match="not wired into lightning_zero: the zero-bubble"):
        PipelineConfig(schedule="zbv_zero_bubble")
    with pytest.raises(ValueError, match="interleaved schedule needs virtual_stages >= 2"):
        PipelineConfig(schedule="interleaved_1f1b")
    with pytest.raises(ValueError, match="not a multiple of pipeline stages=2"):
        PipelineConfig(stages=2).data_parallel_size(3)
    with pytest.raises(ValueError, match="does not split into micro_batches=4 equal micro-batches"):
        PipelineConfig(micro_batches=4).check_batch(6)
    with pytest.raises(ValueError, match=r"last batch of the epoch holds 6 samples .* batch size is 8.*drop_last=True"):
        PipelineConfig(micro_batches=4).check_batch(6, full_batch_size=8)  # per step, where the loader hides it
    with pytest.raises(ValueError, match="needs micro_batches >= stages"):
        PipelineConfig(stages=4, micro_batches=2)
    assert PipelineConfig(schedule="one_f_one_b").schedule == "1f1b"  # the Hydra enum's name


def test_protocol_and_ties_are_found_before_any_process_group() -> None:
    with pytest.raises(TypeError, match="add `pipeline_layers"):
        plan_split(torch.nn.Linear(2, 2), PipelineConfig())
    _, bounds, ties = plan_split(PipeLM(), PipelineConfig(partition_method="uniform"))
    assert bounds == [0, 2, 5] and ties == [(0, 1)]  # the embedding and the head share a weight


def test_a_gpt_built_on_meta_gets_its_own_initialisation() -> None:
    """The pipelined GPT experiment builds in configure_model on the meta device; each stage initialises
    its layers with GPT's initialisation (not reset_parameters: N(0, 1) embeddings tied to the head)."""
    from lightning_zero.core.stage3.materialize import parameters_on_meta
    from lightning_zero.models.gpt import GPTLightningModule, gpt_param_init
    from lightning_zero.pipeline.build import materialize_whole

    module = GPTLightningModule("gpt_tiny", build_in_configure_model=True)
    with parameters_on_meta():
        module.configure_model()
    assert all(p.is_meta for p in module.parameters())
    materialize_whole(module, gpt_param_init(module.config), 0)
    gpt = module.model
    assert gpt is not None and gpt.lm_head.weight is gpt.tok_emb.weight
    assert abs(float(gpt.tok_emb.weight.detach().std()) - 0.02) < 0.002
    proj = gpt.blocks[0].attn.proj  # residual scaling, zero bias
    assert float(proj.weight.detach().std()) < 0.015 and float(proj.bias.detach().abs().max()) == 0.0


# ------------------------------------------------------------------------------------------ distributed
def _fit(stage: int, schedule: str, stages: int, optimizer: str, clip: float | None = None,
         interval: int = 0, lazy: bool = False, tie: bool = True, per_micro: bool = False,
         accumulate: int = 1) -> dict[str, Any]:
    import torch.distributed as dist

    from tests.pipeline_models import Block

    rank, world = dist.get_rank(), dist.get_world_size()
    dp = world // stages
    config = PipelineConfig(stages=stages, micro_batches=4, schedule=schedule, partition_method="uniform",
                            virtual_stages=2 if schedule == "interleaved_1f1b" else 1,
                            activation_checkpoint_interval=interval, reduce_per_micro_batch=per_micro)
    model, gathers, held, whole_grads, logged = PipeLM(optimizer, lazy=lazy, tie=tie), [], [], [], []

    class Units(pl.Callback):  # stage 3: gathers per step, and nothing left gathered after it
        def on_train_start(self, trainer: pl.Trainer, *args: Any) -> None:
            held.append(param_bytes(model))
            pipe = trainer.strategy._run.pipeline  # after the schedule, before the deferred reduction: whole .grad?
            backward = pipe.backward

            def watched(engine: Any) -> None:
                whole_grads.append(any(p.grad is not None for p in engine.names))
                backward(engine)

            pipe.backward = watched

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            held.append(param_bytes(model))
            logged.append(float(trainer.callback_metrics["train_loss"]))  # what the run reports for the batch
            if stage != 3:
                return
            units = trainer.strategy.engine.units
            gathers.append((sum(u.gathers for u in units), len(units),
                            all(u.state is UnitState.SHARDED for u in units)))

    strategy = ZeroStrategy(stage=stage, pipeline=config, param_persistence_threshold=0, reduce_bucket_size=40)
    trainer = make_trainer(strategy, devices=world, max_steps=STEPS, gradient_clip_val=clip, callbacks=[Units()],
                           accumulate_grad_batches=accumulate)
    calls = Block.calls
    trainer.fit(model, loader(BATCH, rank % dp, dp))
    # per optimizer step: the mean of the window's reported batch losses (Lightning's outputs["loss"] is
    # divided by the accumulation count; the logged train_loss must be each batch's true mean)
    losses = [sum(logged[i : i + accumulate]) / accumulate for i in range(0, len(logged), accumulate)]
    return {"losses": losses if accumulate > 1 else model.losses,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}, "global_step": trainer.global_step,
            "gathers": gathers, "dp_rank": rank % dp, "block_calls": Block.calls - calls,
            "built_bytes": model.built_bytes, "held_bytes": held, "whole_grads": whole_grads}


def data_parallel_body(optimizers: list[str], tie: bool = True, clip: float | None = None,
                       zero_stages: tuple[int, ...] = (0, 1, 2, 3)) -> dict[tuple[str, int], dict[str, Any]]:
    """The 4-rank parity's reference: a real ``ZeroStrategy`` run without a pipeline on 2 data-parallel
    ranks (this rank's batch losses and the final parameters), for each optimizer and ZeRO stage."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for optimizer in optimizers:
        for stage in zero_stages:
            model = PipeLM(optimizer, tie=tie)
            strategy = ZeroStrategy(stage=stage, param_persistence_threshold=0, reduce_bucket_size=40)
            make_trainer(strategy, devices=world, max_steps=STEPS, gradient_clip_val=clip).fit(
                model, loader(BATCH, rank, world))
            out[(optimizer, stage)] = {"losses": model.losses,
                                       "params": {n: p.detach().clone() for n, p in model.named_parameters()}}
    return out


def parity_body(schedules: list[str], stages: int, optimizers: list[str], clip: float | None = None,
                interval: int = 0, data_parallel: list[dict] | None = None, lazy: bool = False,
                zero_stages: tuple[int, ...] = (0, 1, 2, 3), tie: bool = True, per_micro: bool = False,
                accumulate: int = 1) -> dict:
    """Every ZeRO stage with each schedule and optimizer; returns the worst differences to the reference:
    plain PyTorch on one process, or (``data_parallel``: ``data_parallel_body``'s results by rank) the
    unpipelined ZeroStrategy run at the same ZeRO stage on ``world / stages`` data-parallel ranks.
    ``accumulate``: ``Trainer(accumulate_grad_batches)``; the plain reference then takes batches that many
    times larger (the same samples per optimizer step)."""
    import torch.distributed as dist

    dp = dist.get_world_size() // stages
    out: dict[Any, Any] = {}
    for optimizer in optimizers:
        ref = (reference(optimizer, BATCH * accumulate, dp, STEPS, clip, lazy=lazy, tie=tie)
               if data_parallel is None else None)
        for schedule in schedules:
            for stage in zero_stages:
                if data_parallel is not None:  # each data-parallel rank's losses; the parameters agree on all
                    ref = {"losses": [list(s) for s in zip(*(r[(optimizer, stage)]["losses"] for r in data_parallel))],
                           "params": data_parallel[0][(optimizer, stage)]["params"]}
                assert ref is not None
                run = _fit(stage, schedule, stages, optimizer, clip, interval, lazy, tie, per_micro, accumulate)
                ref_losses = [step[run["dp_rank"]] for step in ref["losses"]]
                out[(optimizer, schedule, stage)] = {
                    "loss_rel": max(abs(a - b) / abs(b) for a, b in zip(run["losses"], ref_losses)),
                    "param_abs": max(float((p - ref["params"][n]).abs().max()) for n, p in run["params"].items()),
                    "steps": len(run["losses"]), "global_step": run["global_step"], "gathers": run["gathers"],
                    "block_calls": run["block_calls"], "batches": STEPS * accumulate,
                    "built_bytes": run["built_bytes"], "held_bytes": run["held_bytes"],
                    "whole_grads": run["whole_grads"],
                }
    return out


def _check(results: list[dict]) -> None:
    for per_rank in results:
        for (optimizer, schedule, stage), r in per_rank.items():
            assert r["steps"] == r["global_step"] == STEPS
            assert r["loss_rel"] < 1e-5, (optimizer, schedule, stage, r)
            if optimizer == "sgd":
                assert r["param_abs"] < 1e-6, (optimizer, schedule, stage, r)
            per_micro = bool(r["whole_grads"]) and not any(r["whole_grads"])  # asserted by its own test
            if stage >= 2 and not per_micro:  # deferred: the step's whole gradient waits in .grad for one reduction
                assert all(r["whole_grads"]) and len(r["whole_grads"]) == r["batches"], r["whole_grads"]
            if stage == 3:  # Note [deferred reduction]: one gather per unit per batch, not per micro-batch
                counts, units, released = zip(*r["gathers"])
                assert all(released) and units[0] >= 2 and len(counts) == r["batches"]
                assert [b - a for a, b in itertools.pairwise(counts)] == [units[0]] * (len(counts) - 1), r["gathers"]


@pytest.mark.slow
def test_two_stages_match_the_unsplit_model_at_every_zero_stage(gloo_pool: GlooPool) -> None:
    _check(gloo_pool.run("tests.e2e.test_pipeline:parity_body", schedules=["gpipe", "1f1b"], stages=2,
                         optimizers=["adamw", "sgd"]))
    # Trainer(accumulate_grad_batches=2): the same steps as batches of 2 x 8 without a pipeline (the
    # schedule's backward is divided by 2; the reported loss stays each batch's mean)
    _check(gloo_pool.run("tests.e2e.test_pipeline:parity_body", schedules=["1f1b"], stages=2, optimizers=["sgd"],
                         accumulate=2))


@pytest.mark.slow
def test_each_rank_builds_only_its_stage_and_keeps_parity(gloo_pool: GlooPool) -> None:
    """A module built in configure_model: parameters on the meta device, then each rank materialises only
    its stage's layers (Note [local construction] in pipeline/build.py). Parameter bytes held on a rank,
    right after configure_model, at the start of training and after every step, are exactly its stage's
    share (the other stages' parameters are 4-byte placeholders), not the whole model's."""
    results = gloo_pool.run("tests.e2e.test_pipeline:parity_body", schedules=["1f1b"], stages=2, optimizers=["sgd"],
                            lazy=True, zero_stages=(0, 3))
    model = PipeLM()
    layers, bounds, _ = plan_split(model, PipelineConfig(partition_method="uniform"))
    params = set(model.parameters())
    for rank, per_rank in enumerate(results):
        local = {p for layer in layers[bounds[rank] : bounds[rank + 1]] for p in layer.parameters()}
        share = 4 * sum(p.numel() for p in local) + 4 * len(params - local)
        assert share < 0.85 * 4 * sum(p.numel() for p in params)  # the tied embedding is on both stages
        for (_, _, stage), r in per_rank.items():
            assert r["built_bytes"] == 0, r  # configure_model built nothing for real
            if stage == 0:  # whole local parameters (stage 3 holds only shards of them)
                assert r["held_bytes"] == [share] * (STEPS + 1), (rank, share, r["held_bytes"])
            else:
                assert max(r["held_bytes"]) < share, (rank, share, r["held_bytes"])
    _check(results)  # parity with the whole module built the same way (pipeline_models.reference(lazy=True))


@pytest.mark.slow
def test_clipping_uses_the_norm_over_stages_and_counts_a_tie_once(gloo_pool: GlooPool) -> None:
    # the first step's norm is ~4: a clip at 1.0 is active on every step
    _check(gloo_pool.run("tests.e2e.test_pipeline:parity_body", schedules=["1f1b"], stages=2, optimizers=["sgd"],
                         clip=1.0))


@pytest.mark.slow
def test_activation_checkpointing_recomputes_and_keeps_parity(gloo_pool: GlooPool) -> None:
    plain = gloo_pool.run("tests.e2e.test_pipeline:parity_body", schedules=["1f1b"], stages=2, optimizers=["sgd"])
    recomputed = gloo_pool.run("tests.e2e.test_pipeline:parity_body", schedules=["1f1b"], stages=2, optimizers=["sgd"],
                               interval=1)
    _check(recomputed)
    for a, b in zip(plain, recomputed):  # every block's forward of every micro-batch runs again in backward
        assert all(b[k]["block_calls"] - a[k]["block_calls"] >= STEPS * 4 for k in a), (a, b)


@pytest.mark.slow
def test_two_stages_by_two_data_parallel_match_data_parallel(gloo_pool: GlooPool, gloo_pools: Pools,
                                                            tmp_path: Path) -> None:
    # the reference: real 2-rank ZeroStrategy runs (shared pool); then every case on the session's 4-rank pool
    data_parallel = gloo_pool.run("tests.e2e.test_pipeline:data_parallel_body", optimizers=["adamw", "sgd"])
    untied = gloo_pool.run("tests.e2e.test_pipeline:data_parallel_body", optimizers=["sgd"], tie=False)
    clipped = gloo_pool.run("tests.e2e.test_pipeline:data_parallel_body",
                            optimizers=["sgd"], clip=1.0, zero_stages=(0, 3))
    pool = gloo_pools.get(4)  # shared with the other 4-rank tests
    # Lightning's own DistributedSampler shards over the data-parallel group: the two stages of a
    # replica (ranks 0 and 2, 1 and 3) draw the same samples, the two replicas different ones
    seen = pool.run("tests.e2e.test_pipeline:sampler_body")
    assert seen[0] == seen[2] and seen[1] == seen[3] and not set(seen[0]) & set(seen[1]), seen
    # clipping by the norm over both stages and both data-parallel ranks (a clip at 1.0 acts every step)
    _check(pool.run("tests.e2e.test_pipeline:parity_body", schedules=["1f1b"], stages=2, optimizers=["sgd"],
                    data_parallel=clipped, zero_stages=(0, 3), clip=1.0))
    _check(pool.run("tests.e2e.test_pipeline:parity_body", schedules=["gpipe", "1f1b", "interleaved_1f1b"],
                    stages=2, optimizers=["adamw", "sgd"], data_parallel=data_parallel, _timeout_s=600))
    # Trainer(accumulate_grad_batches=2) over 2 x 2 ranks: the plain reference with batches of 2 x 8 per
    # data-parallel rank (the schedule's backward divided by 2 on every stage)
    _check(pool.run("tests.e2e.test_pipeline:parity_body", schedules=["1f1b"], stages=2, optimizers=["sgd"],
                    zero_stages=(0, 3), accumulate=2))
    # sharded checkpoints: each stage's ranks write their own shards; the same state as consolidated
    for per_stage in pool.run("tests.e2e.test_pipeline:dp_checkpoint_body", directory=str(tmp_path),
                              zero_stages=(1, 3)):
        assert all(v < 1e-6 for r in per_stage.values() for v in r.values()), per_stage
    # reduce_per_micro_batch (ZeRO 2-3, untied): the same parameters, and no whole .grad left for backward
    per_micro = pool.run("tests.e2e.test_pipeline:parity_body", schedules=["1f1b", "interleaved_1f1b"], stages=2,
                         optimizers=["sgd"], data_parallel=untied, zero_stages=(2, 3), tie=False,
                         per_micro=True, _timeout_s=300)
    _check(per_micro)
    assert all(not any(r["whole_grads"]) and len(r["whole_grads"]) == STEPS for rank in per_micro
               for r in rank.values()), [{k: r["whole_grads"] for k, r in rank.items()} for rank in per_micro]


def sampler_body() -> list[int]:
    """The sample indices this rank trained on in 2 steps, with Lightning's default (shuffling) sampler."""
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    from tests.pipeline_models import dataset

    data = dataset()
    indexed = TensorDataset(*data.tensors, torch.arange(len(data)))
    seen: list[int] = []

    class Seen(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, module: Any, batch: Any, batch_idx: int) -> None:
            seen.extend(int(i) for i in batch[2])

    config = PipelineConfig(stages=2, micro_batches=4, schedule="1f1b", partition_method="uniform")
    trainer = make_trainer(ZeroStrategy(stage=1, pipeline=config), devices=dist.get_world_size(), max_steps=2,
                           use_distributed_sampler=True, callbacks=[Seen()])
    trainer.fit(_IndexedLM("sgd"), DataLoader(indexed, batch_size=BATCH, shuffle=True))
    return seen


class _IndexedLM(PipeLM):
    def pipeline_batch(self, batch: Any) -> tuple[Any, Any]:  # (tokens, targets, sample indices)
        return batch[0], batch[1]


def overflow_body(zero_stages: list[int]) -> dict[int, dict[str, Any]]:
    """fp16 with dynamic loss scaling (hysteresis 1): at step 2 the gradient of a block that lives on stage 0
    only overflows (a hook multiplies it by inf). Per rank: the loss scale and skipped-step count after each
    step, and whether this rank's parameters changed in each step."""
    return {zero_stage: {"rows": _overflow_fit(zero_stage)} for zero_stage in zero_stages}


def _overflow_fit(zero_stage: int) -> list[tuple[float, int, bool]]:
    from lightning_zero import ZeroPrecision
    from lightning_zero.core.settings.precision import LossScalerConfig

    model, now = PipeLM("sgd"), {"step": -1}
    target = model.blocks[0].fc.weight  # layer 1 of 5: stage 0 under the uniform split [0, 2, 5]
    target.register_hook(lambda g: g * float("inf") if now["step"] == 2 else g)
    rows: list[tuple[float, int, bool]] = []

    class Watch(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, module: Any, batch: Any, batch_idx: int) -> None:
            now["step"] = batch_idx
            self.before = [t.clone() for t in trainer.strategy.engine.full_master_params().values()]

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            after = trainer.strategy.engine.full_master_params().values()  # fp32 masters, whole
            changed = any(not torch.equal(a, b) for a, b in zip(self.before, after))
            rows.append((trainer.strategy.loss_scale, trainer.strategy.skipped_steps, changed))

    config = PipelineConfig(stages=2, micro_batches=4, schedule="1f1b", partition_method="uniform")
    plugin = ZeroPrecision("16-mixed", loss_scaler=LossScalerConfig(initial_scale_power=8, hysteresis=1))
    strategy = ZeroStrategy(stage=zero_stage, pipeline=config, precision=plugin, param_persistence_threshold=0)
    make_trainer(strategy, max_steps=STEPS, callbacks=[Watch()]).fit(model, loader(BATCH))
    return rows


@pytest.mark.slow
def test_an_fp16_overflow_on_one_stage_skips_the_step_on_every_rank(gloo_pool: GlooPool) -> None:
    results = gloo_pool.run("tests.e2e.test_pipeline:overflow_body", zero_stages=[0, 1, 2, 3])
    for zero_stage in (0, 1, 2, 3):
        rows = [r[zero_stage]["rows"] for r in results]
        assert rows[0] == rows[1], (zero_stage, rows)  # the same scale and skips on both stages
        scales, skipped, changed = zip(*rows[0])
        assert scales == (256.0, 256.0, 128.0, 128.0, 128.0), (zero_stage, rows)  # halved once, at step 2
        assert skipped == (0, 0, 1, 1, 1) and changed == (True, True, False, True, True), (zero_stage, rows)


class NoProtocol(PipeLM):
    pipeline_layers = None  # type: ignore[assignment]


class _NoStep(pl.Callback):
    """The bad inputs are refused before the first training step."""

    def on_train_batch_start(self, *args: Any) -> None:
        raise AssertionError("a training step started")


def bad_input_body(case: str) -> str:
    """Each bad input raises on every rank (the pool collects one message per rank)."""
    import torch.distributed as dist

    stages, micro, model, per_micro, samples, steps = 2, 4, PipeLM(), False, 96, 1
    if case == "world":
        stages = 3
    elif case == "micro":
        micro = 3
    elif case == "layers":
        model = PipeLM(n_blocks=0)  # 2 layers, 3 chunks... on 2 stages with virtual stages
    elif case == "protocol":
        model = NoProtocol()
    elif case == "per_micro_tied":
        per_micro = True
    elif case == "per_micro_stage1":
        per_micro, model = True, PipeLM(tie=False)
    elif case == "short_last":  # batches of 8, 8, 8 and 6 (drop_last=False), the last one within max_steps
        samples, steps = 30, 4
    config = PipelineConfig(stages=stages, micro_batches=micro, schedule="gpipe" if case != "layers" else
                            "interleaved_1f1b", virtual_stages=2 if case == "layers" else 1,
                            reduce_per_micro_batch=per_micro)
    zero_stage = 1 if case == "per_micro_stage1" else 2
    try:  # a rule of the settings is refused as the strategy is built, the rest at its setup
        trainer = make_trainer(ZeroStrategy(stage=zero_stage, pipeline=config), devices=dist.get_world_size(),
                               max_steps=steps, callbacks=[_NoStep()])
        trainer.fit(model, loader(BATCH, n=samples))
    except (ValueError, TypeError) as err:
        return str(err)
    return "no error"


@pytest.mark.slow
@pytest.mark.parametrize(("case", "message"), [
    ("world", "not a multiple of pipeline stages=3"),
    ("micro", "does not split into micro_batches=3"),
    ("layers", "2 pipeline layers, fewer than the 4 pipeline chunks"),
    ("protocol", "add `pipeline_layers(self) -> Sequence[nn.Module]`"),
    ("per_micro_tied", "reduce_per_micro_batch=True) with parameters tied across pipeline stages"),
    ("per_micro_stage1", "reduce_per_micro_batch=True with stage=1: reducing per micro-batch saves memory only at "
                         "ZeRO stages 2-3"),
    ("short_last", "last batch of each epoch holds 6 samples per data-parallel rank (30 samples, batch_size=8, "
                   "drop_last=False), which does not split into micro_batches=4"),
])
def test_bad_input_is_refused_on_every_rank(gloo_pool: GlooPool, case: str, message: str) -> None:
    messages = gloo_pool.run("tests.e2e.test_pipeline:bad_input_body", case=case)
    assert all(message in m for m in messages), messages


@pytest.mark.slow
def test_cli_trains_and_logs_a_pipelined_gpt(tmp_path: Path, gloo_pool: GlooPool) -> None:
    """The command in this process, its ranks in the session's pool (Note [shared launches] in tests/launches.py)."""
    # reduce_per_micro_batch here (the deferred reduction runs from the CLI in docs/pipeline.md's commands)
    args = ["train", "experiment=gpt_tiny", "pipeline=pp2_1f1b", "zero=stage3", "zero.param_persistence_threshold=0",
            "trainer.devices=2", "trainer.max_steps=6", "pipeline.reduce_per_micro_batch=true",
            "model.tie_weights=false", "trainer.log_every_n_steps=2", f"hydra.run.dir={tmp_path}"]
    done = run_in_process(args, tmp_path, gloo_pool)
    assert done.returncode == 0, done.output[-3000:]
    assert "val_loss" in done.output
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    losses = []
    for path in tmp_path.glob("tb/events.out.tfevents.*"):
        events = EventAccumulator(str(path))
        events.Reload()
        assert "train_loss" not in events.Tags()["scalars"]  # one training loss: the monitor's
        if "loss/train" in events.Tags()["scalars"]:
            losses = [e.value for e in events.Scalars("loss/train")]
    assert len(losses) == 3 and all(0 < v < 10 for v in losses), losses


def test_the_cli_refuses_reduce_per_micro_batch_where_it_cannot_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_zero.cli import main

    monkeypatch.chdir(tmp_path)
    base = ["train", "experiment=gpt_tiny", "pipeline=pp2_1f1b", "trainer.devices=2",
            "pipeline.reduce_per_micro_batch=true"]
    assert main([*base, "zero=stage1", "model.tie_weights=false"]) == 2
    assert "with zero.stage=1: reducing per micro-batch saves memory only at ZeRO stages 2-3" in capsys.readouterr().err
    assert main([*base, "zero=stage2"]) == 2
    assert "Fix: model.tie_weights=false" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing started


def checkpoint_body(directory: str, stage: int, lazy: bool = False, fmt: str = "auto") -> dict[str, float]:
    """Pipelined -> pipelined, pipelined -> data parallel, data parallel -> pipelined resumes (3 + 2
    SGD steps, 3 batches per epoch) against 5 uninterrupted reference steps. ``lazy``: the pipelined
    runs build the model in ``configure_model`` (each stage reads its own layers after setup).
    ``fmt``: the checkpoint format ("auto": sharded at these ZeRO stages)."""
    import torch.distributed as dist

    rank, n = dist.get_rank(), 24
    config = PipelineConfig(stages=2, micro_batches=4, schedule="1f1b", partition_method="uniform")

    class SaveAt3(pl.Callback):
        def __init__(self, path: str) -> None:
            self.path = path

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if trainer.global_step == 3:
                trainer.save_checkpoint(self.path)

    def fit(pipelined: bool, steps: int, ckpt: str | None = None, save: str | None = None,
            gather: bool = True) -> PipeLM:
        model = PipeLM("sgd", lazy=lazy and pipelined)
        strategy = ZeroStrategy(stage=stage, pipeline=config if pipelined else None, param_persistence_threshold=0,
                                gather_on_teardown=gather, checkpoint_format=fmt)
        data = loader(BATCH, n=n) if pipelined else loader(BATCH // 2, rank, 2, n=n)  # the same 8 samples a step
        trainer = make_trainer(strategy, max_steps=steps, callbacks=[SaveAt3(save)] if save else [])
        trainer.fit(model, data, ckpt_path=ckpt)
        return model

    ref = reference("sgd", BATCH, 1, 5, n=n, lazy=lazy)["params"]

    def diff(model: PipeLM) -> float:
        return max(float((p - ref[name]).abs().max()) for name, p in model.named_parameters())

    piped, plain = f"{directory}/piped.ckpt", f"{directory}/plain.ckpt"
    out = {"uninterrupted": diff(fit(True, 5))}
    fit(True, 3, save=piped)
    if fmt != "consolidated":
        dist.barrier()  # rank 0 published it
        out["each stage wrote its own shards"] = _stage_shards_apart(piped)
    out["piped->piped"] = diff(fit(True, 5, ckpt=piped))
    out["piped->plain"] = diff(fit(False, 5, ckpt=piped))
    # trainer.save_checkpoint after fit: the reassembled module and every stage's optimizer state, as saved
    # at the same step during fit (resuming from the end of a fit is another matter, also without a pipeline)
    after = f"{directory}/after_fit.ckpt"
    fit(True, 3).trainer.save_checkpoint(after)
    out["after fit vs during fit"] = _checkpoint_difference(piped, after)
    if stage == 1:  # the other stages' parts were not gathered back: refused, not written incomplete
        try:
            fit(True, 1, gather=False).trainer.save_checkpoint(f"{directory}/refused.ckpt")
        except RuntimeError as err:
            out["refused"] = 0.0 if "Save during fit instead" in str(err) else 1.0
    if lazy:  # an eager unpipelined run starts from other initial values
        return out
    fit(False, 3, save=plain)
    out["plain->piped"] = diff(fit(True, 5, ckpt=plain))
    return out


def dp_checkpoint_body(directory: str, zero_stages: tuple[int, ...]) -> dict[int, dict[str, float]]:
    """2 stages x 2 data-parallel ranks, SGD with momentum: a sharded checkpoint saved at step 3 against a
    consolidated one saved at the same step of the same run (the same weights and optimizer state, read
    whole), and a resume from it against 5 uninterrupted steps."""
    import torch.distributed as dist

    rank, dp, n = dist.get_rank(), 2, 48  # 3 batches per epoch on each data-parallel rank: step 3 ends one
    config = PipelineConfig(stages=2, micro_batches=4, schedule="1f1b", partition_method="uniform")

    class SaveAt3(pl.Callback):
        def __init__(self, path: str, fmt: str) -> None:
            self.path, self.fmt = path, fmt

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if trainer.global_step == 3:
                trainer.strategy.checkpoint_format = self.fmt
                trainer.save_checkpoint(self.path)
                trainer.strategy.checkpoint_format = "auto"

    def fit(stage: int, steps: int, ckpt: str | None = None, saves: tuple[tuple[str, str], ...] = ()) -> PipeLM:
        model = PipeLM("sgd")
        strategy = ZeroStrategy(stage=stage, pipeline=config, param_persistence_threshold=0)
        trainer = make_trainer(strategy, devices=4, max_steps=steps,
                               callbacks=[SaveAt3(path, fmt) for path, fmt in saves])
        trainer.fit(model, loader(BATCH, rank % dp, dp, n=n), ckpt_path=ckpt)
        return model

    out = {}
    for stage in zero_stages:
        sharded, whole = f"{directory}/z{stage}.sharded", f"{directory}/z{stage}.ckpt"
        uninterrupted = fit(stage, 5)
        fit(stage, 3, saves=((sharded, "sharded"), (whole, "consolidated")))
        dist.barrier()
        resumed = fit(stage, 5, ckpt=sharded)
        out[stage] = {
            "sharded vs consolidated": _checkpoint_difference(sharded, whole),
            "each stage's ranks wrote its own shards": _stage_shards_apart(sharded, files_per_group=2),
            "resumed vs uninterrupted": max(float((p - q).abs().max()) for p, q in
                                            zip(resumed.parameters(), uninterrupted.parameters())),
        }
    return out


def _stage_shards_apart(path: str, files_per_group: int = 1) -> float:
    """0.0 when the ranks of each stage of a 2-stage run hold flat-group shards of their own stage only
    (``files_per_group``: its data-parallel size) and every key resolves; 1.0 otherwise."""
    from lightning_zero.checkpoint import ShardedCheckpoint
    from lightning_zero.checkpoint.tensor_file import TensorFile

    ckpt = ShardedCheckpoint(path)
    groups_in = []
    for name in ckpt.meta["files"]:
        file = TensorFile(os.path.join(path, name))
        groups_in.append({k.split(".")[0] for k in file if k.startswith("g")})
        file.close()
    files_of = [{r for r, _, _ in g["shards"]} for g in ckpt.meta["groups"]]
    half = len(groups_in) // 2  # stage 0's ranks come first (Note [rank layout])
    first, second = set().union(*groups_in[:half]), set().union(*groups_in[half:])
    apart = len(groups_in) == 2 * files_per_group and first and second and not first & second
    own_files = all(len(files) == files_per_group for files in files_of)
    ckpt.state_dict().materialize()  # every key resolves (the tied head and embedding to one stage's shards)
    return 0.0 if apart and own_files else 1.0


def _read_checkpoint(path: str) -> dict[str, Any]:
    """A checkpoint file, or a sharded checkpoint directory read whole."""
    from lightning_zero.checkpoint import ShardedCheckpoint, materialize_optimizer_state

    if not os.path.isdir(path):
        return torch.load(path, weights_only=False)
    ckpt = ShardedCheckpoint(path)
    return {"state_dict": ckpt.state_dict().materialize(),
            "optimizer_states": [materialize_optimizer_state(s) for s in ckpt.optimizer_states()]}


def _checkpoint_difference(first: str, second: str) -> float:
    """The largest difference between two checkpoints' weights and optimizer states (inf: keys differ)."""
    one, two = (_read_checkpoint(path) for path in (first, second))
    states = [(one["state_dict"], two["state_dict"])]
    opt_one, opt_two = one["optimizer_states"][0]["state"], two["optimizer_states"][0]["state"]
    if opt_one.keys() != opt_two.keys() or states[0][0].keys() != states[0][1].keys():
        return float("inf")
    states += [(opt_one[i], opt_two[i]) for i in opt_one]
    return max(float((a[k] - b[k]).abs().max()) for a, b in states for k in a if isinstance(a[k], torch.Tensor))


@pytest.mark.slow
@pytest.mark.parametrize(("stage", "lazy", "fmt"), [(1, False, "auto"), (3, False, "auto"), (2, True, "auto"),
                                                    (3, False, "consolidated")])
def test_checkpoints_resume_across_pipelined_and_plain_runs(gloo_pool: GlooPool, tmp_path: Path, stage: int,
                                                            lazy: bool, fmt: str) -> None:
    expected = {"uninterrupted", "piped->piped", "piped->plain", "after fit vs during fit"}
    expected |= {"each stage wrote its own shards"} if fmt != "consolidated" else set()
    expected |= ({"refused"} if stage == 1 else set()) | ({"plain->piped"} if not lazy else set())
    for result in gloo_pool.run("tests.e2e.test_pipeline:checkpoint_body", directory=str(tmp_path), stage=stage,
                                lazy=lazy, fmt=fmt):
        assert set(result) == expected and all(v < 1e-6 for v in result.values()), result


def evaluation_body() -> dict[str, float]:
    """validate / predict through the forward-only schedule against the unsplit module (whole again
    after fit) on the same data; 6 samples a batch, so 3 of the 4 micro-batches divide it."""
    model = PipeLM()
    config = PipelineConfig(stages=2, micro_batches=4, schedule="1f1b", partition_method="parameters")
    trainer = make_trainer(ZeroStrategy(stage=3, pipeline=config, param_persistence_threshold=0), max_steps=2)
    trainer.fit(model, loader(BATCH, n=32))
    data = loader(6, n=24)
    val = trainer.validate(model, data, verbose=False)[0]["val_loss"]
    predicted = trainer.predict(model, data)
    with torch.no_grad():
        expected = [model(x) for x, _ in data]
        loss = torch.stack([model.pipeline_loss(model(x), y) for x, y in data]).mean()
    return {"val": abs(val - float(loss)) / float(loss),
            "predict": max(float((a - b).abs().max()) for a, b in zip(predicted, expected)),
            "batches": float(len(predicted) == len(expected) == 4)}


@pytest.mark.slow
def test_validate_and_predict_run_the_forward_only_schedule(gloo_pool: GlooPool) -> None:
    for result in gloo_pool.run("tests.e2e.test_pipeline:evaluation_body"):
        assert result["batches"] == 1.0 and result["val"] < 1e-6 and result["predict"] < 1e-6, result
