"""The Hydra configs in conf/: every experiment file and every group option composes, validates and
trains one step (tiny shapes, one in-process rank) -- or raises the NotImplementedError naming its
feature; invalid cross-group combinations and misspelt / mistyped keys are rejected with the reason."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from experiments.gpt import GPT, count_parameters
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError

from lightning_zero.config.describe import describe
from lightning_zero.config.run.build import RESULT_FILE, build_strategy
from lightning_zero.config.run.launch import CONFIG_FILE, compose_config, conf_dir, expand_sweep, run_job
from lightning_zero.config.schema import (
    GPTModelSchema,
    MLPModelSchema,
    TeacherDataSchema,
    TextDataSchema,
    TrainConfig,
    to_train_config,
    to_yaml,
)
from lightning_zero.config.validate import validate_config

CONF = conf_dir()
GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir() and p.name != "experiment")
OPTIONS = [(g, f.stem) for g in GROUPS for f in sorted((CONF / g).glob("*.yaml"))]
EXPERIMENTS = sorted(f.stem for f in (CONF / "experiment").glob("*.yaml"))
CORPUS = "{corpus}"  # replaced by a small text file
HF_DIR = "{hf_dir}"  # replaced by a directory with the files model=hf_causal_lm checks before launch

# Options that need other groups to form a valid combination.
COMPANIONS: dict[tuple[str, str], list[str]] = {
    ("model", "mlp"): ["data=teacher"],
    ("data", "teacher"): ["model=mlp"],
    ("data", "text_file"): [f"data.path={CORPUS}"],
    ("model", "hf_causal_lm"): [f"model.path={HF_DIR}"],
    ("experiment", "gpt_text_file"): [f"data.path={CORPUS}"],
    ("offload", "optimizer_nvme"): ["zero=stage1", "offload.nvme_path=/tmp"],
    ("offload", "param_cpu"): ["zero=stage3"],
    ("offload", "param_nvme"): ["zero=stage3", "offload.nvme_path=/tmp"],
    ("pipeline", "pp2_gpipe"): ["zero=stage1"],
    ("pipeline", "pp2_1f1b"): ["zero=stage1"],
    ("pipeline", "pp4_interleaved"): ["zero=stage1", "trainer.devices=4"],
    ("sequence_parallel", "sp2"): ["trainer.devices=2"],
    ("sequence_parallel", "sp4"): ["trainer.devices=4"],
    ("tensor_parallel", "tp2"): ["trainer.devices=2"],  # with checkpoints (the experiment's default)
    ("tensor_parallel", "tp4"): ["trainer.devices=4"],
    ("expert_parallel", "ep2"): ["trainer.devices=2", "model.moe.num_experts=4"],
    ("expert_parallel", "ep4"): ["trainer.devices=4", "model.moe.num_experts=4"],
}
# Options whose feature is not built yet: the text their NotImplementedError must contain.
UNBUILT: dict[tuple[str, str], str] = {}  # every option is built today (parameter offload was the last)
# Pipelined options need one process per stage: validated and counted here, trained by tests/e2e/test_pipeline.py.
PIPELINED = {("pipeline", "pp2_gpipe"), ("pipeline", "pp2_1f1b"), ("pipeline", "pp4_interleaved"),
             ("experiment", "gpt_350m_pipeline")}
# Sequence-parallel options need P processes: validated here, trained by tests/e2e/test_sequence_parallel.py.
SEQUENCE_PARALLEL = {("sequence_parallel", "sp2"), ("sequence_parallel", "sp4")}
# Tensor-parallel options need N processes too: validated here, trained by tests/distributed/test_tensor_parallel.py.
TENSOR_PARALLEL = {("tensor_parallel", "tp2"), ("tensor_parallel", "tp4")}
# Expert-parallel options need N processes too: validated here, trained by tests/e2e/test_expert_parallel_cli.py.
EXPERT_PARALLEL = {("expert_parallel", "ep2"), ("expert_parallel", "ep4")}
# Hugging Face models need transformers and a saved model: validated here, trained by tests/e2e/test_hf_models.py.
HUGGING_FACE = {("model", "hf_causal_lm")}
CASES = OPTIONS + [("experiment", e) for e in EXPERIMENTS]
_TRAINED: dict[str, dict] = {}  # one step per distinct (shrunk) configuration


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("def hello(world):\n    return world\n" * 6400)  # 230 kB: gpt_text_file's 100 steps in an epoch
    return str(path)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The files a save_pretrained directory holds, as far as the launcher reads them (no weights are read)."""
    from safetensors.torch import save_file

    path = tmp_path_factory.mktemp("hf")
    (path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_positions": 256}))
    (path / "tokenizer.json").write_text("{}")
    save_file({"lm_head.weight": torch.zeros(2, 2)}, str(path / "model.safetensors"))
    return str(path)


def _overrides(group: str, option: str, corpus: str, hf: str = "") -> list[str]:
    return [f"{group}={option}"] + [o.replace(CORPUS, corpus).replace(HF_DIR, hf)
                                    for o in COMPANIONS.get((group, option), [])]


def _tiny(cfg: TrainConfig, keep_model: bool) -> TrainConfig:
    """The same combination at smoke-test size: one step on one in-process CPU rank.

    The GPT is shrunk to a tiny shape unless ``keep_model`` (the model option itself is under test)
    and the preset has at most 10M parameters; larger presets are counted on the meta device only.
    """
    cfg.trainer = dataclasses.replace(
        cfg.trainer, accelerator="cpu", devices=1, max_steps=1, max_epochs=None, max_time=None,
        val_check_interval=None, limit_train_batches=None, limit_val_batches=1, accumulate_grad_batches=1,
        enable_progress_bar=False, enable_model_summary=False, validate_at_start=False, validate_at_end=False)
    if isinstance(cfg.data, TextDataSchema):
        cfg.data = dataclasses.replace(cfg.data, seq_len=16, micro_batch_size=2, max_bytes=20_000,
                                       max_val_samples=2, num_workers=0)
    elif isinstance(cfg.data, TeacherDataSchema):
        cfg.data = dataclasses.replace(cfg.data, num_train=64, num_val=32, micro_batch_size=16, num_workers=0)
    if isinstance(cfg.model, GPTModelSchema):
        size = count_parameters(cfg.model.preset)
        if not keep_model or size > 10e6:
            cfg.model = dataclasses.replace(cfg.model, n_layer=1, n_head=2, n_embd=32)
        elif size > 2e6:
            cfg.trainer.checkpoint.enabled = False  # a checkpoint costs more than the step here
    return cfg


def test_every_option_and_experiment_is_listed() -> None:
    assert GROUPS == ["callbacks", "data", "expert_parallel", "logger", "model", "offload", "pipeline", "precision",
                      "sequence_parallel", "tensor_parallel", "trainer", "zero"]
    assert {"stage0", "stage1", "stage2", "stage3"} <= {o for g, o in OPTIONS if g == "zero"}
    assert set(COMPANIONS) | set(UNBUILT) <= set(CASES), "a config file named here was renamed or removed"
    assert "gpt_small" in EXPERIMENTS and len(EXPERIMENTS) >= 5


@pytest.mark.parametrize(("group", "option"), CASES, ids=[f"{g}={o}" for g, o in CASES])
def test_option_composes_and_trains_one_step_or_is_not_built(group: str, option: str, corpus: str, hf_dir: str,
                                                            tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the GPU options compose as on a machine with their GPUs (this one's are checked apart: test_cli_refusals.py)
    monkeypatch.setattr("lightning_zero.config.validate.node_device_problems", lambda accelerator, devices: [])
    cfg = compose_config(_overrides(group, option, corpus, hf_dir))
    if (group, option) in UNBUILT:
        with pytest.raises(NotImplementedError, match=UNBUILT[(group, option)]):
            validate_config(cfg)
        assert describe(to_train_config(cfg))  # still composes, counts on meta
        return
    if (group, option) in PIPELINED:
        assert validate_config(cfg).pipeline.stages > 1 and describe(to_train_config(cfg))
        return
    if (group, option) in SEQUENCE_PARALLEL:
        assert validate_config(cfg).sequence_parallel.size > 1 and describe(to_train_config(cfg))
        return
    if (group, option) in TENSOR_PARALLEL:
        assert validate_config(cfg).tensor_parallel.size > 1 and describe(to_train_config(cfg))
        return
    if (group, option) in EXPERT_PARALLEL:
        assert validate_config(cfg).expert_parallel.size > 1 and describe(to_train_config(cfg))
        return
    if (group, option) in HUGGING_FACE:
        assert "(0.00M params)" in describe(validate_config(cfg))  # counted from the file's header
        return
    typed = _tiny(validate_config(cfg), keep_model=group == "model")
    key = to_yaml(dataclasses.replace(typed, name=""))
    if key in _TRAINED:
        return
    result = run_job(typed, tmp_path)
    assert result.global_step == 1
    assert to_train_config(OmegaConf.load(tmp_path / CONFIG_FILE)) == typed  # what the ranks read back
    assert json.loads((tmp_path / RESULT_FILE).read_text())["global_step"] == 1
    if typed.trainer.checkpoint.enabled:
        assert (tmp_path / "checkpoints" / "last.ckpt").exists()  # a file (stage 0) or a sharded directory
    logs = {"tensorboard": "tb/events.out.tfevents.*", "csv": "csv/hparams.yaml", "none": None}[typed.logger.kind.value]
    assert logs is None or list(tmp_path.glob(logs))
    _TRAINED[key] = {"group": group, "option": option}


def test_default_is_the_gpt_small_experiment() -> None:
    default, experiment = compose_config([]), compose_config(["experiment=gpt_small"])
    default.name = experiment.name
    assert default == experiment
    cfg = validate_config(default)
    assert isinstance(cfg.model, GPTModelSchema) and cfg.model.preset == "gpt_small"
    assert isinstance(cfg.data, TextDataSchema) and cfg.data.path is None  # the stdlib corpus
    assert (cfg.zero.stage, cfg.trainer.devices, cfg.precision.name.value, cfg.logger.kind.value) == (
        2, 2, "fp32", "tensorboard")
    # the command line's group choices win over an experiment's
    assert compose_config(["experiment=gpt_tiny", "zero=stage0"]).zero.stage == 0


@pytest.mark.slow
def test_big_presets_are_only_counted_on_meta(monkeypatch: pytest.MonkeyPatch) -> None:
    devices: list[str] = []
    init = GPT.__init__

    def spy(self: GPT, config: object) -> None:
        init(self, config)
        devices.append(self.tok_emb.weight.device.type)

    monkeypatch.setattr(GPT, "__init__", spy)
    for overrides in (["model=gpt_125m"], ["model=gpt_350m"], ["model=gpt_1b"], ["experiment=gpt_1b_offload"]):
        cfg = to_train_config(compose_config(overrides))
        assert "M params" in describe(cfg)
        if overrides[0].startswith("model"):
            validate_config(compose_config(overrides))
    assert devices and set(devices) == {"meta"}


@pytest.mark.parametrize(("overrides", "reason"), [
    (["offload=param_cpu"], r"offload.param_device='cpu' needs ZeRO stage 3.*Fix: zero.stage=3"),
    (["zero=stage0", "offload=optimizer_cpu"], r"needs ZeRO stage 1, 2 or 3 \(a partitioned optimizer\)"),
    (["zero=stage3", "offload=param_cpu", "offload.optimizer_device=none"],
     r"optimizer must be offloaded too. Fix: also set offload.optimizer_device='cpu'"),
    (["zero=stage3", "offload=optimizer_nvme", "offload.nvme_path=null"], "swap files under offload.nvme_path"),
    (["pipeline=pp2_1f1b", "data.micro_batch_size=6"], "does not split into pipeline.micro_batches=8"),
    (["pipeline=pp2_1f1b", "model=mlp", "data=teacher"], "does not follow the pipeline protocol"),
    (["pipeline=pp4_interleaved", "zero=stage1"], r"world size 2 is not a multiple of pipeline x sequence x tensor"),
    (["pipeline=pp4_interleaved", "trainer.devices=4", "model=gpt_tiny", "model.n_layer=1"],
     "3 pipeline layers, fewer than pipeline.stages"),
    (["precision=bf16", "precision.loss_scale=128"], "precision.loss_scale set with precision=bf16: loss scaling"),
    (["precision=bf16_true", "precision.raise_at_min_scale=true"], "raise_at_min_scale set with precision=bf16_true"),
    (["precision=bf16", "precision.grad_accum_dtype=int32"], "`grad_accum_dtype` must be a floating dtype.*'int32'"),
    (["model=mlp"], "needs classification data"),
    (["model=mlp", "data=teacher", "data.input_dim=8"], "differ from data.input_dim"),
    (["data.seq_len=512"], "exceeds the model's context 256"),
    (["model.preset=gpt_2b"], "not a GPT preset"),
    (["data=text_file"], "missing mandatory value.*data.path"),
    (["data=text_file", "data.path=/nonexistent/corpus.txt"], "does not exist"),
    (["data.val_fraction=0"], "val_fraction"),
    (["zero.reduce_bucket_size=0"], "reduce_bucket_size"),
])
def test_invalid_combinations_are_rejected_with_the_reason(overrides: list[str], reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        validate_config(compose_config(overrides))


def test_invalid_beats_not_built_and_all_reasons_are_listed() -> None:
    with pytest.raises(ValueError) as info:  # every reason is listed
        validate_config(compose_config(["zero=stage3", "pipeline=pp2_1f1b", "pipeline.micro_batches=3",
                                        "precision=bf16", "precision.hysteresis=4", "offload=param_cpu"]))
    assert "pipeline" in str(info.value) and "loss scaling applies to fp16 only" in str(info.value)
    built = validate_config(compose_config(["zero=stage3", "offload=param_cpu"]))  # parameter offload is built
    assert built.offload.param_device.value == "cpu"


@pytest.mark.parametrize(("overrides", "error", "text"), [
    (["zero.stagee=1"], ConfigCompositionException, "Could not override 'zero.stagee'"),
    (["zero.stage=two"], ConfigCompositionException, "zero.stage=two"),
    (["zero.collective=ring"], ConfigCompositionException, "zero.collective=ring"),
    (["trainer.devices=1.5"], ConfigCompositionException, "trainer.devices=1.5"),
    (["model=gpt_huge"], ConfigCompositionException, "Could not find 'model/gpt_huge'"),
])
def test_misspelt_or_mistyped_overrides_fail_at_composition(overrides: list[str], error: type, text: str) -> None:
    with pytest.raises(error, match=text):
        compose_config(overrides)


def test_keys_added_with_plus_are_rejected() -> None:
    with pytest.raises(ConfigKeyError, match="Key 'foo' not in 'ZeroSchema'"):
        validate_config(compose_config(["+zero.foo=1"]))


@pytest.mark.parametrize(("text", "error", "message"), [
    ("stag: 2\n", ConfigCompositionException, "Key 'stag' not in 'ZeroSchema'"),
    ("stage: two\n", ConfigCompositionException, "Value 'two' of type 'str' could not be converted to Integer"),
    ("collective: ring\n", ConfigCompositionException, "Invalid value 'ring', expected one of"),
])
def test_a_misspelt_or_mistyped_yaml_file_fails_at_composition(text: str, error: type, message: str,
                                                               tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    (conf / "zero" / "bad.yaml").write_text("defaults:\n  - zero_schema\n  - _self_\n\n" + text)
    monkeypatch.setenv("LIGHTNING_ZERO_CONF", str(conf))
    with pytest.raises(error) as info:
        compose_config(["zero=bad"])
    assert message in str(info.value) or message in str(info.value.__cause__)


def test_saved_config_round_trips_and_rejects_unknown_keys(tmp_path: Path) -> None:
    cfg = validate_config(compose_config(["experiment=mlp"]))
    assert isinstance(cfg.model, MLPModelSchema) and isinstance(cfg.data, TeacherDataSchema)
    assert to_train_config(OmegaConf.create(to_yaml(cfg))) == cfg
    with pytest.raises(ValidationError):
        to_train_config({**OmegaConf.to_container(OmegaConf.create(to_yaml(cfg))), "zero": {"stage": "x"}})


def test_strategy_gets_the_zero_group() -> None:
    cfg = validate_config(compose_config(["zero=stage1", "zero.reduce_bucket_size=1000", "zero.overlap_comm=false",
                                          "zero.collective=reduce_scatter",
                                          "zero.elementwise_optimizers=[torch.optim:Adagrad]"]))
    strategy = build_strategy(cfg)
    z = strategy.zero_config
    assert (z.stage, z.reduce_bucket_size, z.overlap_comm, z.collective) == (1, 1000, False, "reduce_scatter")
    assert z.elementwise_optimizers == (torch.optim.Adagrad,)
    assert strategy.precision_plugin.precision == "32-true"


@pytest.mark.parametrize(("overrides", "mode", "dtype"), [
    (["precision=fp32"], "32-true", torch.float32),
    (["precision=fp16", "precision.initial_scale_power=8", "precision.hysteresis=3",
      "precision.raise_at_min_scale=true", "precision.reduce_dtype=float32"], "16-mixed", torch.float16),
    (["precision=bf16", "precision.grad_accum_dtype=float32"], "bf16-mixed", torch.bfloat16),
    (["precision=bf16_true"], "bf16-true", torch.bfloat16),
])
def test_precision_group_builds_the_plugin(overrides: list[str], mode: str, dtype: torch.dtype) -> None:
    plugin = build_strategy(validate_config(compose_config(overrides))).precision_plugin
    assert (plugin.precision, plugin.compute_dtype) == (mode, dtype)
    if mode == "16-mixed":  # fp16 stays fp16 on CPU (the Trainer's precision string would become bf16)
        c = plugin.scaler.config
        assert (plugin.loss_scale, c.hysteresis, c.raise_at_min_scale, c.loss_scale_window) == (256.0, 3, True, 1000)
        assert plugin.reduce_dtype == torch.float32
    else:
        assert plugin.scaler is None
    if mode == "bf16-mixed":
        assert plugin.dtype_policy().grad_accum_dtype == torch.float32


def test_sweeps_expand_like_hydra() -> None:
    jobs = expand_sweep(["zero=stage0,stage1", "model=gpt_tiny,gpt_1m", "trainer.max_steps=3"])
    assert len(jobs) == 4 and ["zero=stage1", "model=gpt_1m", "trainer.max_steps=3"] in jobs


def test_core_imports_only_torch_and_the_standard_library() -> None:
    """Every import in lightning_zero/core/ -- top-level, lazy inside functions, or under
    TYPE_CHECKING -- names torch, the standard library or core itself (never lightning, hydra,
    omegaconf, safetensors, ...)."""
    import ast
    import sys

    core = Path(__file__).resolve().parents[2] / "lightning_zero" / "core"
    allowed = set(sys.stdlib_module_names) | {"torch", "__future__"}
    bad = []
    for path in sorted(core.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue  # relative imports stay inside core
            bad += [f"{path.name}:{node.lineno} {name}" for name in names
                    if name.split(".")[0] not in allowed and not name.startswith("lightning_zero.core")]
    assert not bad, bad
    assert len(list(core.rglob("*.py"))) > 10  # the walk saw the package


def test_a_run_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    cfg = _tiny(validate_config(compose_config(["experiment=gpt_tiny", "trainer=cpu1"])), keep_model=True)
    run_job(cfg, tmp_path / "first")
    last = tmp_path / "first" / "checkpoints" / "last.ckpt"
    cfg.trainer = dataclasses.replace(cfg.trainer, max_steps=2, resume_from=str(last))
    assert run_job(cfg, tmp_path / "second").global_step == 2
    with pytest.raises(ValueError, match="is not a checkpoint file or directory"):
        validate_config(compose_config(["trainer.resume_from=/nonexistent.ckpt"]))


@pytest.mark.parametrize("option", ["optimizer_cpu", "param_cpu"])
def test_the_cpu_offload_presets_pin_only_where_an_accelerator_is(option: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The presets said pin_memory: true, so every rank of a CPU run warned that it could not pin."""
    import warnings

    from lightning_zero.config.settings import offload_settings as offload_config

    cpu = validate_config(compose_config(["zero=stage3", f"offload={option}"]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert offload_config(cpu).pin() is False  # unpinned, and no warning
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    gpu = validate_config(compose_config(["zero=stage3", f"offload={option}", "trainer=gpu"]))
    assert offload_config(gpu).pin_memory is True
    assert offload_config(cpu).pin_memory is False  # the trainer is on CPU: nothing to pin for
    forced = validate_config(compose_config(["zero=stage3", f"offload={option}", "offload.pin_memory=false",
                                             "trainer=gpu"]))
    assert offload_config(forced).pin_memory is False  # an explicit value is kept


def test_val_check_interval_counts_optimizer_steps_under_accumulation() -> None:
    """It counted micro-batches: with 2 accumulation steps, val_check_interval=2 validated every optimizer step."""
    import lightning.pytorch as pl
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lightning_zero.config.run.build import val_check_batches

    cfg = validate_config(compose_config(["experiment=gpt_tiny", "trainer.accumulate_grad_batches=2",
                                          "trainer.val_check_interval=2"]))
    assert val_check_batches(cfg) == 4  # Lightning counts training batches
    fraction = validate_config(compose_config(["trainer.accumulate_grad_batches=2", "trainer.val_check_interval=0.5"]))
    assert val_check_batches(fraction) == 0.5  # a fraction of an epoch stays one

    class Steps(pl.Callback):
        def __init__(self) -> None:
            self.seen: list[int] = []

        def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self.seen.append(trainer.global_step)

    steps = Steps()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=6, accumulate_grad_batches=2,
                         val_check_interval=val_check_batches(cfg), limit_val_batches=1, num_sanity_val_steps=0,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[steps])
    trainer.fit(BoringModel())
    assert steps.seen == [2, 4, 6]  # every 2 optimizer steps, as the config says
