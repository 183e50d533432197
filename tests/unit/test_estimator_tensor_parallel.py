"""The estimator and the advisor with tensor parallelism (issue 31): a rank's model state is the ZeRO formula of
Psi_split / tp + Psi_rep over the data ranks (the function the strategy's measured memory is tested against in
tests/distributed/test_tensor_parallel.py), activations split as Korthikanti et al. give, and the advisor proposes
TP when nothing else fits, saying why (a layer bigger than a rank). Offload composes with TP (issue 31): a rank
offloads its share, over the data ranks, of its slice's state."""

from __future__ import annotations

import pytest

from lightning_zero.cli import main
from lightning_zero.core.common.memory import tensor_parallel_model_state
from lightning_zero.estimator import OFFLOADS, PRESETS, activation_memory, estimate_memory, resolve_model
from lightning_zero.estimator.advisor import PREFERENCE, advise


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_the_replicated_parameters_come_from_the_plan_or_the_architecture() -> None:
    h, layers, positions = 256, 8, 256  # gpt_small: counted on meta under the GPT's own plan
    small = resolve_model("gpt_small")
    assert small.replicated_params == positions * h + layers * 6 * h + 2 * h  # pos, 2 LNs + 2 row biases, ln_f
    assert small.largest_replicated_layer_params == positions * h
    gpt2 = PRESETS["gpt2"]  # the same rule from the architecture's formula
    assert gpt2.replicated_params == 1024 * 768 + 12 * 6 * 768 + 2 * 768
    llama = PRESETS["llama2-7b"]  # RMSNorm weights only
    assert llama.replicated_params == (2 * 32 + 1) * 4096
    assert gpt2.rank_params(2) == (gpt2.num_params - gpt2.replicated_params) / 2 + gpt2.replicated_params
    assert gpt2.rank_largest_layer(4) == max(50257 * 768 / 4, 1024 * 768)  # the vocabulary split, positions whole


@pytest.mark.parametrize("precision", ["fp32", "mixed"])
def test_a_ranks_model_state_with_tp_is_the_shared_formula_over_the_data_ranks(precision: str) -> None:
    spec = resolve_model("gpt_small")
    est = estimate_memory(model="gpt_small", world_size=8, tensor_parallel=2, precision=precision)
    assert est.tensor_parallel == 2 and {c.offload for c in est.configs} == set(OFFLOADS)  # offload x TP composes
    split = spec.num_params - spec.replicated_params
    for stage in range(4):
        expected = tensor_parallel_model_state(stage, split, spec.replicated_params, 2, 4, precision)
        assert est.config(stage).on_device == expected
        unsplit = estimate_memory(model="gpt_small", world_size=4, precision=precision).config(stage).on_device
        assert expected.model_states < 0.6 * unsplit.model_states  # most of the model is split
    # stage 3 gathers this rank's slice of the largest layer, not the layer
    elem = 4 if precision == "fp32" else 2
    assert est.config(3).working == 2 * elem * spec.rank_largest_layer(2) < 2 * elem * spec.largest_layer_params


@pytest.mark.parametrize("precision", ["mixed", "bf16-true"])
def test_an_offload_row_with_tp_moves_the_ranks_share_of_its_slices_state(precision: str) -> None:
    """By hand: TP 2 on 8 ranks gives 4 data ranks; a rank holds Psi_split / 2 + Psi_rep parameters and offloads
    1/4 of their master copy, optimizer state and master-dtype gradient (and, with param_*, 1/4 of their 16-bit
    parameters), keeping on the device what the stage keeps of its own parameters."""
    spec = resolve_model("gpt_small")
    est = estimate_memory(model="gpt_small", world_size=8, tensor_parallel=2, precision=precision, micro_batch=2)
    rank = (spec.num_params - spec.replicated_params) / 2 + spec.replicated_params
    shard = rank / 4
    master, state = (4.0, 8.0) if precision == "mixed" else (2.0, 4.0)  # Adam: 8 fp32 bytes, halved in bf16-true
    for (stage, offload), (params, grads) in {
        (1, "optimizer_cpu"): (2 * rank, 2 * rank), (2, "optimizer_cpu"): (2 * rank, 0.0),
        (3, "optimizer_cpu"): (2 * shard, 0.0), (2, "optimizer_nvme"): (2 * rank, 0.0), (3, "param_cpu"): (0.0, 0.0),
    }.items():
        c = est.config(stage, offload)
        moved = 2 * shard if offload.startswith("param_") else 0.0
        assert (c.on_device.params, c.on_device.grads, c.on_device.optimizer) == pytest.approx((params, grads, 0.0))
        assert (c.offloaded.params, c.offloaded.grads, c.offloaded.optimizer) == pytest.approx(
            (moved, master * shard, (master + state) * shard))
        offloaded = moved + (2 * master + state) * shard
        assert (c.cpu_bytes, c.nvme_bytes) == ((offloaded, 0.0) if c.target == "cpu" else (0.0, offloaded))
        assert c.deepspeed is None and c.activations is est.activations  # no DeepSpeed figures with TP
    # a quarter of the rank's slice, not of the unsplit model: TP 2 halves the split parameters' offloaded state
    unsplit = estimate_memory(model="gpt_small", world_size=4, precision=precision).config(2, "optimizer_cpu")
    assert est.config(2, "optimizer_cpu").cpu_bytes < 0.6 * unsplit.cpu_bytes


