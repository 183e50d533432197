"""Sparse attention inside a real Hugging Face ``transformers`` model (a tiny Llama built from a config, no
download): registered with its mask function (Note [HF masks]), it follows SDPA attention with padding,
grouped-query heads and lengths off the block; generation with a KV cache is refused."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lightning_zero.models.hf_sparse import register_hf_sparse_attention  # noqa: E402
from lightning_zero.sparse_attention import DenseSparsityConfig, FixedSparsityConfig  # noqa: E402

HEADS, MAX = 4, 64


def _llama(implementation: str) -> torch.nn.Module:
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=MAX,
                                      attention_dropout=0.0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation=implementation)
    return model.double()


def _batch(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 97, (2, length), generator=torch.Generator().manual_seed(length))
    mask = torch.ones(2, length, dtype=torch.long)
    mask[1, length - 13:] = 0  # the second row right-padded
    return ids, mask


@pytest.mark.slow
@pytest.mark.parametrize("length", [64, 60])
def test_a_dense_layout_follows_eager_attention_with_padding(length: int) -> None:
    """Dense layout, so the reference is the same model with SDPA attention (eager softmaxes in float32): output
    on the real tokens and the gradients equal (1e-10, float64). Before the mask function was registered padding
    was ignored (0.46 off); a boolean mask was added as 0 / 1 at 60 tokens (0.35 off); grouped-query key heads
    were refused."""
    register_hf_sparse_attention(DenseSparsityConfig(HEADS, block=16), MAX, name="lz_dense_test")
    eager, sparse = _llama("sdpa"), _llama("lz_dense_test")
    sparse.load_state_dict(eager.state_dict())
    ids, mask = _batch(length)
    outs = []
    for model in (eager, sparse):
        logits = model(input_ids=ids, attention_mask=mask).logits
        real = logits[mask.bool()]
        real.square().sum().backward()
        outs.append((real.detach(), [p.grad.clone() for p in model.parameters()]))
    (ref, ref_grads), (got, got_grads) = outs
    assert torch.isfinite(got).all() and (got - ref).abs().max() < 1e-10
    assert max((a - b).abs().max() for a, b in zip(got_grads, ref_grads)) < 1e-9


def test_a_sparse_layout_changes_what_is_attended_and_refuses_a_kv_cache() -> None:
    config = FixedSparsityConfig(HEADS, block=8, num_local_blocks=2, attention="unidirectional")
    register_hf_sparse_attention(config, MAX, name="lz_fixed_test")
    eager, sparse = _llama("sdpa"), _llama("lz_fixed_test")
    sparse.load_state_dict(eager.state_dict())
    ids, mask = _batch(64)
    with torch.no_grad():
        ref = eager(input_ids=ids, attention_mask=mask).logits
        got = sparse(input_ids=ids, attention_mask=mask).logits
    local = slice(0, 16)  # the first window: every earlier key is in the layout, so nothing differs there
    assert (got[:, local] - ref[:, local]).abs().max() < 1e-10
    assert (got[0, 16:] - ref[0, 16:]).abs().max() > 1e-3  # later tokens no longer see the whole past
    with pytest.raises(ValueError, match="use_cache=False"):
        sparse.generate(ids[:1, :8], max_new_tokens=2, do_sample=False, use_cache=True)


@pytest.mark.slow
@pytest.mark.parametrize("executor", ["row_groups", "block_sparse"])
def test_left_padding_follows_sdpa_on_every_executor(executor: str) -> None:
    """Left padding (how a batch is padded for generation): a padded query of the causal model sees padded keys
    only, every key of its row hidden. SDPA and the row-group executor give that row 0; the block-sparse kernel
    gave NaN, which every later layer spread to every logit of the sequence (issue 41, 7). Now every logit and
    every gradient equals SDPA's (1e-10, float64) on each executor."""
    name = f"lz_left_pad_{executor}"
    register_hf_sparse_attention(DenseSparsityConfig(HEADS, block=16), MAX, name=name, executor=executor)
    reference, sparse = _llama("sdpa"), _llama(name)
    sparse.load_state_dict(reference.state_dict())
    ids, mask = _batch(64)
    mask = mask.flip(1)  # the second row left-padded: its first 13 queries attend to nothing
    outs = []
    for model in (reference, sparse):
        logits = model(input_ids=ids, attention_mask=mask).logits
        logits.square().sum().backward()
        outs.append((logits.detach(), [p.grad.clone() for p in model.parameters()]))
    (ref, ref_grads), (got, got_grads) = outs
    assert torch.isfinite(ref).all() and torch.isfinite(got).all()
    assert (got - ref).abs().max() < 1e-10
    assert max((a - b).abs().max() for a, b in zip(got_grads, ref_grads)) < 1e-9
