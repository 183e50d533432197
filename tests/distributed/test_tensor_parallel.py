"""Tensor parallel (issue 31): the plan vocabularies and refusals in one process; parity of TP runs with
the unsplit model on the gloo pool (2 ranks) and at TP 2 x data 2 over every ZeRO stage (4 ranks)."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_zero import TensorParallelConfig, ZeroStrategy
from lightning_zero.core.common.memory import model_state_formula, tensor_parallel_model_state
from lightning_zero.models.gpt import GPTConfig, GPTLightningModule
from lightning_zero.tensor_parallel import Colwise, Rowwise, VocabEmbedding, split_dim
from lightning_zero.tensor_parallel.plan import auto_plan, find_plan, resolve_plan
from lightning_zero.tensor_parallel.styles import resolve_style
from tests.models import make_trainer
from tests.pool import GlooPool, Pools

STEPS, ACCUMULATE, CLIP, BATCH = 6, 2, 0.3, 4
CONFIG = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=4, n_embd=32)


# ------------------------------------------------------------------------------------------- one process
def test_both_vocabularies_name_our_styles_and_unknown_or_unbuilt_ones_are_refused() -> None:
    assert resolve_style("colwise", "a") == Colwise() and resolve_style("rowwise", "a") == Rowwise()
    gathered = Colwise(gather_output=True)
    assert resolve_style("colwise_rep", "a") == resolve_style("colwise_gather_output", "a") == gathered
    assert resolve_style("rowwise_rep", "a") == Rowwise(input_is_parallel=False)
    assert resolve_style("embedding_rowwise", "a") == VocabEmbedding()
    from torch.distributed.tensor import Replicate, Shard

    assert resolve_style(ColwiseParallel(), "a") == Colwise()
    assert resolve_style(ColwiseParallel(output_layouts=Replicate()), "a") == Colwise(gather_output=True)
    assert resolve_style(RowwiseParallel(), "a") == Rowwise()
    assert resolve_style(RowwiseParallel(input_layouts=Replicate()), "a") == Rowwise(input_is_parallel=False)
    with pytest.raises(ValueError, match=r"unknown style 'colwize'.*known: colwise"):
        resolve_style("colwize", "layers.*.q")
    with pytest.raises(ValueError, match=r"sequence parallelism.*not built"):
        resolve_style("sequence_parallel", "norm")
    with pytest.raises(ValueError, match="SequenceParallel is not built"):
        resolve_style(SequenceParallel(), "norm")
    with pytest.raises(ValueError, match=r"output_layouts=shard1.*not built"):
        resolve_style(RowwiseParallel(output_layouts=Shard(1)), "o_proj")


def test_a_plan_is_checked_against_the_model_before_anything_changes() -> None:
    module = GPTLightningModule(CONFIG)
    plan, source = find_plan(module, None)
    assert source == "the LightningModule's tensor_parallel_plan"
    names = [n for n, _ in resolve_plan(module, plan, source).entries]
    assert names[0] == "model.tok_emb" and names[-1] == "model.lm_head" and "model.blocks.1.attn.qkv" in names
    with pytest.raises(ValueError, match=r"'model.blocks.\*.attn.q_proj', which matches no module"):
        resolve_plan(module, {"model.blocks.*.attn.q_proj": "colwise"}, "the given plan")
    with pytest.raises(ValueError, match=r"'model.ln_f' is a LayerNorm, but style"):
        resolve_plan(module, {"model.ln_f": "colwise"}, "the given plan")
    with pytest.raises(ValueError, match="splits no module"):
        resolve_plan(module, {"model.ln_f": "replicate"}, "the given plan")


def test_auto_pairs_linears_of_a_sequential_and_plain_modules_without_a_plan_are_refused() -> None:
    stack = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4), nn.LayerNorm(4), nn.Linear(4, 8),
                          nn.Dropout(), nn.Linear(8, 4), nn.Linear(4, 2))
    assert auto_plan(stack) == {"0": Colwise(), "2": Rowwise(), "4": Colwise(), "6": Rowwise()}
    with pytest.raises(ValueError, match=r"found no pair of nn.Linear"):
        auto_plan(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 4)))
    with pytest.raises(ValueError, match="carries no tensor-parallel plan: define `tensor_parallel_plan"):
        find_plan(nn.Linear(2, 2), None)


def test_the_strategy_refuses_what_it_does_not_compose_with_tp_yet() -> None:
    from lightning_zero import PipelineConfig

    assert ZeroStrategy(stage=1, tensor_parallel=2).tensor_parallel == TensorParallelConfig(2)
    both = ZeroStrategy(stage=1, tensor_parallel=2, pipeline=PipelineConfig(stages=2))  # built: issue 31
    assert both.tensor_parallel.size == 2 and both.pipeline_config is not None
    assert ZeroStrategy(stage=3, tensor_parallel=2, offload_optimizer="cpu", offload_param="cpu").offload.enabled
    with pytest.raises(ValueError, match="sequence_parallel=True is not built yet"):
        TensorParallelConfig(2, sequence_parallel=True)
    with pytest.raises(TypeError, match="an int or a TensorParallelConfig"):
        ZeroStrategy(tensor_parallel="2")  # type: ignore[arg-type]


def test_consolidated_checkpoints_of_pipeline_x_tp_stay_refused_before_anything_is_written() -> None:
    from lightning_zero.parallel.tensor import refuse_pipeline_checkpoint

    with pytest.raises(NotImplementedError, match="consolidated checkpoint of pipeline x tensor_parallel=2 is not"):
        refuse_pipeline_checkpoint(TensorParallelConfig(2), True, False)
    refuse_pipeline_checkpoint(TensorParallelConfig(2), True, True)  # from the shards: built (issue 31)
    refuse_pipeline_checkpoint(TensorParallelConfig(2), False, False)  # TP alone: built
    refuse_pipeline_checkpoint(TensorParallelConfig(1), True, False)  # a pipeline alone: built


def test_one_rank_cannot_hold_two_tensor_parallel_ranks() -> None:
    trainer = make_trainer(ZeroStrategy(stage=0, tensor_parallel=2), devices=1, max_steps=1)
    with pytest.raises(ValueError, match="world size 1 is not a multiple of pipeline x sequence x tensor"):
        trainer.fit(GPTLightningModule(CONFIG, warmup_steps=0), _loader(1))


# ------------------------------------------------------------------------------------------- distributed
class _Recorded(GPTLightningModule):
    """The GPT with each batch's loss recorded (the value Lightning backpropagates, times the accumulation)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(CONFIG, lr=1e-2, warmup_steps=0, **kwargs)
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.losses.append(float(loss.detach()))
        return loss


