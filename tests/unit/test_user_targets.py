"""Your own classes in a config (``_target_`` nodes, Note [user targets]): each mistake is one clear error before any
training step. A wrong ``_target_``, a missing module and a key the class does not take are found from the source
before anything starts (``lightning-zero train`` exits 2, nothing is launched); what only an import can tell is
refused the same way by the rank (the worker prints it once and exits 2); a Hugging Face checkpoint lacking a weight,
or holding one the model has no place for, is refused when the model is built, listing them, at stage 3's meta build
as without it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from lightning_zero.config.run.launch import CONFIG_FILE, check_jobs, compose_config, train_command
from lightning_zero.config.schema import to_train_config, to_yaml
from lightning_zero.project import TargetError, TargetNode, locate, static_problems
from lightning_zero.project.locate import PROJECT_ENV

PROJECT = Path(__file__).resolve().parents[1] / "data" / "user_project"
RUN = ["--config-dir", "conf", "model=wave_net", "data=wave_data", "callbacks=default", "logger=csv_file"]


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of tests/data/user_project as the current directory, as a user runs the command there."""
    copy = Path(shutil.copytree(PROJECT, tmp_path / "project", ignore=shutil.ignore_patterns("__pycache__")))
    monkeypatch.chdir(copy)
    monkeypatch.delenv(PROJECT_ENV, raising=False)
    monkeypatch.syspath_prepend(str(copy))  # `wave` imports in this process as it would in a rank
    for name in [m for m in __import__("sys").modules if m == "wave" or m.startswith("wave.")]:
        monkeypatch.delitem(__import__("sys").modules, name)
    return copy


def _refused(capsys: pytest.CaptureFixture[str], *overrides: str) -> str:
    assert train_command([*RUN, *overrides]) == 2
    err = capsys.readouterr().err
    assert not Path("outputs").exists()  # refused before Hydra made a run directory: nothing started
    return err


def test_the_projects_config_composes_typed_and_round_trips_through_the_ranks_file(project: Path) -> None:
    (cfg,) = check_jobs([RUN[2:]], config_dir="conf")
    assert isinstance(cfg.model, TargetNode) and cfg.model.target == "wave.model.WaveNet"
    assert cfg.model.arguments["width"] == 40 and cfg.model.node["optimizer"]["_partial_"] is True
    assert isinstance(cfg.data, TargetNode) and set(cfg.callbacks) == {"step_trace", "lr_monitor"}
    assert set(cfg.logger) == {"csv"} and cfg.logger["csv"].target == "lightning.pytorch.loggers.CSVLogger"
    assert to_train_config(OmegaConf.to_container(OmegaConf.create(to_yaml(cfg)))) == cfg  # what a rank reads
    off = compose_config([*RUN[2:], "callbacks.lr_monitor=null"], config_dir="conf")  # an entry turned off
    assert set(to_train_config(off).callbacks) == {"step_trace"}


def test_hydra_searchpath_adds_the_projects_groups_as_config_dir_does(project: Path) -> None:
    """``hydra.searchpath=[file://conf]`` instead of ``--config-dir conf``: the same groups, the same config."""
    (by_dir,) = check_jobs([RUN[2:]], config_dir="conf")
    (by_searchpath,) = check_jobs([["hydra.searchpath=[file://conf]", *RUN[2:]]])
    assert by_searchpath == by_dir and by_searchpath.model.target == "wave.model.WaveNet"
    from hydra.errors import MissingConfigException

    with pytest.raises(MissingConfigException):  # without either, the project's groups are not found
        check_jobs([RUN[2:]])


def test_a_wrong_target_is_refused_before_launch_with_the_name_it_meant(project: Path, capsys) -> None:
    err = _refused(capsys, "model._target_=wave.model.WaveNett")
    assert "model._target_=wave.model.WaveNett: module wave.model" in err
    assert "defines no 'WaveNett'. Did you mean wave.model.WaveNet?" in err and str(project) in err


