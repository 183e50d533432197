"""Tensor parallel (issue 31) styles beyond plain column / row splits: Hugging Face's
``replicated_with_grad_allreduce`` (Qwen3's per-head ``q_norm`` / ``k_norm``), replicated parameters acting on
split activations, the embedding's settings under a vocabulary split, torch's input layouts and the plan's
refusals. Cheap: one process, or the 2-rank gloo pool."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.distributed.test_tensor_parallel import CONFIG, MODELS, CausalLM, _fit, _reference
from tests.pool import GlooPool


class _Qwen3(CausalLM):
    """A Hugging Face Qwen3 built from a config (no download): 4 heads, 2 KV heads, per-head q/k norms."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import Qwen3Config, Qwen3ForCausalLM

        config = Qwen3Config(vocab_size=CONFIG.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                             max_position_embeddings=CONFIG.seq_len)
        self.model = Qwen3ForCausalLM(config)
        with torch.no_grad():  # HF initialises the norms to ones: make each head's scale count
            for name, p in self.model.named_parameters():
                if name.endswith(("q_norm.weight", "k_norm.weight")):
                    p.uniform_(0.5, 1.5)


MODELS["qwen3"] = _Qwen3


def qwen3_body(stage: int) -> dict[str, Any]:
    """TP 2 at ``stage``, 3 steps of 2 accumulated batches, clipped: the losses and norms against the unsplit
    model trained in this process, and this rank's replicated parameters."""
    ref = _reference(1, "qwen3")
    run = _fit(stage, 2, "qwen3", steps=3)
    n = len(run["losses"])
    ref_losses = [step[0] for step in ref["losses"][:n]]  # one data rank
    return {"loss_rel": max(abs(a - b) / abs(b) for a, b in zip(run["losses"], ref_losses, strict=True)),
            "norm_rel": max(abs(a - b) / b for a, b in zip(run["norms"], ref["norms"], strict=False)),
            "steps": len(run["norms"]), "losses": n, "split": run["split"], "replicated": run["replicated"]}


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [1, 3])
def test_qwen3_q_and_k_norms_on_split_heads_follow_the_unsplit_run(gloo_pool: GlooPool, stage: int) -> None:
    """Qwen3's own plan names its per-head ``q_norm`` / ``k_norm`` ``replicated_with_grad_allreduce``: each TP
    rank holds the whole norm but applies it to its own heads only, so its gradient is summed over the TP group.
    The losses and clipped norms follow the unsplit model (1e-5), and every replicated parameter (q/k norms and
    layer norms alike) stays bitwise equal on both TP ranks."""
    pytest.importorskip("transformers")
    a, b = gloo_pool.run("tests.distributed.test_tensor_parallel_styles:qwen3_body", stage=stage)
    for r in (a, b):
        assert r["steps"] == 3 and r["losses"] == 6, r
        assert r["loss_rel"] < 1e-5 and r["norm_rel"] < 1e-5, r
        assert "model.model.layers.1.self_attn.o_proj" in r["split"], r["split"]
    names = a["replicated"].keys()
    assert names == b["replicated"].keys() and "model.model.layers.0.self_attn.q_norm.weight" in names
    differ = {n: float((a["replicated"][n] - b["replicated"][n]).abs().max())
              for n in names if not torch.equal(a["replicated"][n], b["replicated"][n])}
    assert not differ, differ


def drift_body(plan_change: str) -> str:
    """Qwen3 at TP 2 with its q_norm planned 'replicate' (``plan_change="replicate"``) or left out (``"drop"``):
    the error the first step stops with on this rank."""
    from lightning_zero import TensorParallelConfig, ZeroStrategy
    from lightning_zero.tensor_parallel.plan import find_plan
    from tests.distributed.test_tensor_parallel import _loader
    from tests.models import make_trainer

    torch.manual_seed(0)
    module = _Qwen3()
    plan = dict(find_plan(module, None)[0])
    key = "model.model.layers.*.self_attn.q_norm"
    if plan_change == "replicate":
        plan[key] = "replicate"
    else:
        del plan[key]
    strategy = ZeroStrategy(stage=1, tensor_parallel=TensorParallelConfig(2, plan=plan))
    try:
        make_trainer(strategy, devices=2, max_steps=2).fit(module, _loader(1))
    except ValueError as e:
        return str(e)
    return "trained"


