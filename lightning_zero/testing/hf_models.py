"""Small Hugging Face causal LMs saved the way a user's are, for the tests and the benchmarks, built here with no
download: a byte-level BPE tokenizer trained on a text (``tokenizers``), and a Llama or a GPT-2 of a chosen size with
random weights, written by ``save_pretrained`` in safetensors shards with their index, beside the tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")


def save_tokenizer(text: str, out: str | Path, vocab_size: int = 320) -> Any:
    """A byte-level BPE tokenizer trained on ``text`` and saved in ``out`` (``tokenizer.json`` and its config), as
    ``AutoTokenizer.from_pretrained(out)`` reads it; returns the ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=SPECIAL_TOKENS[0]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(text.splitlines(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=SPECIAL_TOKENS[0], bos_token=SPECIAL_TOKENS[1],
                                   eos_token=SPECIAL_TOKENS[2])
    fast.save_pretrained(str(out))
    return fast


def causal_lm_config(arch: str, vocab_size: int, hidden: int = 32, layers: int = 2, heads: int = 4,
                     positions: int = 128, tie: bool = True) -> Any:
    """A ``transformers`` config: ``llama`` (grouped-query attention, rotary positions, RMSNorm) or ``gpt2`` (learned
    positions, LayerNorm, fused Conv1D attention), with no dropout (sparse attention and exact comparisons)."""
    from transformers import GPT2Config, LlamaConfig

    if arch == "llama":
        return LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                           num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                           max_position_embeddings=positions, tie_word_embeddings=tie, attention_dropout=0.0)
    if arch == "gpt2":
        return GPT2Config(vocab_size=vocab_size, n_embd=hidden, n_layer=layers, n_head=heads, n_positions=positions,
                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=tie,
                          bos_token_id=1, eos_token_id=2)  # the tokenizer's <s> and </s>
    raise ValueError(f"arch must be llama or gpt2, got {arch!r}")


def save_causal_lm(out: str | Path, arch: str, tokenizer_text: str, seed: int = 0, max_shard_size: str = "40KB",
                   **shape: Any) -> Path:
    """A random ``arch`` model (``causal_lm_config`` with ``shape``) and a tokenizer trained on ``tokenizer_text``,
    saved in ``out`` by ``save_pretrained``: safetensors shards of at most ``max_shard_size`` and their index."""
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out)
    tokenizer = save_tokenizer(tokenizer_text, out)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(causal_lm_config(arch, len(tokenizer), **shape), dtype=torch.float32)
    model.save_pretrained(str(out), max_shard_size=max_shard_size)
    return out
