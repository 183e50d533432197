"""Expert parallelism's state (issue 44): starved experts train at every ZeRO stage without a hang; the model state
per rank is the formula (experts / EP plus dense, each ZeRO-partitioned over its group); validation outside fit;
convert's unsplit state dict; and the body of the resume across expert-parallel sizes (EP 2 -> EP 1 -> EP 4 on 4
ranks, run by test_expert_parallel.py's 4-rank pool)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero import ZeroStrategy
from lightning_zero.core.common.memory import expert_parallel_model_state, model_state_formula
from lightning_zero.moe import MoELayer, expert_split_of
from tests.distributed.test_expert_parallel import BATCH, SEQ, VOCAB, make_model
from tests.distributed.test_moe import Starving
from tests.models import make_trainer
from tests.pool import GlooPool


def _loader(steps: int, world: int, accumulate: int = 1) -> DataLoader:
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, VOCAB, (steps * accumulate * BATCH * world, SEQ + 1), generator=g)
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=BATCH, shuffle=False)


# ------------------------------------------------------------------------------------------- starved experts
def starved_body(stages: list[int]) -> dict[int, dict[str, Any]]:
    """The GPT's MoE at EP 2 on 2 ranks, its routers forced: rank 0 routes no token to rank 1's experts (2, 3) and
    no rank routes any token to expert 3. Two optimizer steps per ZeRO stage."""
    import torch.distributed as dist

    rank = dist.get_rank()
    out = {}
    for stage in stages:
        module = make_model("gpt")
        for m in module.modules():
            if isinstance(m, MoELayer):
                m.gate = Starving(m.gate, [2, 3] if rank == 0 else [3])
        initial = {n: p.detach().clone() for n, p in module.named_parameters()}
        trainer = make_trainer(ZeroStrategy(stage=stage, expert_parallel=2, param_persistence_threshold=0),
                               devices=2, max_steps=2, use_distributed_sampler=True)
        trainer.fit(module, _loader(2, 2))
        received = [m.router_stats for m in module.modules() if isinstance(m, MoELayer)]
        state = trainer.strategy.lightning_module_state_dict()
        starved = "model.blocks.0.mlp.experts.up_proj"
        decay = (1 - 1e-3 * 0.1) ** 2  # AdamW with no gradient: weight decay alone (lr 1e-3, decay 0.1, 2 steps)
        out[stage] = {
            "losses": module.losses, "sent_to_rank1": sum(int(s.tokens_per_expert[2:].sum()) for s in received),
            "expert3_moved": float((state[starved][3] - initial[starved][3] * decay).abs().max()) if rank == 0 else 0.0,
            "expert2_moved": float((state[starved][2] - initial[starved][2]).abs().max()),
        }
    return out


@pytest.mark.distributed
def test_starved_experts_train_at_every_zero_stage_without_a_hang(gloo_pool: GlooPool) -> None:
    """Every rank takes part in every all-to-all with empty splits (Note [expert dispatch]): ZeRO 0-3 each finish
    their steps; the expert no token reaches gets no gradient (AdamW only decays it), the others train."""
    results = gloo_pool.run("tests.distributed.test_expert_parallel_state:starved_body", stages=[0, 1, 2, 3],
                            _timeout_s=600)
    for rank, per_stage in enumerate(results):
        for stage, r in per_stage.items():
            assert len(r["losses"]) == 2 and all(torch.isfinite(torch.tensor(r["losses"]))), (stage, r)
            assert r["expert3_moved"] < 1e-7 and r["expert2_moved"] > 1e-5, (stage, r)
            if rank == 0:
                assert r["sent_to_rank1"] == 0, (stage, r)


# ------------------------------------------------------------------------------------------- evaluation
def validation_body() -> dict[int, float]:
    """``trainer.validate`` of the same GPT without and with EP 2 (ZeRO 2: no engine outside fit, the module's
    states broadcast instead): the validation loss of each."""
    out = {}
    for ep in (1, 2):
        module = make_model("gpt")
        trainer = make_trainer(ZeroStrategy(stage=2, expert_parallel=ep), devices=2, use_distributed_sampler=True)
        trainer.validate(module, _loader(2, 2), verbose=False)
        out[ep] = float(trainer.callback_metrics["val_loss"])
    return out


@pytest.mark.distributed
def test_validation_outside_fit_keeps_each_ranks_experts(gloo_pool: GlooPool) -> None:
    """Outside fit stages 0-2 broadcast rank 0's states instead of building an engine: a rank's experts come from its
    expert-data group, not from rank 0 (which holds other experts), so EP 2 validates like no EP."""
    for r in gloo_pool.run("tests.distributed.test_expert_parallel_state:validation_body", _timeout_s=300):
        assert abs(r[2] - r[1]) < 1e-6 * abs(r[1]), r


# ------------------------------------------------------------------------------------------- dashboard
def dashboard_body(directory: str) -> list[str]:
    """2 steps of the GPT's MoE at EP 2 with the monitor logging every step into a CSV logger: the metric names."""
    import csv

    from lightning.pytorch.loggers import CSVLogger

    module = make_model("gpt_capacity")
    trainer = make_trainer(ZeroStrategy(stage=2, expert_parallel=2), devices=2, max_steps=2,
                           use_distributed_sampler=True, logger=CSVLogger(directory, name="csv"), log_every_n_steps=1)
    trainer.fit(module, _loader(2, 2))
    files = sorted(Path(directory).glob("csv/*/metrics.csv"))
    if not files:
        return []
    with open(files[0]) as f:
        return sorted({k for row in csv.DictReader(f) for k, v in row.items() if v})


