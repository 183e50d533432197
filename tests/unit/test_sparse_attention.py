"""``SparseSelfAttention`` equals dense attention with the layout as its mask: outputs and the
gradients of query, key and value, for every sparsity config, in float64 (1e-10), float32 (1e-5),
bfloat16 and float16, with key padding, attention masks in both modes, rpe and causal masking."""

from __future__ import annotations

import pytest
import torch

from lightning_zero.sparse_attention import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    LocalSlidingWindowSparsityConfig,
    SparseSelfAttention,
    VariableSparsityConfig,
)

H, BLOCK = 4, 8
CONFIGS = {
    "dense": lambda: DenseSparsityConfig(H, block=BLOCK),
    "fixed_uni": lambda: FixedSparsityConfig(H, block=BLOCK, num_local_blocks=2, attention="unidirectional"),
    "fixed_per_head": lambda: FixedSparsityConfig(H, block=BLOCK, different_layout_per_head=True, num_local_blocks=4,
                                                  num_different_global_patterns=4, horizontal_global_attention=True),
    "variable": lambda: VariableSparsityConfig(H, block=BLOCK, num_random_blocks=1, local_window_blocks=[1, 2],
                                               global_block_indices=[1], seed=3),
    "bigbird": lambda: BigBirdSparsityConfig(H, block=BLOCK, different_layout_per_head=True, seed=4),
    "bslongformer": lambda: BSLongformerSparsityConfig(H, block=BLOCK, global_block_indices=[0, 5]),
    "sliding": lambda: LocalSlidingWindowSparsityConfig(H, block=BLOCK, num_sliding_window_blocks=3),
}
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 3e-3}


def dense_reference(q, k, v, layout, causal=False, kp=None, am=None, rpe=None):
    """Softmax attention over the full score matrix, in float64, with the layout as a mask; a query with every
    key hidden gets 0 (as SDPA gives it), without a NaN in its graph."""
    q, k, v = (t.double() for t in (q, k, v))
    length = q.shape[-2]
    allowed = layout.bool().repeat_interleave(BLOCK, 1).repeat_interleave(BLOCK, 2)[:, :length, :length]
    if causal:
        allowed = allowed & torch.ones(length, length, dtype=torch.bool).tril()
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    for extra in (rpe, None if kp is None else kp[:, None, None, :], am):
        if extra is not None:
            s = s + extra.double()
    s = s.masked_fill(~allowed, float("-inf"))
    empty = (s == float("-inf")).all(-1, keepdim=True)
    return torch.softmax(s.masked_fill(empty, 0.0), -1).masked_fill(empty, 0.0) @ v


def _inputs(dtype, length=96, batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, H, length, 16, generator=g).to(dtype).requires_grad_() for _ in range(3)]