class RecordedLosses(pl.LightningModule):
    """A module of the TP tests that records each training loss (``loss(batch)`` is the subclass's) and trains
    with AdamW at lr 1e-2."""

    def __init__(self) -> None:
        super().__init__()
        self.losses: list[float] = []

    def loss(self, batch: Any) -> torch.Tensor:
        raise NotImplementedError

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class CausalLM(RecordedLosses):
    """A Hugging Face causal LM (``self.model``, set by the subclass) under the next-token loss."""

    def loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        logits = self.model(input_ids=x).logits
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))


class _Llama(CausalLM):
    """A Hugging Face Llama built from a config (no download), GQA (4 heads, 2 KV heads), untied head."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(vocab_size=CONFIG.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONFIG.seq_len)
        self.model = LlamaForCausalLM(config)


class _RecordedSparse(_Recorded):
    """The GPT with fixed sparse attention whose layouts differ per head: each TP rank must attend with its own
    heads' layouts (a rank using the first heads' layouts diverges from the unsplit run)."""

    def __init__(self) -> None:
        GPTLightningModule.__init__(self, replace(CONFIG, sparse_attention=SPARSE_SECTION), lr=1e-2, warmup_steps=0)
        self.losses = []


SPARSE_SECTION = {"mode": "fixed", "block": 2, "num_local_blocks": 4, "attention": "unidirectional",
                  "different_layout_per_head": True, "num_different_global_patterns": 4}
MODELS = {"gpt": _Recorded, "llama": _Llama, "gpt_sparse": _RecordedSparse}


def _loader(seed: int, n: int = STEPS * ACCUMULATE * BATCH * 2) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, CONFIG.vocab_size, (n, CONFIG.seq_len + 1), generator=g)
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=BATCH, shuffle=False)


def _reference(data_ranks: int, model: str = "gpt") -> dict[str, list]:
    """Plain PyTorch on the whole model: batches of ``data_ranks`` x BATCH samples (what ``data_ranks`` data
    replicas see together), AdamW, norm clipping and accumulation as Lightning runs them."""
    torch.manual_seed(0)
    module = MODELS[model]()
    opt = module.configure_optimizers()
    losses, norms = [], []
    # the batches Lightning's DistributedSampler gives each data rank (it shuffles the training data, seeded)
    dataset = _loader(1).dataset
    seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
    data = [iter(DataLoader(dataset, batch_size=BATCH, sampler=DistributedSampler(dataset, data_ranks, r, seed=seed)))
            for r in range(data_ranks)]
    for _ in range(STEPS):
        for _ in range(ACCUMULATE):
            per_rank = [module.loss(next(d)) for d in data]
            losses.append([float(v.detach()) for v in per_rank])
            (sum(per_rank) / (data_ranks * ACCUMULATE)).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(module.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "norms": norms}


def _fit(stage: int, tp: int, model: str = "gpt", offload: dict[str, str] | None = None,
         steps: int = STEPS) -> dict[str, Any]:
    import torch.distributed as dist

    norms: list[float] = []
    held: list[Any] = []
    offloaded: list[bool] = []

    class Norms(pl.Callback):
        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if (batch_idx + 1) % ACCUMULATE == 0:  # after the optimizer step: the norm it clipped by
                norms.append(float(trainer.strategy.engine.last_grad_norm))
                held.append(trainer.strategy.model_state_bytes())
                offloaded.append(trainer.strategy.engine.sharded.offload is not None
                                 if trainer.strategy.engine.sharded is not None else False)

    torch.manual_seed(0)
    module = MODELS[model]()
    whole = {n: p.numel() for n, p in module.named_parameters()}  # the unsplit model, before the plan
    strategy = ZeroStrategy(stage=stage, tensor_parallel=tp, param_persistence_threshold=0, reduce_bucket_size=500,
                            **(offload or {}))
    trainer = make_trainer(strategy, devices=dist.get_world_size(), max_steps=steps, gradient_clip_val=CLIP,
                           accumulate_grad_batches=ACCUMULATE, use_distributed_sampler=True, callbacks=[Norms()])
    trainer.fit(module, _loader(1))
    shapes = {n: tuple(p.shape) for n, p in module.named_parameters()}
    split = sum(p.numel() for p in module.parameters() if split_dim(p) is not None)
    replicated = sum(p.numel() for p in module.parameters() if split_dim(p) is None)
    split_whole = sum(whole[n] for n, p in module.named_parameters() if split_dim(p) is not None)
    return {"losses": module.losses, "norms": norms, "shapes": shapes,
            "data_rank": dist.get_rank() // tp, "held": held[0], "split_numel": split, "replicated_numel": replicated,
            "split_whole": split_whole, "replicated_whole": sum(whole.values()) - split_whole, "tensors": len(whole),
            "split": list(strategy._run.tensor.split) if strategy._run.tensor else [], "offloaded": all(offloaded),
            "replicated": {n: p.detach().clone() for n, p in module.named_parameters() if split_dim(p) is None}}


def parity_body(stages: list[int], tp: int, model: str = "gpt",
                offload: dict[str, str] | None = None) -> dict[int, dict[str, Any]]:
    """Each ZeRO stage's TP run on this rank, with the worst relative differences to the plain reference."""
    import torch.distributed as dist

    data_ranks = dist.get_world_size() // tp
    ref = _reference(data_ranks, model)
    out = {}
    for stage in stages:
        run = _fit(stage, tp, model, offload)
        ref_losses = [step[run["data_rank"]] for step in ref["losses"]]
        out[stage] = {
            "loss_rel": max(abs(a - b) / abs(b) for a, b in zip(run["losses"], ref_losses, strict=True)),
            "norm_rel": max(abs(a - b) / b for a, b in zip(run["norms"], ref["norms"], strict=True)),
            "clipped": min(ref["norms"]) > CLIP, "steps": len(run["norms"]), "shapes": run["shapes"],
            "split": run["split"], "held": run["held"], "split_numel": run["split_numel"],
            "replicated_numel": run["replicated_numel"], "split_whole": run["split_whole"],
            "replicated_whole": run["replicated_whole"], "tensors": run["tensors"],
            "whole_numel": sum(p.numel() for p in MODELS[model]().parameters()),
            "data_ranks": data_ranks, "tp": tp, "norms": (run["norms"], ref["norms"]),
            "losses": (run["losses"], ref_losses), "offloaded": run["offloaded"],
        }
    return out