def test_a_missing_module_is_refused_before_launch_naming_the_directory_searched(project: Path, capsys) -> None:
    err = _refused(capsys, "data._target_=wavy.data.WaveData")
    assert f"data._target_=wavy.data.WaveData: no module 'wavy' in the project directory {project}" in err
    err = _refused(capsys, "data._target_=wave.dta.WaveData")  # the package is there, its module is not
    assert "no module wave.dta in" in err and "wave/__init__.py defines no 'dta'" in err


def test_a_key_the_class_does_not_take_is_refused_before_launch(project: Path, capsys) -> None:
    err = _refused(capsys, "+model.widht=3")
    assert "model.widht: wave.model.WaveNet takes no argument 'widht'" in err and "Fix: model.width=<value>." in err
    err = _refused(capsys, "+callbacks.step_trace.every=2")
    assert "callbacks.step_trace.every: wave.callbacks.StepTrace takes no argument 'every'" in err


def test_a_callbacks_entry_that_is_not_a_target_is_refused(project: Path, capsys) -> None:
    err = _refused(capsys, "+callbacks.oops=3")
    assert "callbacks.oops must be a node with a `_target_`" in err


def test_the_source_check_finds_required_arguments_and_leaves_open_cases_to_the_rank(tmp_path: Path,
                                                                                    monkeypatch) -> None:
    monkeypatch.setenv(PROJECT_ENV, str(tmp_path))
    (tmp_path / "mine.py").write_text(
        "import lightning.pytorch as pl\nfrom typing import Any\n\n"
        "class Needs:\n    def __init__(self, size: int, *, scale: float = 1.0) -> None: ...\n\n"
        "class Open:\n    def __init__(self, **kwargs: Any) -> None: ...\n\n"
        "class Inherits(pl.Callback):\n    pass\n\n"
        "def build(width, depth=2): ...\n")
    assert static_problems(TargetNode("model", {"_target_": "mine.Needs"})) == [
        "model: mine.Needs needs the argument 'size' (no default). Fix: +model.size=<value> on the command line, or "
        "`size:` in the option's yaml."]
    assert static_problems(TargetNode("model", {"_target_": "mine.Needs", "_partial_": True})) == []
    assert static_problems(TargetNode("model", {"_target_": "mine.Open", "anything": 1})) == []  # **kwargs
    assert static_problems(TargetNode("model", {"_target_": "mine.Inherits", "anything": 1})) == []  # inherited
    assert "mine.build takes no argument 'height'" in static_problems(
        TargetNode("model", {"_target_": "mine.build", "width": 1, "height": 2}))[0]
    assert "is a module, not a class" in static_problems(TargetNode("model", {"_target_": "mine"}))[0]


def test_an_import_error_inside_the_users_module_names_the_missing_module_and_the_target(tmp_path: Path,
                                                                                       monkeypatch) -> None:
    monkeypatch.setenv(PROJECT_ENV, str(tmp_path))
    (tmp_path / "needs_numpyy.py").write_text("import numpyy\n\nclass Net:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(TargetError, match=r"model._target_=needs_numpyy.Net: importing module needs_numpyy failed: "
                                          r"No module named 'numpyy'.*" + str(tmp_path)):
        locate(TargetNode("model", {"_target_": "needs_numpyy.Net"}))


