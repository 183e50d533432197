"""A tiny Hugging Face model directory as save_pretrained writes one, with no download: a byte-level BPE tokenizer
trained on a file of the Python standard library, a Llama (or GPT-2) with random weights in safetensors shards and
their index, and a text file to fine-tune on (docs/your_own_model.md):

    .venv/bin/python docs/examples/save_tiny_hf_model.py outputs/tiny_llama [llama|gpt2]
"""

import sys
import sysconfig
from pathlib import Path

from lightning_zero.testing.hf_models import save_causal_lm

out = Path(sys.argv[1] if len(sys.argv) > 1 else "outputs/tiny_llama")
arch = sys.argv[2] if len(sys.argv) > 2 else "llama"
text = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text()
save_causal_lm(out, arch, text)
(out.parent / "corpus.txt").write_text(text)
print(f"wrote {out}: {', '.join(sorted(p.name for p in out.iterdir()))}; and {out.parent / 'corpus.txt'}")