def memory_body(stages: list[int], tp: int) -> dict[int, dict[str, Any]]:
    """One optimizer step per ZeRO stage at TP ``tp`` on this rank: the model-state bytes the rank holds after
    it, and the unsplit model's split and replicated parameter counts (what the formula takes)."""
    import torch.distributed as dist

    out = {}
    for stage in stages:
        run = _fit(stage, tp, steps=1)
        keys = ("held", "split_numel", "replicated_numel", "split_whole", "replicated_whole", "tensors")
        out[stage] = {k: run[k] for k in keys}
        out[stage].update(tp=tp, data_ranks=dist.get_world_size() // tp)
    return out


def _check_memory(stage: int, r: dict[str, Any]) -> None:
    """This rank's model-state bytes (its flat buffers' storages, counted by ``model_state_bytes()``) against
    Note [model state with TP]: the ZeRO formula of Psi_split / tp + Psi_replicated over the data ranks, the
    counts taken from the unsplit model."""
    assert r["split_whole"] > r["replicated_whole"] > 0, r  # the plan split most of the model, not all of it
    assert r["split_numel"] * r["tp"] == r["split_whole"] and r["replicated_numel"] == r["replicated_whole"], r
    expected = tensor_parallel_model_state(stage, r["split_whole"], r["replicated_whole"], r["tp"], r["data_ranks"])
    unsplit = model_state_formula(stage, r["split_whole"] + r["replicated_whole"], r["data_ranks"])
    held = r["held"]
    for kind in ("params", "grads", "optimizer"):
        # within the flat buffers' padding (< data ranks per unit) and, for the optimizer, AdamW's 4-byte step
        # counter per parameter tensor (stage 0 steps the original parameters)
        slack = 16 * 4 * r["data_ranks"] + (4 * r["tensors"] if kind == "optimizer" else 0)
        assert abs(getattr(held, kind) - getattr(expected, kind)) <= slack, (stage, kind, held, expected)
        assert getattr(held, kind) < getattr(unsplit, kind) * (1 + 1 / r["tp"]) / 2 + slack, (stage, kind, held)


def _check(results: list[dict[int, dict[str, Any]]], stages: list[int]) -> None:
    for per_rank in results:
        assert sorted(per_rank) == stages
        for stage, r in per_rank.items():
            assert r["steps"] == STEPS and r["clipped"], (stage, r)  # the clip acts on every step
            assert r["loss_rel"] < 1e-5 and r["norm_rel"] < 1e-5, (stage, r)
            assert r["split_numel"] * r["tp"] + r["replicated_numel"] == r["whole_numel"], r
            _check_memory(stage, r)


@pytest.mark.distributed
def test_tp2_on_two_ranks_follows_the_unsplit_model(gloo_pool: GlooPool) -> None:
    """fp32 AdamW, clipping at 0.3 (active every step), accumulation 2, 6 steps: the same losses and global
    gradient norms as one process training the whole GPT (the replicated parameters counted once)."""
    results = gloo_pool.run("tests.distributed.test_tensor_parallel:parity_body", stages=[2], tp=2)
    _check(results, [2])
    shapes = results[0][2]["shapes"]  # heads, MLP and vocabulary split in two; layer norms whole
    assert shapes["model.tok_emb.weight"] == (CONFIG.vocab_size // 2, CONFIG.n_embd)
    assert shapes["model.blocks.0.attn.qkv.weight"] == (3 * CONFIG.n_embd // 2, CONFIG.n_embd)
    assert shapes["model.blocks.0.mlp.proj.weight"] == (CONFIG.n_embd, 2 * CONFIG.n_embd)
    assert shapes["model.ln_f.weight"] == (CONFIG.n_embd,)
    assert "model.lm_head.weight" not in shapes  # still tied to the (split) embedding


@pytest.mark.distributed
def test_tp2_with_optimizer_and_parameter_offload_follows_the_unsplit_model(gloo_pool: GlooPool) -> None:
    """Offload x TP composes (it was refused): the engine offloads the shards of the rank's flat buffers, which
    hold its TP slices; ZeRO 2 with the optimizer on the host and ZeRO 3 with parameters too follow the unsplit
    model (losses and clipped global norms within 1e-5)."""
    for stage, offload in [(2, {"offload_optimizer": "cpu"}),
                           (3, {"offload_optimizer": "cpu", "offload_param": "cpu"})]:
        results = gloo_pool.run("tests.distributed.test_tensor_parallel:parity_body", stages=[stage], tp=2,
                                offload=offload)
        for per_rank in results:
            r = per_rank[stage]
            assert r["steps"] == STEPS and r["clipped"] and r["offloaded"], (stage, r)
            assert r["loss_rel"] < 1e-5 and r["norm_rel"] < 1e-5, (stage, offload, r["loss_rel"], r["norm_rel"])


@pytest.mark.distributed
def test_tp2_with_sparse_attention_follows_the_unsplit_model(gloo_pool: GlooPool) -> None:
    """Sparse attention with layouts differing per head, heads split over 2 TP ranks: each rank attends with
    its own heads' layouts, so losses and norms follow the unsplit sparse GPT (issue 32: composes with TP)."""
    results = gloo_pool.run("tests.distributed.test_tensor_parallel:parity_body", stages=[1], tp=2, model="gpt_sparse")
    _check(results, [1])


@pytest.mark.distributed
def test_model_state_per_rank_is_the_tp_formula_at_every_zero_stage_on_two_ranks(gloo_pool: GlooPool) -> None:
    """TP 2 on 2 ranks (one data rank), ZeRO 0-3: each rank holds Psi_split / 2 + Psi_replicated of params,
    grads and AdamW state (Note [model state with TP])."""
    results = gloo_pool.run("tests.distributed.test_tensor_parallel:memory_body", stages=[0, 1, 2, 3], tp=2)
    for per_rank in results:
        assert sorted(per_rank) == [0, 1, 2, 3]
        for stage, r in per_rank.items():
            _check_memory(stage, r)


@pytest.mark.slow
def test_tp2_by_data2_follows_two_data_parallel_ranks_at_every_zero_stage(gloo_pools: Pools) -> None:
    """4 processes, TP groups {0, 1} and {2, 3}: each data replica's losses and the global norms match the
    whole model fed by 2 data-parallel ranks, at ZeRO 0-3 (ZeRO partitions over the data axis only); each
    rank's model state is the TP formula. The same processes then run TP 4 (one group of all 4 ranks) at
    ZeRO 0-3, one step each, its model state against the formula (one spawn for every 4-rank layout)."""
    pool = gloo_pools.get(4)  # the session's, shared with the other 4-rank tests
    results = pool.run("tests.distributed.test_tensor_parallel:parity_body", stages=[0, 1, 2, 3], tp=2,
                       _timeout_s=900)
    tp4 = pool.run("tests.distributed.test_tensor_parallel:memory_body", stages=[0, 1, 2, 3], tp=4, _timeout_s=600)
    _check(results, [0, 1, 2, 3])
    for per_rank in tp4:
        assert sorted(per_rank) == [0, 1, 2, 3]
        for stage, r in per_rank.items():
            assert r["tp"] == 4 and r["data_ranks"] == 1, r
            _check_memory(stage, r)


@pytest.mark.distributed
def test_a_hugging_face_llama_trains_with_its_own_tp_plan_and_follows_the_unsplit_run(gloo_pool: GlooPool) -> None:
    """LlamaForCausalLM as a submodule: its ``_tp_plan`` (HF's vocabulary: colwise q/k/v/gate/up, rowwise o/down,
    embedding_rowwise, colwise_gather_output head) is found and prefixed; 4 heads and 2 KV heads split in two."""
    pytest.importorskip("transformers")
    results = gloo_pool.run("tests.distributed.test_tensor_parallel:parity_body", stages=[1], tp=2, model="llama")
    _check(results, [1])
    split = results[0][1]["split"]
    assert {"model.model.embed_tokens", "model.lm_head", "model.model.layers.1.mlp.down_proj"} <= set(split)
    shapes = results[0][1]["shapes"]
    assert shapes["model.model.layers.0.self_attn.k_proj.weight"] == (2 * 8 // 2, 32)  # 1 of 2 KV heads of dim 8


@pytest.mark.slow
def test_the_cli_config_builds_tp_and_refuses_what_is_not_built_before_launch() -> None:
    from omegaconf import OmegaConf

    from lightning_zero.config.parallel_checks import tensor_parallel_problems, world_problems
    from lightning_zero.config.run.launch import compose_config
    from lightning_zero.config.settings import settings_of
    from lightning_zero.config.validate import validate_config

    ok = ["experiment=gpt_tiny", "tensor_parallel=tp2", "trainer.devices=2"]
    assert settings_of(validate_config(compose_config(ok))).parallel.tensor.size == 2
    assert settings_of(validate_config(compose_config(["experiment=gpt_tiny"]))).parallel.tensor.size == 1
    cases = {
        "trainer.devices=3": "not a multiple of pipeline x sequence x tensor",
        "tensor_parallel=tp4": "",  # see below
        "pipeline=pp2_gpipe": "not a multiple of pipeline x sequence x tensor = 2 x 1 x 2",  # 2 ranks for 2 x 2
        "model.optimizer=onebit_adam": "onebit_adam is not built yet",
        "tensor_parallel.size=3": "model.n_head (attention heads) = 4 does not split over tensor_parallel.size=3",
        # it failed on every rank at setup, after launch
        "model.build_in_configure_model=true": "model built on the meta device (model.build_in_configure_model=true",
    }
    # sequence parallel inside a tensor-parallel group: refused before launch too
    both = compose_config([*ok, "sequence_parallel=sp2", "trainer.devices=4"])
    with pytest.raises(Exception, match="sequence parallel with tensor parallel is not built"):
        validate_config(both)
    for override, message in cases.items():
        cfg = OmegaConf.to_object(compose_config([*ok, override]))
        problems = world_problems(cfg) + tensor_parallel_problems(cfg)  # the ranks are the mesh's check
        if override == "tensor_parallel=tp4":  # 4 divides heads, vocabulary and width: only the world is wrong
            assert problems and all("not a multiple" in p for p in problems), problems
            continue
        assert any(message in p for p in problems), (override, problems)
    piped = [*ok, "pipeline=pp2_gpipe", "trainer.devices=4", "trainer.checkpoint.enabled=true"]
    assert not tensor_parallel_problems(OmegaConf.to_object(compose_config([*piped, "zero=stage1"])))  # sharded
    assert any("checkpoints of pipeline x tensor_parallel at zero.stage=0 are not built yet" in p
               for p in tensor_parallel_problems(OmegaConf.to_object(compose_config([*piped, "zero=stage0"]))))
    unpiped = OmegaConf.to_object(compose_config([*ok, "trainer.checkpoint.enabled=true"]))
    assert not tensor_parallel_problems(unpiped)  # checkpoints with TP are built
    offloaded = OmegaConf.to_object(compose_config([*ok, "offload=optimizer_cpu"]))
    assert not tensor_parallel_problems(offloaded)  # offload x TP composes
    mlp = OmegaConf.to_object(compose_config(["model=mlp", "data=teacher", *ok[1:]]))
    assert any("model=mlp has none" in p for p in tensor_parallel_problems(mlp))
