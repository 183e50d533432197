"""Hugging Face causal LMs through the CLI: a tiny Llama and a tiny GPT-2, saved by ``save_pretrained`` (safetensors
shards with their index, a byte-level BPE tokenizer trained here, no download), fine-tuned by ``lightning-zero train
model=hf_causal_lm model.path=DIR data=text_file`` at ZeRO stage 3 on 2 ranks (one multirun, its ranks in the test
session's pool, one run per model: each built on the meta device, each tensor streamed from the shards into its
owner's shard). The step-0 validation loss equals the model's own loss on the same batches; ``lightning-zero convert
--hf`` writes a directory ``from_pretrained`` loads, whose logits are the trained weights'."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from lightning_zero.cli import main as cli  # noqa: E402
from lightning_zero.testing.hf_models import save_causal_lm  # noqa: E402
from tests.launches import SharedLaunches  # noqa: E402

ARCHS = ("llama", "gpt2")
SEQ, BATCH, VAL = 32, 2, 8  # data.seq_len, data.micro_batch_size, data.max_val_samples (2 batches per rank)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    text = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text()
    (root / "corpus.txt").write_text(text)
    return {arch: save_causal_lm(root / arch, arch, text) for arch in ARCHS} | {"corpus": root / "corpus.txt"}


@pytest.fixture(scope="module")
def runs(models: dict[str, Path], launches: SharedLaunches) -> dict[str, Path]:
    """The multirun, its ranks in the session's pool (Note [shared launches] in tests/launches.py)."""
    paths = ",".join(str(models[a]) for a in ARCHS)
    done = launches.pool_cli(
        "train", "-m", "model=hf_causal_lm", f"model.path={paths}", "data=text_file", f"data.path={models['corpus']}",
        f"data.seq_len={SEQ}", f"data.micro_batch_size={BATCH}", f"data.max_val_samples={VAL}", "zero=stage3",
        "trainer.max_steps=2", "trainer.val_check_interval=null", "model.lr=1e-2", "hydra.sweep.dir=sweep").check()
    sweep = done.cwd / "sweep"
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir() and p.name[0].isdigit())
    return dict(zip(ARCHS, jobs))


def _validation_batches(directory: Path, corpus: Path) -> list[tuple[torch.Tensor, torch.Tensor]]:
    from lightning_zero.models.data import TextDataModule

    data = TextDataModule(seq_len=SEQ, micro_batch_size=BATCH, path=str(corpus), max_bytes=None, max_val_samples=VAL,
                          tokenizer=str(directory))
    data.setup()
    pairs = [data.val_dataset[i] for i in range(len(data.val_dataset))]
    return [tuple(torch.stack(t) for t in zip(*pairs[i:i + BATCH])) for i in range(0, len(pairs), BATCH)]