@pytest.mark.distributed
@pytest.mark.parametrize("plan_change", ["replicate", "drop"])
def test_a_replicated_parameter_on_split_activations_is_refused_at_the_first_backward(gloo_pool: GlooPool,
                                                                                        plan_change: str) -> None:
    """Note [replicated parameters on split activations]: Qwen3's per-head q_norm planned 'replicate' or left out
    of the plan trained with its copies drifting apart (0.047 after 3 steps); its gradients differ across the TP
    ranks at the first backward, and the fit stops on both ranks naming 'replicated_with_grad_allreduce'."""
    pytest.importorskip("transformers")
    for message in gloo_pool.run("tests.distributed.test_tensor_parallel_styles:drift_body", plan_change=plan_change):
        assert message.startswith("tensor_parallel: the gradient of the replicated parameter 'model.model.layers."), \
            message
        assert "q_norm.weight' differs between the TP ranks" in message, message
        assert "Fix: plan its module 'replicated_with_grad_allreduce'" in message, message


def test_qwen3s_own_plan_sums_the_gradients_of_its_four_q_k_norms() -> None:
    """Qwen3's own plan names its per-head q/k norms 'replicated_with_grad_allreduce'. (The style where the
    activations are replicated, which would multiply a whole gradient by the TP size, is refused at the first
    forward: tests/distributed/test_tensor_parallel_agreement.py.)"""
    pytest.importorskip("transformers")
    from lightning_zero.tensor_parallel.plan import find_plan, resolve_plan
    from lightning_zero.tensor_parallel.styles import ReplicateGradSum

    qwen = _Qwen3()
    plan, source = find_plan(qwen, None)
    norms = [n for n, s in resolve_plan(qwen, plan, source).entries if isinstance(s, ReplicateGradSum)]
    assert norms == [f"model.model.layers.{i}.self_attn.{k}_norm" for i in (0, 1) for k in "qk"]


def embedding_body() -> dict[str, Any]:
    """An ``nn.Embedding`` with a padding row split over the 2-rank pool: the output and every row's gradient
    (the slices gathered) against the unsplit embedding on the same ids, pad ids among them."""
    import torch.distributed as dist
    from torch import nn

    from lightning_zero.tensor_parallel.collectives import TPGroup
    from lightning_zero.tensor_parallel.layers import VocabParallelEmbedding

    out: dict[str, Any] = {}
    for pad in (5, 0, -1):  # rank 1's rows, rank 0's first row, the last row (nn.Embedding makes it 7)
        torch.manual_seed(0)
        whole = nn.Embedding(8, 4, padding_idx=pad)
        ids = torch.tensor([[5, 0, 7, 1], [5, 5, 2, 7]])
        split = VocabParallelEmbedding(whole, TPGroup(dist.group.WORLD, 2, dist.get_rank()), {}, "emb")
        y = split(ids)
        (y * torch.arange(4.0)).sum().backward()
        ref = nn.Embedding(8, 4, padding_idx=pad)
        with torch.no_grad():
            torch.manual_seed(0)
            ref.weight.copy_(nn.Embedding(8, 4, padding_idx=pad).weight)
        y_ref = ref(ids)
        (y_ref * torch.arange(4.0)).sum().backward()
        parts = [torch.empty_like(split.weight.grad) for _ in range(2)]
        dist.all_gather(parts, split.weight.grad)
        out[pad] = {"out": torch.equal(y, y_ref), "grad": torch.equal(torch.cat(parts), ref.weight.grad),
                    "pad_grad": float(torch.cat(parts)[ref.padding_idx].abs().sum())}
    return out