@pytest.mark.distributed
def test_the_dashboard_shows_router_statistics_and_the_all_to_all_bytes(gloo_pool: GlooPool, tmp_path: Path) -> None:
    keys = gloo_pool.run("tests.distributed.test_expert_parallel_state:dashboard_body", directory=str(tmp_path))[0]
    wanted = {"moe/tokens_per_expert/0", "moe/tokens_per_expert/3", "moe/dropped_tokens", "moe/load_imbalance",
              "moe/aux_loss", "moe/z_loss", "traffic/all_to_all_bytes_per_step"}
    assert wanted <= set(keys), sorted(set(keys))


# ------------------------------------------------------------------------------------------- convert
def convert_body(directory: str) -> dict[str, Any]:
    """A Hugging Face Qwen3-MoE trained 2 steps at EP 2 (ZeRO 2), saved; rank 0 converts the checkpoint with
    ``convert_checkpoint`` (``lightning-zero convert``) and loads it into a fresh Qwen3-MoE of the same config,
    strictly; every rank runs the trained (split) model on the same tokens. Returns the logits of both."""
    import torch.distributed as dist

    from lightning_zero.checkpoint import convert_checkpoint

    module = make_model("qwen3_moe")
    trainer = make_trainer(ZeroStrategy(stage=2, expert_parallel=2), devices=2, max_steps=2,
                           use_distributed_sampler=True)
    trainer.fit(module, _loader(2, 2))
    path = str(Path(directory) / "ep2.ckpt")
    trainer.save_checkpoint(path)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        trained = module.model(input_ids=tokens).logits  # the experts over both ranks: every rank runs it
    out: dict[str, Any] = {"trained": trained}
    if dist.get_rank() == 0:
        from safetensors.torch import load_file
        from transformers import Qwen3MoeForCausalLM

        converted = convert_checkpoint(path, Path(directory) / "model.safetensors", prefix="model.")
        fresh = Qwen3MoeForCausalLM(module.model.config)
        fresh.load_state_dict(load_file(converted), strict=True)
        with torch.no_grad():
            out["converted"] = fresh(input_ids=tokens).logits
        out["shape"] = tuple(fresh.model.layers[0].mlp.experts.gate_up_proj.shape)
    dist.barrier()
    return out