@pytest.mark.slow
def test_what_only_the_rank_can_see_is_one_line_and_exit_code_2_from_the_worker(project: Path, capsys) -> None:
    """``LearningRateMonitor`` comes through ``lightning.pytorch.callbacks``' imports: its parameters are not in that
    file, so the key is checked on the rank, after the import, before the Trainer exists."""
    from lightning_zero.config.run.launch import run_job  # noqa: F401  (the worker's own imports, as in a rank)
    from lightning_zero.config.run.worker import main as worker

    overrides = [*RUN[2:], "+callbacks.lr_monitor.bogus=1", "trainer=cpu1"]
    (cfg,) = check_jobs([overrides], config_dir="conf")  # the source cannot tell: accepted before launch
    (project / "run").mkdir()
    (project / "run" / CONFIG_FILE).write_text(to_yaml(cfg))
    assert worker([str(project / "run" / CONFIG_FILE)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("lightning-zero: error: callbacks.lr_monitor.bogus: lightning.pytorch.callbacks."
                              "LearningRateMonitor takes no argument 'bogus'")
    assert not (project / "run" / "result.json").exists() and not list(project.glob("run/record_rank*.json"))


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama and its tokenizer as save_pretrained writes them (safetensors shards and their index)."""
    pytest.importorskip("transformers")
    from lightning_zero.testing.hf_models import save_causal_lm

    root = tmp_path_factory.mktemp("tiny_llama")
    (root / "corpus.txt").write_text("def f(x):\n    return x\n" * 50)
    return save_causal_lm(root / "llama", "llama", (root / "corpus.txt").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("on_meta", [False, True], ids=["whole", "stage3-meta"])
def test_a_checkpoint_missing_a_weight_or_holding_an_unexpected_one_is_refused_listing_them(
        tiny_llama: Path, tmp_path: Path, on_meta: bool) -> None:
    from contextlib import nullcontext

    from safetensors.torch import load_file, save_file

    from lightning_zero.core.common.errors import UsageError
    from lightning_zero.core.stage3.materialize import parameters_on_meta
    from lightning_zero.hf.module import HFCausalLM

    directory = Path(shutil.copytree(tiny_llama, tmp_path / "llama"))
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    where = index["weight_map"]["model.norm.weight"]
    tensors = load_file(str(directory / where))
    tensors.pop("model.norm.weight")
    tensors["model.extra.weight"] = tensors[next(iter(tensors))].clone()
    save_file(tensors, str(directory / where), metadata={"format": "pt"})
    del index["weight_map"]["model.norm.weight"]
    index["weight_map"]["model.extra.weight"] = where
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    module = HFCausalLM(pretrained=str(directory))
    with parameters_on_meta() if on_meta else nullcontext(), pytest.raises(UsageError) as err:
        module.configure_model()
    assert "missing model.norm.weight; unexpected model.extra.weight" in str(err.value)


@pytest.fixture
def hf_files(tmp_path: Path) -> Path:
    """What the launcher reads of a save_pretrained directory (config.json, a safetensors header, a tokenizer)."""
    import torch
    from safetensors.torch import save_file

    def directory(name: str, config: dict) -> Path:
        path = tmp_path / name
        path.mkdir()
        (path / "config.json").write_text(json.dumps(config))
        (path / "tokenizer.json").write_text("{}")
        save_file({"lm_head.weight": torch.zeros(3, 2), "norm.weight": torch.zeros(2)}, str(path / "model.safetensors"))
        return path

    directory("llama", {"model_type": "llama", "num_attention_heads": 4, "num_key_value_heads": 2,
                        "max_position_embeddings": 256, "attention_dropout": 0.1})
    directory("gpt2", {"model_type": "gpt2", "n_head": 4, "n_positions": 256, "attn_pdrop": 0.0})
    (tmp_path / "corpus.txt").write_text("hello world\n" * 100)
    return tmp_path


def _hf_problems(root: Path, arch: str, *overrides: str) -> str:
    with pytest.raises(ValueError) as err:
        check_jobs([["model=hf_causal_lm", f"model.path={root / arch}", "data=text_file",
                     f"data.path={root / 'corpus.txt'}", *overrides]])
    return str(err.value)


@pytest.mark.slow
def test_a_hugging_face_model_is_checked_before_launch_from_its_files(hf_files: Path) -> None:
    (cfg,) = check_jobs([["model=hf_causal_lm", f"model.path={hf_files / 'gpt2'}", "data=text_file",
                          f"data.path={hf_files / 'corpus.txt'}"]])
    assert "hf_causal_lm" in __import__("lightning_zero.config.validate", fromlist=["describe"]).describe(cfg)
    assert "is not a directory" in _hf_problems(hf_files, "nowhere")
    assert "data.seq_len=300 exceeds the model's context (256 positions)" in _hf_problems(
        hf_files, "gpt2", "data.seq_len=300")
    (hf_files / "gpt2" / "tokenizer.json").unlink()
    assert "tokenized with the model's tokenizer, and" in _hf_problems(hf_files, "gpt2")
    assert "model.attention (block-sparse) has no attention dropout" in _hf_problems(
        hf_files, "llama", "model.attention=sparse_fixed")
    assert "needs exactly one of model.path" in _hf_problems(hf_files, "llama", "model.config={model_type:llama}")


@pytest.mark.slow
def test_the_parallel_dimensions_of_a_hugging_face_model_use_its_plans_or_are_refused(hf_files: Path) -> None:
    """Tensor parallel takes the model's own plan (transformers' ``base_model_tp_plan``): refused for GPT-2, which
    has none, for heads the size does not divide, and at stage 3 (built on meta, sliced whole); sequence parallel
    and pipelines are refused with the reason. A Llama at stage 2 with TP 2 is accepted (and trains:
    docs/your_own_model.md)."""
    tp = ["tensor_parallel=tp2", "trainer.devices=2"]
    assert "gpt2 has no tensor-parallel plan in transformers" in _hf_problems(hf_files, "gpt2", *tp)
    assert "tensor_parallel.size=4 does not divide the model's 2 key / value heads" in _hf_problems(
        hf_files, "llama", "tensor_parallel=tp4", "trainer.devices=4")
    assert "at zero.stage=3 is not built yet" in _hf_problems(hf_files, "llama", "zero=stage3", *tp)
    (cfg,) = check_jobs([["model=hf_causal_lm", f"model.path={hf_files / 'llama'}", "data=text_file",
                          f"data.path={hf_files / 'corpus.txt'}", "zero=stage2", *tp]])
    assert cfg.tensor_parallel.size == 2
    assert "sequence_parallel with model=hf_causal_lm is not built" in _hf_problems(
        hf_files, "llama", "sequence_parallel=sp2", "trainer.devices=2")
    problems = _hf_problems(hf_files, "llama", "pipeline=pp2_gpipe", "zero=stage1")
    assert "pipeline with model=hf_causal_lm is not built" in problems and "pipeline layers" not in problems


@pytest.mark.slow
def test_sparse_attention_is_registered_into_a_hugging_face_model_from_the_config(tiny_llama: Path) -> None:
    """``model.attention=sparse_local`` reaches ``transformers``' attention interface: the model is built with the
    block-sparse implementation (a sliding window of 3 blocks of 16), whose first block of positions attends as dense
    attention does, and whose last ones no longer see the whole past."""
    import torch

    from lightning_zero.config.model_zoo import build_module

    modules = {}
    for attention in ("dense", "sparse_local"):
        (cfg,) = check_jobs([["model=hf_causal_lm", f"model.path={tiny_llama}", "data=text_file",
                              f"data.path={tiny_llama.parent / 'corpus.txt'}", f"model.attention={attention}",
                              "zero=stage2"]])
        modules[attention] = build_module(cfg)
        modules[attention].configure_model()
    assert modules["sparse_local"].model.config._attn_implementation == "lightning_zero_sparse"
    ids = torch.randint(0, 100, (1, 128), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        dense, sparse = (modules[a](ids) for a in ("dense", "sparse_local"))
    assert torch.allclose(dense[:, :16], sparse[:, :16], atol=1e-5)  # the first block: every earlier key attended
    assert not torch.allclose(dense[:, 96:], sparse[:, 96:], atol=1e-3)  # later: the window leaves keys out


def test_what_your_module_lacks_for_a_parallel_dimension_is_one_line_from_the_ranks() -> None:
    """A `_target_` model with tensor_parallel or sequence_parallel is checked at setup, on every rank: a module
    without a plan or without `configure_sequence_parallel` is a UsageError, which the worker prints once (exit 2)."""
    from torch import nn

    from lightning_zero.core.common.errors import UsageError
    from lightning_zero.parallel.sequence import StrategySequenceParallel
    from lightning_zero.tensor_parallel.plan import find_plan

    with pytest.raises(UsageError, match="carries no tensor-parallel plan"):
        find_plan(nn.Sequential(nn.Linear(2, 2)), None)
    part = StrategySequenceParallel.__new__(StrategySequenceParallel)
    part.group = type("Group", (), {"size": 2})()
    with pytest.raises(UsageError, match="has no `configure_sequence_parallel"):
        part.attach(nn.Linear(2, 2))
