"""Memory estimator and stage advisor: the ZeRO paper's table, offload placement, the advisor's
choices on a grid, agreement with measured model state, and the CLI run in-process."""

from __future__ import annotations

import itertools
import math
import re
import runpy
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_zero.cli import main
from lightning_zero.core.comm.data_parallel import DataParallelComm
from lightning_zero.core.common.memory import model_state_formula, offloaded_model_state
from lightning_zero.core.settings.zero import ZeroConfig
from lightning_zero.core.zero.engine import ZeroEngine
from lightning_zero.estimator import (
    PRESETS,
    activation_memory,
    deepspeed_figures,
    estimate_memory,
    make_cluster,
    parse_count,
    parse_size,
    resolve_model,
)
from lightning_zero.estimator.advisor import PREFERENCE, advise, format_bytes, needs_of

PAPER = {0: 120e9, 1: 31.40625e9, 2: 16.640625e9, 3: 1.875e9}  # ZeRO paper, Figure 1: Ψ = 7.5B, N = 64, K = 12
PAPER_TEXT = {0: "120 GB", 1: "31.4 GB", 2: "16.6 GB", 3: "1.88 GB"}


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


# ------------------------------------------------------------------------------ paper table
def test_paper_table_python_api() -> None:
    est = estimate_memory(7.5e9, world_size=64)
    for stage, expected in PAPER.items():
        row = est.config(stage)
        assert row.device_bytes == pytest.approx(expected, rel=1e-12)
        assert format_bytes(row.device_bytes) == PAPER_TEXT[stage]
        assert row.cpu_bytes == row.nvme_bytes == 0
    assert "31.4 GB" in str(est)


