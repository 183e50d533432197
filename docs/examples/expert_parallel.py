"""Expert parallelism on 2 CPU processes, for each of the three ways a model gets MoE layers (docs/expert_parallel.md):

* ``deepspeed``: DeepSpeed code ported with an import change (``from lightning_zero.moe import MoE``);
* ``hf``: a Hugging Face Qwen3-MoE built from its config (its ``base_model_ep_plan`` is found on the module);
* ``gpt``: the project's GPT with its MoE option (``model.moe``).

Each trains a few steps at ZeRO 2 with ``ZeroStrategy(expert_parallel=2)``: each rank holds 2 of the 4 experts of
every MoE layer and its tokens travel to them; the saved checkpoint holds the unsplit model.

Run: python docs/examples/expert_parallel.py             (all three routes; or name one: deepspeed, hf, gpt)
"""

import os
import sys
import tempfile

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero import ZeroStrategy
from lightning_zero.moe import MoE

VOCAB, SEQ = 64, 16


class DeepSpeedStyle(pl.LightningModule):
    """A layer of DeepSpeed MoE code, unchanged but for the import: ``MoE`` returns ``(output, l_aux, exp_counts)``."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        expert = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        self.moe = MoE(hidden_size=32, expert=expert, num_experts=4, ep_size=2, k=2, capacity_factor=1.25)
        self.head = nn.Linear(32, VOCAB)

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.embed(x)
        out, l_aux, _ = self.moe(h)
        loss = nn.functional.cross_entropy(self.head(h + out).reshape(-1, VOCAB), y.reshape(-1))
        self.log("train_loss", loss)
        return loss + 0.01 * l_aux

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class HuggingFaceMoE(pl.LightningModule):
    """A Hugging Face Qwen3-MoE as a submodule, trained on its own loss plus its load-balancing loss."""

    def __init__(self):
        super().__init__()
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        config = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=8, moe_intermediate_size=16, num_experts=4,
                                num_experts_per_tok=2, max_position_embeddings=SEQ, output_router_logits=True)
        self.model = Qwen3MoeForCausalLM(config)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.model(input_ids=x, labels=y).loss  # the model adds router_aux_loss_coef x its aux loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def build(route):
    if route == "deepspeed":
        return DeepSpeedStyle()
    if route == "hf":
        return HuggingFaceMoE()
    from lightning_zero.models.gpt import GPTConfig, GPTLightningModule

    moe = {"num_experts": 4, "top_k": 2, "aux_loss_coef": 0.01}  # the CLI's model.moe.*
    return GPTLightningModule(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, n_layer=2, n_head=4, n_embd=32, moe=moe),
                              lr=1e-2, warmup_steps=0)


def train(route):
    torch.manual_seed(0)
    tokens = torch.randint(0, VOCAB, (64, SEQ + 1), generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=8)
    model = build(route)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=ZeroStrategy(stage=2, expert_parallel=2),
                         max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(model, data)
    path = os.path.join(tempfile.gettempdir(), f"lightning_zero_expert_parallel_{route}.ckpt")
    trainer.save_checkpoint(path)  # the unsplit experts: resumes at any expert-parallel size, or without
    local = next(tuple(p.shape) for n, p in model.named_parameters() if "experts" in n)
    if trainer.is_global_zero:
        state = torch.load(path, weights_only=True)["state_dict"]
        whole = next(tuple(v.shape) for k, v in state.items() if "experts" in k)
        print(f"{route}: loss {float(trainer.callback_metrics['train_loss']):.4f}; this rank's experts {local}, "
              f"the checkpoint's {whole}")


if __name__ == "__main__":
    for name in sys.argv[1:] or ["deepspeed", "hf", "gpt"]:
        train(name)