def test_activations_split_as_korthikanti_with_tensor_parallelism() -> None:
    s, b, h, a, L = 2048, 1, 4096, 32, 2
    for t in (1, 2, 4):
        acts = activation_memory(L, h, s, b, a, 2, False, t)
        assert acts.full == pytest.approx(L * s * b * h * (10 + 24 / t + 5 * a * s / (h * t)))
        assert acts.checkpointed == pytest.approx(L * 2 * s * b * h + acts.full / L)
    assert activation_memory(L, h, s, b, a).full == activation_memory(L, h, s, b, a, tensor_parallel=1).full


def test_the_cli_estimates_with_tp_and_refuses_what_the_strategy_refuses(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "estimate", "--model", "gpt_small", "--world-size", "4", "--tensor-parallel", "2")
    assert code == 0 and "Tensor parallel: 2 ranks per group, 2 data-parallel ranks" in out, out
    rows = out.split("stage  offload")[1].split("Offload:")[0]
    assert {"optimizer_cpu", "optimizer_nvme", "param_cpu", "param_nvme"} <= set(rows.split()), out  # offload rows
    # one offload row, by hand: 1e9 params, TP 2 on 4 ranks, 2 data ranks; the rank's 5e8 over 2 data ranks
    code, out, _ = run_cli(capsys, "estimate", "--params", "1e9", "--world-size", "4", "--tensor-parallel", "2",
                           "--offload", "optimizer_cpu")
    rows = [line.split() for line in out.split("stage  offload")[1].split("Offload:")[0].splitlines()[1:] if line]
    assert code == 0 and [r[:2] for r in rows] == [["0", "none"], ["1", "none"], ["1", "optimizer_cpu"],
                                                   ["2", "none"], ["2", "optimizer_cpu"], ["3", "none"],
                                                   ["3", "optimizer_cpu"]], out
    stage2 = rows[4]  # device = 2 * 5e8 params; cpu = (4 + 4 + 8) bytes * 2.5e8 = 4 GB, x 4 ranks per node
    assert " ".join(stage2[2:14]) == "1 GB 1 GB - - 4 GB - 16 GB -", out
    assert stage2[-3:] == ["|", "-", "-"] and "take no tensor-parallel size" in out, out  # no DeepSpeed columns
    code, out, _ = run_cli(capsys, "estimate", "--params", "1e9", "--world-size", "4", "--tensor-parallel", "2",
                           "--replicated-params", "1e8")
    assert code == 0 and "Psi_rep = 550M" in out, out  # 9e8 / 2 + 1e8
    code, out, _ = run_cli(capsys, "estimate", "--params", "1e9", "--world-size", "4", "--tensor-parallel", "2")
    assert code == 0 and "every parameter taken as split; give --replicated-params" in " ".join(out.split()), out
    for argv, message in [
        (["--params", "1e9", "--world-size", "6", "--tensor-parallel", "4"], "not a multiple of --tensor-parallel 4"),
        (["--model", "gpt2", "--world-size", "8", "--tensor-parallel", "8"], "12 attention heads do not split"),
        (["--params", "1e9", "--world-size", "8", "--tensor-parallel", "0"], "positive integer"),
        (["--params", "1e9", "--world-size", "8", "--replicated-params", "2e9"], "between 0 and"),
    ]:
        code, _, err = run_cli(capsys, "estimate", *argv)
        assert code == 2 and message in err, (argv, err)