def test_paper_table_cli(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run_cli(capsys, "estimate", "--params", "7.5e9", "--world-size", "64")
    assert rc == 0
    for stage, text in PAPER_TEXT.items():
        row = re.search(rf"^{stage}\s+none\s+(\S+ \S+)", out, re.MULTILINE)
        assert row is not None and row.group(1) == text, out
    assert "DeepSpeed's" in out


def test_estimate_uses_the_shared_formula() -> None:
    for precision, formula in (("fp32", "fp32"), ("bf16-mixed", "mixed"), ("16-mixed", "mixed"),
                               ("bf16-true", "bf16-true")):
        est = estimate_memory(1.3e9, world_size=16, precision=precision, offload="none")
        assert len(est.configs) == 4
        for stage in range(4):
            assert est.config(stage).on_device == model_state_formula(stage, 1.3e9, 16, formula)


# ------------------------------------------------------------------------------ offload placement
def test_offload_placement_mixed_adam() -> None:
    psi, n = 8e9, 8
    dev, moved = offloaded_model_state(2, psi, n, "mixed", "optimizer_cpu")
    assert (dev.params, dev.grads, dev.optimizer) == (2 * psi, 0, 0)  # fp16 grads only in buckets
    assert moved.model_states == pytest.approx(16 * psi / n)  # fp32 grads + master + moments
    dev, moved = offloaded_model_state(1, psi, n, "mixed", "optimizer_cpu")
    assert dev.model_states == 4 * psi
    dev, moved = offloaded_model_state(3, psi, n, "mixed", "optimizer_nvme")
    assert dev.model_states == pytest.approx(2 * psi / n) and moved.model_states == pytest.approx(16 * psi / n)
    dev, moved = offloaded_model_state(3, psi, n, "mixed", "param_cpu")
    assert dev.model_states == 0 and moved.model_states == pytest.approx(18 * psi / n)
    dev, moved = offloaded_model_state(2, psi, n, "fp32", "optimizer_cpu")  # master is a copy once offloaded
    assert dev.model_states == 4 * psi and moved.model_states == pytest.approx(16 * psi / n)
    dev, moved = offloaded_model_state(2, psi, n, "bf16-true", "optimizer_cpu")
    assert moved.model_states == pytest.approx((2 + 4 + 2) * psi / n)
    assert offloaded_model_state(2, psi, n, "mixed")[0] == model_state_formula(2, psi, n, "mixed")


@pytest.mark.parametrize(("stage", "offload"), [(0, "optimizer_cpu"), (2, "param_cpu"), (0, "optimizer_nvme")])
def test_offload_needs_its_stage(stage: int, offload: str) -> None:
    with pytest.raises(ValueError, match="needs ZeRO stage"):
        offloaded_model_state(stage, 1e9, 8, "mixed", offload)


def test_estimate_rows_and_cpu_per_node() -> None:
    est = estimate_memory(7.5e9, num_nodes=8, gpus_per_node=8)
    assert est.cluster.world_size == 64
    assert [(c.stage, c.offload) for c in est.configs][:4] == [(0, "none"), (1, "none"), (1, "optimizer_cpu"),
                                                               (1, "optimizer_nvme")]  # NVMe at stages 1-3
    row = est.config(3, "param_cpu")
    assert row.cpu_bytes == pytest.approx(18 * 7.5e9 / 64)
    assert needs_of(row, False)[1][1] == pytest.approx(8 * row.cpu_bytes)
    only = estimate_memory(7.5e9, world_size=64, offload="param_nvme")
    assert {c.offload for c in only.configs} == {"none", "param_nvme"}


def test_deepspeed_figures() -> None:
    psi, big = 7.5e9, 1e8
    cluster = make_cluster(64, None, 8)
    z2 = deepspeed_figures(2, "none", psi, big, cluster)
    assert z2 is not None and z2.device == int(2 * psi + int(18 * psi / 64)) and z2.cpu_per_node == 4 * psi * 8 * 1.5
    z2o = deepspeed_figures(2, "optimizer_cpu", psi, big, cluster)
    assert z2o is not None and z2o.device == 2 * psi and z2o.cpu_per_node == psi * 256 * 1.5
    z3 = deepspeed_figures(3, "param_cpu", psi, big, cluster)
    assert z3 is not None and z3.device == 4 * big and z3.cpu_per_node == pytest.approx(18 * psi / 8 * 1.5)
    assert deepspeed_figures(1, "none", psi, big, cluster) is None
    assert estimate_memory(psi, world_size=64, precision="fp32").config(2).deepspeed is None


# ------------------------------------------------------------------------------ activations
def test_activation_formula_korthikanti() -> None:
    s, b, h, a, layers = 2048, 4, 4096, 32, 24
    acts = activation_memory(layers, h, s, b, a)
    assert acts.full == pytest.approx(layers * s * b * h * (34 + 5 * a * s / h))
    assert acts.checkpointed == pytest.approx(layers * 2 * s * b * h + s * b * h * (34 + 5 * a * s / h))
    fp32 = activation_memory(layers, h, s, b, a, bytes_per_element=4)
    assert fp32.full == pytest.approx(layers * s * b * h * (66 + 9 * a * s / h))
    flash = activation_memory(layers, h, s, b, a, flash_attention=True)
    assert flash.full == pytest.approx(layers * 34 * s * b * h)
    est = estimate_memory(7.5e9, world_size=64, layers=layers, hidden=h, heads=a, seq_len=s, micro_batch=b)
    assert est.config(3).device_total(False) == pytest.approx(PAPER[3] + acts.full)
    assert est.config(3).device_total(True) == pytest.approx(PAPER[3] + acts.checkpointed)
    assert estimate_memory(7.5e9, world_size=64, layers=layers, hidden=h).activations is None  # no micro-batch


# ------------------------------------------------------------------------------ advisor
GRID = list(itertools.product([1.3e9, 7.5e9, 30e9, 175e9], ["16GB", "40GB", "80GiB"], [1, 8, 64]))


@pytest.mark.parametrize(("params", "device", "world"), GRID)
def test_advisor_choice_fits_and_faster_ones_do_not(params: float, device: str, world: int) -> None:
    adv = advise(params, device_memory=device, cpu_memory="512GB", nvme="2TB", world_size=world, headroom=0.1)
    limits = {"device": parse_size(device) * 0.9, "CPU": 512e9 * 0.9, "NVMe": 2e12 * 0.9}
    # then, only when none of those fits, TP 2, 4, ... with every configuration of PREFERENCE, offload included
    # (tests/unit/test_estimator_tensor_parallel.py)
    untouched = [(c.estimate.stage, c.estimate.offload) for c in adv.candidates if c.tensor_parallel == 1]
    assert untouched == list(PREFERENCE)
    for tp in {c.tensor_parallel for c in adv.candidates} - {1}:
        assert not any(c.fits for c in adv.candidates if c.tensor_parallel == 1)
        assert [(c.estimate.stage, c.estimate.offload) for c in adv.candidates if c.tensor_parallel == tp] == \
            list(PREFERENCE)
    choice = adv.choice
    faster = adv.candidates if choice is None else adv.candidates[: adv.candidates.index(choice)]
    for c in faster:  # every faster option is short of some memory, by the amount reported
        assert c.shortfalls and all(s.missing > 0 for s in c.shortfalls)
        assert any(need > limits[m] for m, need in needs_of(c.estimate, False))
    if choice is None:
        return
    assert all(need <= limits[m] for m, need in needs_of(choice.estimate, False))
    assert re.fullmatch(r"zero=stage[0-3] offload=(none|optimizer_cpu|optimizer_nvme|param_cpu|param_nvme) "
                        r"precision=bf16( offload.nvme_path=\S+)?"
                        r"( tensor_parallel.size=\d+)?", adv.overrides or "")
    assert ("offload.nvme_path=" in (adv.overrides or "")) == (choice.estimate.target == "nvme")
    # the largest model of the chosen configuration sits at the edge of the hardware
    biggest = choice.max_params
    assert biggest >= params
    if math.isfinite(biggest):
        kw = dict(device_memory=device, cpu_memory="512GB", nvme="2TB", world_size=world, headroom=0.1)
        at = {c.label: c.fits for c in advise(biggest * 0.999, **kw).candidates}
        beyond = {c.label: c.fits for c in advise(biggest * 1.001, **kw).candidates}
        assert at[choice.label] and not beyond.get(choice.label, False)


def test_advisor_example_and_activations(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run_cli(capsys, "advise", "--params", "7.5e9", "--device-memory", "80GB", "--cpu-memory", "512GB",
                         "--nvme", "2TB", "--world-size", "8")
    assert rc == 0
    assert "Hydra overrides: zero=stage1 offload=none precision=bf16" in out
    assert "stage 0: device memory short by 48 GB (needs 120 GB, 72 GB usable)" in out
    # activations push llama2-7b on 8 x 36GB from stage 2 (checkpointed) ...
    kw = dict(model="llama2-7b", device_memory="36GB", cpu_memory="1TB", world_size=8, micro_batch=1,
              flash_attention=True, headroom=0.0)
    assert advise(activation_checkpointing=True, **kw).overrides == "zero=stage2 offload=none precision=bf16"
    # ... to stage 2 + optimizer offload without checkpointing
    full = advise(activation_checkpointing=False, **kw)
    assert full.overrides == "zero=stage2 offload=optimizer_cpu precision=bf16"
    assert full.candidates[2].shortfalls[0].needed == pytest.approx(full.candidates[2].estimate.device_total(False))


def test_advisor_nothing_fits(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run_cli(capsys, "advise", "--params", "1T", "--device-memory", "16GB", "--world-size", "2",
                         "--precision", "16-mixed")
    assert rc == 1 and "Nothing fits" in out and "NVMe memory short by" in out
    assert advise("1T", device_memory="16GB", world_size=2).choice is None


# ------------------------------------------------------------------------------ measured model state
def _small_model() -> nn.Module:
    gpt = pytest.importorskip("experiments.gpt")
    return gpt.GPT(gpt.GPT_PRESETS["gpt_tiny"])


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_estimate_matches_measured_model_state(stage: int) -> None:
    torch.manual_seed(0)
    model = _small_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = ZeroEngine(model, optimizer, ZeroConfig(stage=stage), DataParallelComm())
    idx = torch.randint(0, 256, (2, 16))
    F.cross_entropy(model(idx).flatten(0, 1), idx.flatten()).backward()
    engine.finish_backward()
    optimizer.step()
    engine.after_step()
    measured = engine.model_state_bytes()
    row = estimate_memory(model=model, world_size=1, precision="fp32").config(stage)
    assert row.on_device == model_state_formula(stage, row.on_device.params / 4, 1, "fp32")
    tensors = len(list(model.parameters()))
    assert measured.params == row.on_device.params  # N = 1: no padding
    assert measured.grads == row.on_device.grads
    # AdamW keeps a 4-byte `step` per tensor (stage 0) or per flat group (stages 1-2)
    assert 0 <= measured.optimizer - row.on_device.optimizer <= 16 * tensors


# ------------------------------------------------------------------------------ models and presets
class WithConfigureModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(10, 10)

    def configure_model(self) -> None:
        self.body = nn.Linear(1000, 1000)
        assert self.body.weight.is_meta  # built on the meta device: nothing allocated


def tied_factory() -> nn.Module:
    emb = nn.Embedding(100, 16)
    model = nn.Sequential(emb, nn.Linear(16, 100, bias=False))
    model[1].weight = emb.weight
    return model


def test_models_counted_on_meta() -> None:
    assert PRESETS["gpt2"].num_params == 124_439_808
    assert PRESETS["llama2-7b"].num_params == 6_738_415_616
    spec = resolve_model(f"{__name__}:WithConfigureModel")
    assert spec.num_params == 110 + 1_001_000 and spec.largest_layer_params == 1_001_000
    assert resolve_model(f"{__name__}:tied_factory").num_params == 1600  # tied weight once
    with pytest.raises(ValueError, match="preset"):
        resolve_model("no-such-model")
    with pytest.raises(ValueError, match="importable"):
        resolve_model("no_such_module_xyz:Model")


def test_project_gpt_preset_matches_experiments() -> None:
    gpt = pytest.importorskip("experiments.gpt")
    spec = resolve_model("gpt_small")
    assert spec.num_params == gpt.count_parameters("gpt_small") and spec.layers == 8


# ------------------------------------------------------------------------------ parsing and errors
def test_parse_sizes_and_counts() -> None:
    assert parse_size("80GB") == 80e9
    assert parse_size("80GiB") == 80 * 2**30
    assert parse_size("512G") == 512e9
    assert parse_size("2TB") == 2e12
    assert parse_size("1.5e9") == 1.5e9
    assert parse_size(" 64 gib ") == 64 * 2**30
    assert parse_count("7.5B") == 7.5e9 and parse_count("350M") == 350e6 and parse_count(1e6) == 1e6
    for bad in ("eighty", "80XB", "GB", ""):
        with pytest.raises(ValueError, match="write it like 80GB"):
            parse_size(bad)
    with pytest.raises(ValueError, match="non-negative"):
        parse_size("-5GB")
    with pytest.raises(ValueError, match="positive"):
        parse_count("-7.5e9")


def test_cluster_layout() -> None:
    assert make_cluster(64, None, None).num_nodes == 8
    assert make_cluster(12, None, None).gpus_per_node == 12
    assert make_cluster(None, 2, 4).world_size == 8
    with pytest.raises(ValueError, match="--world-size"):
        make_cluster(0, None, None)
    with pytest.raises(ValueError, match="consistent"):
        make_cluster(10, 3, None)
    with pytest.raises(ValueError, match="--gpus-per-node"):
        make_cluster(None, 2, None)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["estimate", "--params=-7.5e9", "--world-size", "8"], "positive"),
        (["estimate", "--params", "-1000", "--world-size", "8"], "positive"),
        (["estimate", "--params", "7.5e9", "--world-size", "0"], "--world-size 8"),
        (["estimate", "--world-size", "8"], "exactly one of"),
        (["estimate", "--params", "1e9", "--world-size", "8", "--micro-batch", "4", "--layers", "2"],
         "also needs --hidden, --seq-len"),
        (["estimate", "--params", "1e9", "--model", "gpt2", "--world-size", "8"], "exactly one of"),
        (["advise", "--params", "1e9", "--device-memory", "lots", "--world-size", "8"], "write it like 80GB"),
        (["advise", "--params", "1e9", "--device-memory", "80GB", "--world-size", "8", "--headroom", "1.5"],
         "fraction"),
        (["convert"], "the following arguments are required: checkpoint, out"),
        (["frobnicate"], "unknown command"),
    ],
)
def test_cli_errors(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    rc, _, err = run_cli(capsys, *argv)
    assert rc == 2 and message in err


def test_cli_help_and_module_entry(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    rc, out, _ = run_cli(capsys, "--help")
    assert rc == 0 and "estimate" in out and "advise" in out and "train" in out
    rc, out, _ = run_cli(capsys, "estimate", "--help")
    assert rc == 0 and "--seq-len" in out
    monkeypatch.setattr(sys, "argv", ["lightning_zero", "estimate", "--model", "gpt2", "--world-size", "8",
                                      "--micro-batch", "2", "--units", "GiB"])
    with pytest.raises(SystemExit) as done:
        runpy.run_module("lightning_zero", run_name="__main__")
    out = capsys.readouterr().out
    assert done.value.code == 0 and "(gpt2)" in out and "GiB" in out and "+act(ckpt)" in out
