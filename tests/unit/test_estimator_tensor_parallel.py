"""The estimator and the advisor with tensor parallelism (issue 31): a rank's model state is the ZeRO formula of
Psi_split / tp + Psi_rep over the data ranks (the function the strategy's measured memory is tested against in
tests/distributed/test_tensor_parallel.py), activations split as Korthikanti et al. give, and the advisor proposes
TP when nothing else fits, saying why (a layer bigger than a rank)."""

from __future__ import annotations

import pytest

from lightning_zero.cli import main
from lightning_zero.core.zero.memory import tensor_parallel_model_state
from lightning_zero.estimator import PRESETS, activation_memory, estimate_memory, resolve_model
from lightning_zero.estimator.advisor import advise


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
    assert est.tensor_parallel == 2 and {c.offload for c in est.configs} == {"none"}  # offload x TP: not built
    split = spec.num_params - spec.replicated_params
    for stage in range(4):
        expected = tensor_parallel_model_state(stage, split, spec.replicated_params, 2, 4, precision)
        assert est.config(stage).on_device == expected
        unsplit = estimate_memory(model="gpt_small", world_size=4, precision=precision).config(stage).on_device
        assert expected.model_states < 0.6 * unsplit.model_states  # most of the model is split
    # stage 3 gathers this rank's slice of the largest layer, not the layer
    elem = 4 if precision == "fp32" else 2
    assert est.config(3).working == 2 * elem * spec.rank_largest_layer(2) < 2 * elem * spec.largest_layer_params


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
    assert "optimizer_cpu" not in out.split("stage  offload")[1].split("Offload:")[0]  # no offload rows
    code, out, _ = run_cli(capsys, "estimate", "--params", "1e9", "--world-size", "4", "--tensor-parallel", "2",
                           "--replicated-params", "1e8")
    assert code == 0 and "Psi_rep = 550M" in out, out  # 9e8 / 2 + 1e8
    code, out, _ = run_cli(capsys, "estimate", "--params", "1e9", "--world-size", "4", "--tensor-parallel", "2")
    assert code == 0 and "every parameter taken as split; give --replicated-params" in " ".join(out.split()), out
    for argv, message in [
        (["--params", "1e9", "--world-size", "6", "--tensor-parallel", "4"], "not a multiple of --tensor-parallel 4"),
        (["--params", "1e9", "--world-size", "8", "--tensor-parallel", "2", "--offload", "optimizer_cpu"],
         "offload='optimizer_cpu' with tensor_parallel=2 is not built"),
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
    from lightning_zero.config.build import strategy_kwargs
    from lightning_zero.config.launch import compose_config
    from lightning_zero.config.validate import validate_config

    overrides = adv.overrides.split()
    kwargs = strategy_kwargs(validate_config(compose_config(["experiment=gpt_tiny", "trainer.devices=8", *overrides])))
    assert kwargs["tensor_parallel"] == 2 and int(kwargs["config"].stage) == 2
    # TP is not proposed where ZeRO fits, and a given size is used as it is (no offload rows with it)
    assert all(c.tensor_parallel == 1 for c in advise(3e9, device_memory="80GB", world_size=8).candidates)
    fixed = advise(3e9, device_memory="80GB", world_size=8, tensor_parallel=4)
    assert {c.tensor_parallel for c in fixed.candidates} == {4} and len(fixed.candidates) == 4
    assert fixed.tensor_parallel_reason is None
    # a layer no TP size within the node splits small enough: nothing fits, and the layer is named
    code, out, _ = run_cli(capsys, "advise", "--params", "3e9", "--largest-layer", "2.9e9", "--device-memory", "2GB",
                           "--world-size", "2")
    assert code == 1 and "only tensor parallelism splits a layer" in " ".join(out.split()), out