def test_the_advisor_proposes_tp_when_a_layer_is_bigger_than_a_rank_and_says_so(
        capsys: pytest.CaptureFixture[str]) -> None:
    """A 2.5B-parameter layer in bf16 (10 GB of params + grads whole) on 10 GB ranks, no CPU memory: no ZeRO stage
    fits (stage 3 gathers the layer whole), TP 2 at stage 2 does, and the advice says the layer is why."""
    argv = ["--params", "3e9", "--largest-layer", "2.5e9", "--device-memory", "10GB", "--world-size", "8"]
    adv = advise(3e9, largest_layer_params=2.5e9, device_memory="10GB", world_size=8)
    assert not any(c.fits for c in adv.candidates if c.tensor_parallel == 1)
    assert adv.choice is not None and adv.choice.tensor_parallel == 2 and adv.choice.estimate.stage == 2
    assert "largest layer (2.5B params) needs 10 GB" in adv.tensor_parallel_reason
    assert adv.overrides.endswith("tensor_parallel.size=2")
    code, out, _ = run_cli(capsys, "advise", *argv)
    assert code == 0 and "Recommended: stage 2 + TP 2" in out and "Tensor parallelism is what makes it fit" in out, out
    # the overrides are a valid training configuration
    from lightning_zero.config.run.launch import compose_config
    from lightning_zero.config.settings import settings_of
    from lightning_zero.config.validate import validate_config

    overrides = adv.overrides.split()
    settings = settings_of(validate_config(compose_config(["experiment=gpt_tiny", "trainer.devices=8", *overrides])))
    assert settings.parallel.tensor.size == 2 and int(settings.zero.stage) == 2
    # TP is not proposed where ZeRO fits, and a given size is used as it is (with every offload)
    assert all(c.tensor_parallel == 1 for c in advise(3e9, device_memory="80GB", world_size=8).candidates)
    fixed = advise(3e9, device_memory="80GB", world_size=8, tensor_parallel=4)
    assert {c.tensor_parallel for c in fixed.candidates} == {4}
    assert [(c.estimate.stage, c.estimate.offload) for c in fixed.candidates] == list(PREFERENCE)
    assert fixed.tensor_parallel_reason is None
    # a layer no TP size within the node splits small enough: nothing fits, and the layer is named
    code, out, _ = run_cli(capsys, "advise", "--params", "3e9", "--largest-layer", "2.9e9", "--device-memory", "2GB",
                           "--world-size", "2")
    assert code == 1 and "only tensor parallelism splits a layer" in " ".join(out.split()), out


def test_the_advisor_proposes_tp_with_offload_when_tp_alone_does_not_fit(capsys: pytest.CaptureFixture[str]) -> None:
    """6B parameters with a 2.5B-parameter layer on 10 GB ranks with 512 GB of CPU: no configuration without TP
    fits (the layer), no TP 2 configuration without offload does (the rank's 3B parameters' states), and stage 2
    + optimizer_cpu at TP 2 does: TP stays the last resort, but it comes with offload at the smallest TP size."""
    argv = ["--params", "6e9", "--largest-layer", "2.5e9", "--device-memory", "10GB", "--cpu-memory", "512GB",
            "--world-size", "8"]
    adv = advise(6e9, largest_layer_params=2.5e9, device_memory="10GB", cpu_memory="512GB", world_size=8)
    assert not any(c.fits for c in adv.candidates if c.tensor_parallel == 1)
    assert not any(c.fits for c in adv.candidates if c.estimate.offload == "none")
    choice = adv.choice
    assert choice is not None and (choice.tensor_parallel, choice.estimate.stage, choice.estimate.offload) == (
        2, 2, "optimizer_cpu")
    # by hand: the rank holds 3e9 parameters, 16-bit on the device; 16 bytes each over 4 data ranks, x 8 on the node
    assert dict(choice.needs) == pytest.approx({"device": 2 * 3e9, "CPU": 16 * 3e9 / 4 * 8, "NVMe": 0.0})
    assert adv.overrides == "zero=stage2 offload=optimizer_cpu precision=bf16 tensor_parallel.size=2"
    code, out, _ = run_cli(capsys, "advise", *argv)
    assert code == 0 and "Recommended: stage 2 + optimizer_cpu + TP 2" in out, out
    # the overrides are a valid training configuration (offload x TP is not refused)
    from lightning_zero.config.run.launch import compose_config
    from lightning_zero.config.settings import settings_of
    from lightning_zero.config.validate import validate_config

    cfg = validate_config(compose_config(["experiment=gpt_tiny", "trainer.devices=8", *adv.overrides.split()]))
    settings = settings_of(cfg)
    assert settings.parallel.tensor.size == 2 and int(settings.zero.stage) == 2