def _compare(module, dtype, causal=False, kp=None, am=None, rpe=None, kp_add=None, am_add=None):
    q, k, v = _inputs(dtype)
    out = module(q, k, v, rpe=rpe, key_padding_mask=kp, attn_mask=am)
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = dense_reference(qr, kr, vr, module.get_layout(q.shape[-2]), causal, kp_add, am_add, rpe)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out.backward(grad.to(dtype))
    ref.backward(grad)
    tol = TOLERANCE[dtype]
    scale = ref.abs().max().item()
    assert (out.double() - ref).abs().max().item() <= tol * max(1.0, scale)
    for mine, theirs in ((q.grad, qr.grad), (k.grad, kr.grad), (v.grad, vr.grad)):
        assert (mine.double() - theirs).abs().max().item() <= tol * max(1.0, theirs.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_equals_masked_dense_attention(name: str, dtype: torch.dtype) -> None:
    causal = name in ("fixed_uni", "sliding")
    module = SparseSelfAttention(CONFIGS[name](), max_seq_length=128, causal=causal, chunk_elements=4000)
    assert len(module._row_chunks(96, 2 * H, torch.device("cpu"))) > 2  # several chunks of rows
    _compare(module, dtype, causal=causal)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_masks_in_both_modes_and_rpe(dtype: torch.dtype) -> None:
    length = 96
    g = torch.Generator().manual_seed(5)
    keep = torch.ones(2, length)
    keep[0, 70:] = 0  # padded keys of the first sequence
    am_mul = (torch.rand(length, length, generator=g) > 0.2).float()
    am_mul.fill_diagonal_(1)  # every query keeps a key
    rpe = torch.randn(1, H, length, length, generator=g, dtype=dtype)
    neg_inf = torch.tensor(float("-inf"))
    kp_add = torch.where(keep == 0, neg_inf, 0.0)
    am_add = torch.where(am_mul == 0, neg_inf, 0.0)
    mul = SparseSelfAttention(CONFIGS["bslongformer"](), key_padding_mask_mode="mul", attn_mask_mode="mul",
                              max_seq_length=length, chunk_elements=5000)
    _compare(mul, dtype, kp=keep[:, None, None, :], am=am_mul, rpe=rpe, kp_add=kp_add, am_add=am_add)
    add = SparseSelfAttention(CONFIGS["fixed_uni"](), key_padding_mask_mode="add", attn_mask_mode="add",
                              max_seq_length=length, causal=True)
    soft = torch.randn(2, length, generator=g) * 0.5  # an additive mask need not be 0 / -inf
    _compare(add, dtype, causal=True, kp=soft, am=am_add, kp_add=soft, am_add=am_add)


def test_a_boolean_attention_mask_means_attend_in_add_mode_too() -> None:
    """PyTorch's / Hugging Face's SDPA convention (True attends) in ``add`` mode: the same as the additive
    0 / -inf mask, never added as 0 / 1."""
    length = 96
    keep = torch.rand(length, length, generator=torch.Generator().manual_seed(7)) > 0.3
    keep.fill_diagonal_(True)
    additive = torch.zeros(length, length).masked_fill(~keep, float("-inf"))
    module = SparseSelfAttention(CONFIGS["fixed_uni"](), attn_mask_mode="add", max_seq_length=length, causal=True)
    q, k, v = _inputs(torch.float64, length)
    assert torch.allclose(module(q, k, v, attn_mask=keep), module(q, k, v, attn_mask=additive), atol=1e-12)


def test_the_layout_is_kept_as_bits_and_once_when_every_head_shares_it() -> None:
    """Note [layout as bits]: an eighth of a bool layout, one copy for a layout every head shares; unpacked it is
    ``make_layout(max_seq_length)``'s corner at every length."""
    config = CONFIGS["fixed_uni"]()
    shared = SparseSelfAttention(config, max_seq_length=256)
    blocks = 256 // config.block
    assert shared._layout.nbytes == blocks * -(-blocks // 8)  # one head's bits
    assert torch.equal(shared.master_layout, config.make_layout(256).bool())
    per_head = CONFIGS["fixed_per_head"]()
    assert per_head.different_layout_per_head
    module = SparseSelfAttention(per_head, max_seq_length=256)
    assert module._layout.nbytes == H * blocks * -(-blocks // 8)
    assert module.master_layout.is_contiguous()
    for length in (per_head.block, 96, 256 - per_head.block):
        n = length // per_head.block
        assert torch.equal(module.get_layout(length), per_head.make_layout(256).bool()[:, :n, :n])


@pytest.mark.parametrize("n", [1, 7, 8, 9, 63, 64, 65])
def test_bits_pack_and_unpack_to_the_same_layout(n: int) -> None:
    from lightning_zero.sparse_attention.packed_layout import pack_bits, unpack_bits

    layout = torch.rand(3, n, n, generator=torch.Generator().manual_seed(n)) > 0.5
    assert torch.equal(unpack_bits(pack_bits(layout), n), layout)


def test_refusals_name_the_fix() -> None:
    module = SparseSelfAttention(CONFIGS["dense"](), max_seq_length=64)
    q = torch.randn(1, H, 60, 16)
    with pytest.raises(ValueError, match="pad_to_block_size"):
        module(q, q, q)
    q = torch.randn(1, H, 72, 16)
    with pytest.raises(ValueError, match="max_seq_length"):
        module(q, q, q)
    with pytest.raises(ValueError, match="'add' or 'mul'"):
        SparseSelfAttention(CONFIGS["dense"](), attn_mask_mode="bool")
    q = torch.randn(1, H, 64, 16)
    with pytest.raises(ValueError, match="detached"):
        module(q, q, q, rpe=torch.zeros(1, H, 64, 64, requires_grad=True))
    with pytest.raises(RuntimeError, match="no backward on CPU"):
        SparseSelfAttention(CONFIGS["dense"](), max_seq_length=64, executor="flex")(q.requires_grad_(), q, q)


def test_key_given_transposed_like_deepspeed_accepts() -> None:
    module = SparseSelfAttention(CONFIGS["fixed_uni"](), max_seq_length=64, executor="block_sparse")
    q, k, v = (t.detach() for t in _inputs(torch.float64, length=64))
    assert torch.equal(module(q, k.transpose(-1, -2), v), module(q, k, v))


@pytest.mark.slow
def test_flex_attention_forward_on_cpu_equals_the_kernel() -> None:
    """Inference on CPU goes through compiled FlexAttention (auto), with the same result."""
    module = SparseSelfAttention(CONFIGS["bigbird"](), key_padding_mask_mode="mul", max_seq_length=128, causal=True)
    q, k, v = (t.detach().float() for t in _inputs(torch.float32, length=128))
    kp = torch.ones(2, 128)
    kp[1, 100:] = 0
    with torch.no_grad():
        flex = module(q, k, v, key_padding_mask=kp)
        module.executor = "block_sparse"
        kernel = module(q, k, v, key_padding_mask=kp)
    ref = dense_reference(q, k, v, module.get_layout(128), True, torch.where(kp == 0, float("-inf"), 0.0))
    assert (flex.double() - ref).abs().max() < 1e-5 and (kernel.double() - ref).abs().max() < 1e-5


def test_hugging_face_attention_function_on_an_hf_like_module() -> None:
    """The function HF's AttentionInterface calls, on a minimal module (tests/unit/test_sparse_hf.py runs it in a real
    Llama): causal, 60 tokens (padded to the block inside), with an additive 4-D mask."""
    from lightning_zero.sparse_attention import SparseAttentionUtils

    config = CONFIGS["fixed_uni"]()
    fn = SparseAttentionUtils.hf_attention_function(config, max_position=64)

    class HFLikeAttention(torch.nn.Module):
        is_causal = True

    q, k, v = (t.detach() for t in _inputs(torch.float64, length=60))
    extra = torch.zeros(1, 1, 60, 60, dtype=torch.float64)
    extra[..., 7] = float("-inf")  # hide key 7 from everyone else
    extra[0, 0, 7, 7] = 0.0
    out, weights = fn(HFLikeAttention(), q, k, v, extra, scaling=16 ** -0.5)
    layout = config.make_layout(64)
    ref = dense_reference(q, k, v, layout, causal=True, am=extra[0, 0])
    assert weights is None and out.shape == (2, 60, H, 16)
    assert (out.transpose(1, 2) - ref).abs().max() < 1e-10
    with pytest.raises(ValueError, match="scales scores"):
        fn(HFLikeAttention(), q, k, v, None, scaling=0.5)


@pytest.mark.slow
def test_building_the_module_never_holds_make_layouts_int64_for_every_head() -> None:
    """Note [layout as bits]: the layout is made as bool for the distinct heads and packed a band at a time. At 8k
    tokens, blocks of 8, 4 heads sharing one layout, building the module grew the peak resident memory by 41 MB
    (make_layout's int64 for every head, 32 MiB); now about 8 MB (the bool layout of one head is 1 MiB).
    Measured in a fresh process: the peak is the kernel's (VmHWM), not a count of requested sizes."""
    import subprocess
    import sys

    script = (
        "import ctypes; ctypes.CDLL('libc.so.6').mallopt(-3, 128 * 1024)\n"
        "from lightning_zero.testing.memory import proc_status_bytes, reset_peak_rss\n"
        "from lightning_zero.sparse_attention import FixedSparsityConfig, SparseSelfAttention\n"
        "config = FixedSparsityConfig(4, block=8, num_local_blocks=32, attention='unidirectional')\n"
        "base = proc_status_bytes('VmRSS'); reset_peak_rss()\n"
        "module = SparseSelfAttention(config, max_seq_length=8192, causal=True)\n"
        "print((proc_status_bytes('VmHWM') - base) / 2**20, module._layout.nbytes)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=300)
    grown_mb, kept = out.stdout.split()
    assert int(kept) == 1024 * 1024 // 8  # one head's bits
    assert float(grown_mb) < 20, f"building the module grew the peak by {grown_mb} MB"


@pytest.mark.parametrize("executor", ["row_groups", "block_sparse", pytest.param("flex", marks=pytest.mark.slow)])
def test_a_query_with_every_key_hidden_gets_zero_output_and_gradient_on_every_executor(executor: str) -> None:
    """Left padding under a causal mask: the first queries of the second sequence see padded keys only. Their
    output is 0 and gives no gradient, the other rows equal dense attention, on every executor (the
    block-sparse kernel returned NaN there: issue 41, 7). FlexAttention runs on CPU without a backward only."""
    length = 64
    keep = torch.ones(2, length)
    keep[1, :20] = 0  # left padding: queries 0-19 of sequence 1 have no key left
    module = SparseSelfAttention(CONFIGS["fixed_uni"](), key_padding_mask_mode="mul", max_seq_length=length,
                                 causal=True, executor=executor)
    q, k, v = _inputs(torch.float32 if executor == "flex" else torch.float64, length)
    hidden = torch.zeros(2, H, length, dtype=torch.bool)
    hidden[1, :, :20] = True
    neg_inf = torch.tensor(float("-inf"))
    ref = dense_reference(q, k, v, module.get_layout(length), True, torch.where(keep == 0, neg_inf, 0.0))
    if executor == "flex":
        out = module(q.detach(), k.detach(), v.detach(), key_padding_mask=keep)
        assert out[hidden].abs().max() == 0 and (out[~hidden].double() - ref[~hidden]).abs().max() < 1e-5
        return
    out = module(q, k, v, key_padding_mask=keep)
    assert torch.isfinite(out).all() and out[hidden].abs().max() == 0
    assert (out - ref).abs().max() < 1e-10
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    mine = torch.autograd.grad(out, (q, k, v), grad)
    theirs = torch.autograd.grad(ref, (q, k, v), grad)
    for a, b in zip(mine, theirs):
        assert torch.isfinite(a).all() and (a - b).abs().max() < 1e-10