@pytest.mark.distributed
def test_a_vocabulary_parallel_embedding_keeps_its_padding_row_out_of_the_gradient(gloo_pool: GlooPool) -> None:
    """``padding_idx`` in either rank's rows (or negative): the outputs and gradients of the unsplit embedding,
    the padding row's gradient zero."""
    for per_rank in gloo_pool.run("tests.distributed.test_tensor_parallel_styles:embedding_body"):
        for pad, r in per_rank.items():
            assert r == {"out": True, "grad": True, "pad_grad": 0.0}, (pad, r)


def test_embedding_settings_a_vocabulary_split_cannot_honour_are_refused_with_the_fix() -> None:
    from torch import nn

    from lightning_zero.tensor_parallel.collectives import TPGroup
    from lightning_zero.tensor_parallel.layers import VocabParallelEmbedding

    for kwargs, what in (({"scale_grad_by_freq": True}, "scale_grad_by_freq"), ({"sparse": True}, "sparse"),
                         ({"max_norm": 1.0}, "max_norm")):
        with pytest.raises(ValueError, match=rf"^emb: a vocabulary-parallel embedding with {what}=.* is not built.*"
                                             r"Fix: .*leave 'emb' out of the tensor-parallel plan"):
            VocabParallelEmbedding(nn.Embedding(8, 4, **kwargs), TPGroup.single(), {}, "emb")