@pytest.mark.distributed
def test_convert_gives_the_unsplit_state_dict_a_hugging_face_model_loads(gloo_pool: GlooPool,
                                                                         tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    results = gloo_pool.run("tests.distributed.test_expert_parallel_state:convert_body", directory=str(tmp_path),
                            _timeout_s=300)
    first = results[0]
    assert first["shape"][0] == 4  # all 4 experts, each rank trained 2
    assert torch.allclose(first["converted"], first["trained"], atol=1e-5), (first["converted"] -
                                                                           first["trained"]).abs().max()


# ------------------------------------------------------------------------------------------- memory
class _Held(pl.Callback):
    """The model-state bytes after each optimizer step."""

    def __init__(self) -> None:
        self.bytes: list[Any] = []

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        self.bytes.append(trainer.strategy.model_state_bytes())


def memory_body(stages: list[int], ep: int) -> dict[int, dict[str, Any]]:
    """One optimizer step per ZeRO stage at expert parallelism ``ep``: this rank's model-state bytes after it, and
    the model's dense and (unsplit) expert parameter counts."""
    import torch.distributed as dist

    out = {}
    for stage in stages:
        module = make_model("gpt")
        held = _Held()
        strategy = ZeroStrategy(stage=stage, expert_parallel=ep, param_persistence_threshold=0)
        trainer = make_trainer(strategy, devices=dist.get_world_size(), max_steps=1, use_distributed_sampler=True,
                               callbacks=[held])
        trainer.fit(module, _loader(1, dist.get_world_size()))
        params = list(module.parameters())
        experts = [p for p in params if expert_split_of(p) is not None]
        out[stage] = {"held": held.bytes[0], "dense": sum(p.numel() for p in params if expert_split_of(p) is None),
                      "experts": sum(p.numel() * expert_split_of(p).size for p in experts),
                      "tensors": len(params), "data": dist.get_world_size(), "ep": ep}
    return out


def check_memory(stage: int, r: dict[str, Any]) -> None:
    """This rank's model-state bytes against Note [model state with EP] (within the flat buffers' padding and AdamW's
    step counters), and below the same model without expert parallelism at stages 0-2."""
    expected = expert_parallel_model_state(stage, r["dense"], r["experts"], r["ep"], r["data"])
    without = model_state_formula(stage, r["dense"] + r["experts"], r["data"])
    held = r["held"]
    for kind in ("params", "grads", "optimizer"):
        slack = 16 * 4 * r["data"] * 2 + (4 * r["tensors"] if kind == "optimizer" else 0)
        assert abs(getattr(held, kind) - getattr(expected, kind)) <= slack, (stage, kind, held, expected)
    assert r["experts"] > r["dense"] / 2  # the experts are much of the model
    if stage < 3:
        assert held.params < without.params - r["experts"] * 4 / 3, (stage, held, without)


@pytest.mark.distributed
def test_model_state_per_rank_is_the_expert_parallel_formula_at_every_zero_stage(gloo_pool: GlooPool) -> None:
    """EP 2 on 2 ranks, ZeRO 0-3: a rank holds its 2 of 4 experts and the dense parameters, each ZeRO-partitioned
    over its group (the experts over one expert-data rank: whole; the dense ones over 2 data ranks)."""
    for per_rank in gloo_pool.run("tests.distributed.test_expert_parallel_state:memory_body", stages=[0, 1, 2, 3],
                                  ep=2, _timeout_s=600):
        for stage, r in per_rank.items():
            check_memory(stage, r)


# ------------------------------------------------------------------------------------------- resume
SEGMENT = 2  # optimizer steps per epoch: each run resumes at an epoch boundary (the sampler's order is the same)


def resume_body(stage: int, directory: str) -> dict[str, Any]:
    """On 4 ranks: 6 optimizer steps uninterrupted at EP 2 (x expert-data 2); the same 6 steps as three runs of 2,
    each resumed from the last one's checkpoint: EP 2, then no expert parallelism (data 4), then EP 4. Returns both
    runs' losses and unsplit final weights."""
    import torch.distributed as dist

    world = dist.get_world_size()

    def run(ep: int, epochs: int, ckpt: str | None, save: str | None) -> tuple[list[float], dict[str, torch.Tensor]]:
        module = make_model("gpt")
        trainer = make_trainer(ZeroStrategy(stage=stage, expert_parallel=ep, checkpoint_format="consolidated"),
                               devices=world, max_steps=-1, max_epochs=epochs, use_distributed_sampler=True)
        trainer.fit(module, _loader(SEGMENT, world), ckpt_path=ckpt)
        if save is not None:
            trainer.save_checkpoint(save)
        return module.losses, trainer.strategy.lightning_module_state_dict()

    whole_losses, whole = run(2, 3, None, None)
    a, b = str(Path(directory) / "a.ckpt"), str(Path(directory) / "b.ckpt")
    losses = run(2, 1, None, a)[0]
    losses += run(1, 2, a, b)[0]
    last_losses, last = run(4, 3, b, None)
    losses += last_losses
    return {"losses": (losses, whole_losses),
            "weights": max(float((last[k] - v).abs().max()) for k, v in whole.items()),
            "keys": sorted(last) == sorted(whole)}
