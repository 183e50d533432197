"""docs/sparse_attention.md's example: a fixed layout, SparseSelfAttention forward + backward on CPU
(the row-group executor, which `auto` picks for CPU training), checked against dense attention masked
by the same layout, then a GPT whose attention is that layout, trained a few steps."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from lightning_zero.models.gpt import GPT, GPT_PRESETS
from lightning_zero.sparse_attention import FixedSparsityConfig, SparseSelfAttention

torch.manual_seed(0)
heads, block, length = 4, 16, 512
config = FixedSparsityConfig(num_heads=heads, block=block, num_local_blocks=4, attention="unidirectional")
attention = SparseSelfAttention(config, max_seq_length=length, causal=True)
q, k, v = (torch.randn(2, heads, length, 32, requires_grad=True) for _ in range(3))
out = attention(q, k, v)
out.sum().backward()

layout = config.make_layout(length).bool()  # (heads, blocks, blocks)
mask = layout.repeat_interleave(block, 1).repeat_interleave(block, 2) & torch.ones(length, length).bool().tril()
reference = F.scaled_dot_product_attention(q.detach(), k.detach(), v.detach(), attn_mask=mask)
print(f"layout density {layout.float().mean():.1%}, max |sparse - masked dense| = "
      f"{(out - reference).abs().max():.2e}")
assert (out - reference).abs().max() < 1e-5

section = {"mode": "fixed", "block": 16, "num_local_blocks": 4, "attention": "unidirectional"}
gpt = GPT(replace(GPT_PRESETS["gpt_tiny"], sparse_attention=section))
optimizer = torch.optim.AdamW(gpt.parameters(), lr=3e-3)
tokens = torch.randint(0, 256, (4, 65))
for step in range(3):
    logits = gpt(tokens[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, 256), tokens[:, 1:].reshape(-1))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(f"step {step}: loss {loss.item():.3f}")