def test_torch_input_layouts_we_do_not_build_are_refused_and_an_embedding_rowwise_is_vocabulary_parallel() -> None:
    """``RowwiseParallel(input_layouts=Shard(0 or 1))`` (a batch or sequence split input) is refused naming
    sequence parallelism (it became a plain rowwise and failed later on a shape); torchtitan's
    ``RowwiseParallel(input_layouts=Replicate())`` on its token embedding is our vocabulary-parallel embedding,
    and a ``ColwiseParallel`` on an embedding (a split embedding dimension) is refused naming the fix."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from lightning_zero.models.gpt import GPTLightningModule
    from lightning_zero.tensor_parallel.plan import resolve_plan
    from lightning_zero.tensor_parallel.styles import Rowwise, VocabEmbedding, resolve_style

    for dim in (0, 1):
        with pytest.raises(ValueError, match=rf"RowwiseParallel\(input_layouts=shard{dim}\) takes an input split "
                                             r"over the batch or sequence \(sequence parallelism, not built yet\)"):
            resolve_style(RowwiseParallel(input_layouts=Shard(dim)), "o_proj")
    assert resolve_style(RowwiseParallel(input_layouts=Shard(-1)), "o_proj") == Rowwise()
    gpt = GPTLightningModule(CONFIG)
    plan = {"model.tok_emb": RowwiseParallel(input_layouts=Replicate()), "model.blocks.*.mlp.fc": "colwise",
            "model.blocks.*.mlp.proj": "rowwise"}
    assert dict(resolve_plan(gpt, plan, "the given plan").entries)["model.tok_emb"] == VocabEmbedding()
    with pytest.raises(ValueError, match=r"'model.tok_emb' is an nn.Embedding: ColwiseParallel would split its "
                                         r"embedding dimension, which is not built. Fix: "
                                         r"RowwiseParallel\(input_layouts=Replicate\(\)\) or 'embedding_rowwise'"):
        resolve_plan(gpt, {**plan, "model.tok_emb": ColwiseParallel()}, "the given plan")


def test_the_lightning_modules_own_plan_wins_over_a_hugging_face_submodules_and_refusals_name_the_fix(
        caplog: pytest.LogCaptureFixture) -> None:
    """A LightningModule that defines ``tensor_parallel_plan()`` around a Hugging Face model with a ``_tp_plan``:
    its own plan is used (it was silently ignored), and the choice is logged naming both. Two patterns giving
    one module two styles, and a plan that splits nothing, are refused naming the fix."""
    pytest.importorskip("transformers")
    import logging

    from lightning_zero.tensor_parallel.plan import find_plan, resolve_plan

    class Own(_Qwen3):
        def tensor_parallel_plan(self) -> dict[str, str]:
            return {"model.model.layers.*.mlp.gate_proj": "colwise", "model.model.layers.*.mlp.up_proj": "colwise",
                    "model.model.layers.*.mlp.down_proj": "rowwise"}

    module = Own()
    with caplog.at_level(logging.INFO):
        plan, source = find_plan(module, None)
    assert plan == module.tensor_parallel_plan(), plan
    assert source == "the LightningModule's tensor_parallel_plan (over the Hugging Face model's _tp_plan)"
    assert "tensor_parallel_plan() is used instead of the _tp_plan of the Hugging Face model 'model'" in caplog.text
    resolve_plan(module, plan, source)  # the attention stays whole: its q/k norms see whole activations
    twice = {**plan, "model.model.layers.0.mlp.gate_proj": "rowwise"}
    with pytest.raises(ValueError, match=r"'model.model.layers.0.mlp.gate_proj' is matched as Colwise.* and "
                                         r"Rowwise.* by two entries. Fix: give it one style"):
        resolve_plan(module, twice, source)
    with pytest.raises(ValueError, match=r"splits no module: every rank would hold the whole model. Fix: split at "
                                         r"least one nn.Linear \('colwise' / 'rowwise'\)"):
        resolve_plan(module, {"model.model.norm": "replicate"}, source)


# ------------------------------------------------- a Hugging Face model's attention dropout under TP
def hf_attention_dropout_body(implementation: str) -> dict[str, Any]:
    """A Llama with attention dropout 0.5 split by its own plan at TP 2: the generator state each attention
    dropout draws from, the default state after the forward, and the (replicated) logits."""
    import hashlib

    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_zero.tensor_parallel.collectives import TPGroup
    from lightning_zero.tensor_parallel.plan import apply_plan, hf_plan, resolve_plan

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.5)
    model = LlamaForCausalLM(config)
    model.set_attn_implementation(implementation)
    plan = hf_plan(model)
    assert plan is not None
    apply_plan(model, resolve_plan(model, plan, "its own plan"), TPGroup(dist.group.WORLD, 2, dist.get_rank()))

    def state() -> str:
        return hashlib.sha1(torch.get_rng_state().numpy().tobytes()).hexdigest()

    drawn: list[str] = []
    functional = torch.nn.functional
    sdpa, dropout = functional.scaled_dot_product_attention, functional.dropout

    def recording_sdpa(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("dropout_p", 0.0) > 0:
            drawn.append(state())
        return sdpa(*args, **kwargs)

    def recording_dropout(x: torch.Tensor, p: float = 0.5, training: bool = True, *args: Any, **kw: Any) -> Any:
        if training and p > 0:
            drawn.append(state())
        return dropout(x, p, training, *args, **kw)

    functional.scaled_dot_product_attention, functional.dropout = recording_sdpa, recording_dropout
    try:
        torch.manual_seed(1)  # every rank alike, as agree_default_rng leaves them
        logits = model(torch.randint(0, 64, (2, 16))).logits
    finally:
        functional.scaled_dot_product_attention, functional.dropout = sdpa, dropout
    return {"drawn": drawn, "after": state(), "logits": logits.detach()}


@pytest.mark.distributed
@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_a_hugging_face_models_attention_dropout_draws_each_tp_ranks_own_masks(gloo_pool: GlooPool,
                                                                               implementation: str) -> None:
    """Head h of TP rank 0 and head h + H/2 of rank 1 drew one mask (transformers draws attention dropout
    inside its attention function, on the default stream): each layer's attention now draws from the rank's
    own stream, while the replicated stream after it, and the logits, stay the same on both ranks."""
    ranks = gloo_pool.run("tests.distributed.test_tensor_parallel_styles:hf_attention_dropout_body",
                          implementation=implementation)
    first, second = ranks
    assert len(first["drawn"]) == len(second["drawn"]) == 2  # one draw per layer's attention
    assert all(a != b for a, b in zip(first["drawn"], second["drawn"], strict=True))
    assert first["after"] == second["after"]
    assert torch.equal(first["logits"], second["logits"])