def _own_loss(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """The model's own loss (transformers' ForCausalLMLoss, labels already shifted), averaged over the batches."""
    with torch.no_grad():
        return sum(model(input_ids=x, labels=y, shift_labels=y).loss.item() for x, y in batches) / len(batches)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_step_zero_validation_loss_is_the_models_own_loss(arch: str, models, runs) -> None:
    result = json.loads((runs[arch] / "result.json").read_text())
    assert result["global_step"] == 2 and result["layout"]["world_size"] == 2
    index = json.loads((models[arch] / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 3  # read from several shards
    model = transformers.AutoModelForCausalLM.from_pretrained(str(models[arch]), dtype=torch.float32).eval()
    batches = _validation_batches(models[arch], models["corpus"])
    assert len(batches) == VAL // BATCH
    assert result["val_loss_start"] == pytest.approx(_own_loss(model, batches), rel=1e-5)
    assert result["val_loss_end"] < result["val_loss_start"]  # it fine-tuned


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_converted_back_it_loads_with_from_pretrained_with_the_trained_weights(arch: str, models, runs,
                                                                               tmp_path: Path) -> None:
    from lightning_zero.checkpoint import consolidate_checkpoint

    checkpoint, out = runs[arch] / "checkpoints" / "last.ckpt", tmp_path / "exported"
    assert cli(["convert", str(checkpoint), str(out), "--hf", "--shard-size", "40KB"]) == 0
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json"} <= names
    assert len([n for n in names if n.endswith(".safetensors")]) >= 2
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    trained = transformers.AutoModelForCausalLM.from_pretrained(str(models[arch]), dtype=torch.float32).eval()
    start = {k: v.clone() for k, v in trained.state_dict().items()}
    loaded = trained.load_state_dict(consolidate_checkpoint(checkpoint, prefix="model."), strict=False)
    tied = {"lm_head.weight"} if trained.get_output_embeddings().weight is trained.get_input_embeddings().weight \
        else set()
    assert not loaded.unexpected_keys and set(loaded.missing_keys) <= tied, loaded  # every weight, nothing else
    assert any(not torch.equal(start[k], v) for k, v in trained.state_dict().items())  # training changed them
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    ids = torch.tensor([tokenizer("def fill(text, width=70):")["input_ids"]])
    with torch.no_grad():
        assert torch.equal(exported(input_ids=ids).logits, trained(input_ids=ids).logits)


@pytest.mark.slow
def test_validate_test_and_predict_read_a_finished_runs_directory_with_the_same_groups(models, runs, tmp_path: Path,
                                                                                       monkeypatch) -> None:
    """``lightning-zero validate / test / predict ckpt_path=<run dir>`` with the training run's groups, on 1 rank
    in this process (the 2-rank sharded checkpoint read at another world size): the validation and test losses
    are the one the run ended with; predict writes each rank's next-token predictions."""
    monkeypatch.chdir(tmp_path)
    groups = ["model=hf_causal_lm", f"model.path={models['llama']}", "data=text_file", f"data.path={models['corpus']}",
              f"data.seq_len={SEQ}", f"data.micro_batch_size={BATCH}", f"data.max_val_samples={VAL}", "zero=stage3",
              "trainer=cpu1", f"ckpt_path={runs['llama']}"]
    assert cli(["validate", *groups, "hydra.run.dir=val"]) == 0
    result = json.loads((tmp_path / "val" / "result.json").read_text())
    assert result["checkpoint"] == str((runs["llama"] / "checkpoints" / "last.ckpt").resolve())
    ended = json.loads((runs["llama"] / "result.json").read_text())["val_loss_end"]
    assert result["metrics"]["val_loss"] == pytest.approx(ended, rel=1e-5)
    assert cli(["test", *groups, "hydra.run.dir=tst"]) == 0
    tested = json.loads((tmp_path / "tst" / "result.json").read_text())
    assert tested["metrics"]["test_loss"] == pytest.approx(ended, rel=1e-5)  # the held-out split again
    assert cli(["predict", *groups, "hydra.run.dir=pred"]) == 0
    predictions = torch.load(tmp_path / "pred" / "predictions" / "rank0.pt")
    assert len(predictions) == VAL // BATCH and predictions[0].shape == (BATCH, SEQ)
    assert cli(["validate", *groups[:-1], "ckpt_path=nowhere", "hydra.run.dir=bad"]) == 2  # refused before launch
    assert not (tmp_path / "bad").exists()


@pytest.mark.slow
def test_model_config_builds_random_weights_that_train_with_the_given_tokenizer(models, tmp_path: Path,
                                                                               monkeypatch) -> None:
    """``model.config=<config.json>`` (no weights) with ``model.tokenizer=DIR``: one step on 1 rank in this process.
    Freshly initialised weights (std 0.02) predict every token nearly alike, so the step-0 validation loss is
    ln(vocabulary) of the config, read through the given tokenizer's ids."""
    import math

    monkeypatch.chdir(tmp_path)
    vocab = json.loads((models["llama"] / "config.json").read_text())["vocab_size"]
    assert cli(["train", "model=hf_causal_lm", f"model.config={models['llama'] / 'config.json'}",
                f"model.tokenizer={models['llama']}", "data=text_file", f"data.path={models['corpus']}",
                f"data.seq_len={SEQ}", f"data.micro_batch_size={BATCH}", f"data.max_val_samples={VAL}",
                "trainer=cpu1", "trainer.max_steps=1", "trainer.val_check_interval=null", "hydra.run.dir=run"]) == 0
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["global_step"] == 1
    assert result["val_loss_start"] == pytest.approx(math.log(vocab), abs=0.05)
