"""Smoke tests of benchmarks/bench_zero.py (its parts: benchmarks/harness): end to end on a tiny GPT, a few
measured steps, and the registry and report pieces on their own. Each benchmark's ``main`` runs in this process
with the session's warm 2-rank pool lent to it (``benchmarks.harness.pools.lent``) instead of a pool of its own;
the benchmarks' own commands (docs/benchmarks.md) start theirs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from lightning.pytorch.strategies import ModelParallelStrategy

from benchmarks.harness import contenders, report
from benchmarks.harness.config import BenchConfig

ROWS = ("ddp", "ddp_nosync", "zero0", "zero1", "zero2")


def _main(module: str, argv: list[str], pool: Any, capsys: pytest.CaptureFixture[str]) -> tuple[str, str]:
    """``python benchmarks/<module>.py <argv>``'s ``main`` in this process on the lent pool: (stdout, stderr)."""
    import importlib

    from benchmarks.harness.pools import lent

    with lent(pool):
        importlib.import_module(f"benchmarks.{module}").main(argv)
    out = capsys.readouterr()
    return out.out, out.err


@pytest.mark.slow
@pytest.mark.distributed
def test_bench_zero_end_to_end(tmp_path: Path, gloo_pool: Any, capsys: pytest.CaptureFixture[str]) -> None:
    raw_path = tmp_path / "raw.json"
    argv = ["--model", "gpt_tiny", "--micro-batch", "2", "--seq-len", "32", "--steps", "2", "--warmup", "1",
            "--repeats", "1", "--contenders", "ddp,zero0,zero1,zero2", "--profile", "--markdown", "--timeout", "120",
            "--json", str(raw_path)]  # fmt: skip
    out, _ = _main("bench_zero", argv, gloo_pool, capsys)  # nothing timed asserted

    # markdown tables: one row per contender in the main and the phase tables, probes for ZeRO only
    for name in ROWS:
        assert out.count(f"| {name} |") == (3 if name.startswith("zero") else 2), name
    assert "| contender | step ms |" in out and "| contender | forward | backward |" in out
    assert "| contender | after_step | bucket_launch |" in out
    assert "DDP communication share:" in out
    assert "Target zero1 <= 1.10x ddp:" in out and "Target zero2 <= 1.10x ddp:" in out
    assert "Machine:" in out and "torch 2." in out and "logical cores" in out
    assert "gpt_tiny" in out and "micro-batch 2 x seq 32" in out

    # raw measurements: every contender ran once on 2 ranks for warm-up + measured steps
    raw = json.loads(raw_path.read_text())
    assert list(raw["runs"]) == list(ROWS)  # ddp_nosync added right after ddp
    for name, repeats in raw["runs"].items():
        assert len(repeats) == 1 and len(repeats[0]) == 2, name
        for rank in repeats[0]:
            assert len(rank["times"]) == 3 and all(t > 0 for t in rank["times"]), name
            _check_peak_rss(rank, name)

    # the model-state accounting matches the ZeRO stages (AdamW: 2 fp32 moments per element)
    rows = {r["name"]: r for r in report.summarize(raw["runs"], warmup=1)}
    state = {name: row["state"] for name, row in rows.items()}
    assert state["zero0"]["params"] == pytest.approx(state["ddp"]["params"], rel=0.01)
    assert state["zero0"]["optimizer"] == pytest.approx(2 * state["ddp"]["params"], rel=0.01)
    assert state["zero1"]["optimizer"] == pytest.approx(state["zero0"]["optimizer"] / 2, rel=0.01)
    assert state["zero1"]["grads"] == pytest.approx(state["zero0"]["grads"], rel=0.01)
    assert state["zero2"]["grads"] == pytest.approx(state["zero1"]["grads"] / 2, rel=0.01)
    # (no assertion on DDP's `buffers`: the harness computes them from the parameters, it does not measure
    # DDP's reducer buckets, so comparing them with the grads could not fail)
    assert rows["ddp"]["ratio"] == 1.0 and all(rows[n]["step"] > 0 for n in ROWS)


@pytest.mark.slow
@pytest.mark.distributed
def test_bench_zero_stage3_and_fsdp2(tmp_path: Path, gloo_pool: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """zero3 and fsdp2 end to end on a tiny GPT, 1 warm-up + 1 measured step (the model state is sampled
    before the last optimizer step, when AdamW's state exists); everything sharded (persistence threshold 0)."""
    raw_path = tmp_path / "raw.json"
    argv = ["--model", "gpt_tiny", "--micro-batch", "2", "--seq-len", "32", "--steps", "1", "--warmup", "1",
            "--repeats", "1", "--contenders", "ddp,zero3,fsdp2", "--persistence-threshold", "0", "--profile",
            "--timeout", "120", "--json", str(raw_path)]  # fmt: skip
    out, _ = _main("bench_zero", argv, gloo_pool, capsys)  # nothing timed asserted
    assert "Target zero3 <= 1.30x ddp:" in out
    assert "Target zero3 no slower than fsdp2:" in out and "Target zero3 no larger than fsdp2:" in out
    assert "Stage 3: prefetch_bucket_size 6,553,600 elements, param_persistence_threshold 0" in out
    assert "FSDP2: torch.distributed.fsdp.fully_shard on every block" in out
    assert "s3_gather_wait" in out  # stage 3 probes

    raw = json.loads(raw_path.read_text())
    assert list(raw["runs"]) == ["ddp", "ddp_nosync", "zero3", "fsdp2"]
    rows = {r["name"]: r for r in report.summarize(raw["runs"], warmup=1)}
    full, z3, f2 = rows["ddp"]["state"], rows["zero3"]["state"], rows["fsdp2"]["state"]
    for state in (z3, f2):  # 16 bytes per parameter over 2 ranks, nothing left gathered after backward
        assert state["params"] == pytest.approx(full["params"] / 2, rel=0.02)
        assert state["grads"] == pytest.approx(state["params"], rel=0.02)
        assert state["optimizer"] == pytest.approx(2 * state["params"], rel=0.02)
        assert state["comm_buffers"] == 0
    numel = full["params"] / 4
    assert 0 < rows["zero3"]["gathered_peak"] <= numel
    assert rows["fsdp2"]["gathered_peak"] == 0
    for name in ("zero3", "fsdp2"):
        for rank in raw["runs"][name][0]:
            _check_peak_rss(rank, name)


def _check_peak_rss(rank: dict, name: str) -> None:
    """A rank's peak RSS is the process's own (``VmHWM``, reset before the contender ran), in bytes: it holds
    at least the model state the rank counted (parameters, gradients, optimizer state, buffers) and the
    interpreter with torch (well over 50 MB), and is far below the machine (a unit error shows as 1024x)."""
    state = sum(v for k, v in rank["state"].items() if k in report.STATE_KINDS)
    assert rank["rss_source"] == "VmHWM", (name, rank["rss_source"])
    assert rank["state"]["params"] > 0 and rank["rss"] >= max(state, 50 * 2**20), (name, rank["rss"], state)
    assert rank["rss"] < 16 * 2**30, (name, rank["rss"])


def test_stage3_verdicts() -> None:
    state = {"params": 1e6, "grads": 1e6, "optimizer": 2e6, "comm_buffers": 0.0}
    rows = [
        {"name": "zero3", "ratio": 1.2, "best_ratio": 1.1, "cpu_ratio": 1.15, "gathered_peak": 2_000_000,
         "steps": [1.2, 1.0, 1.4], "state": state, "rss": 900e6},
        {"name": "fsdp2", "ratio": 1.3, "best_ratio": 1.2, "cpu_ratio": 1.2, "gathered_peak": 0,
         "steps": [1.0, 1.25, 1.3], "state": {**state, "params": 1.1e6}, "rss": 950e6},
    ]  # fmt: skip
    lines = report.stage3_verdicts(rows)
    assert lines[0].startswith("Target zero3 <= 1.30x ddp: 1.200x, met")
    assert "2.00M parameter elements" in lines[1]
    assert lines[2].startswith("Target zero3 no slower than fsdp2: 1.077x") and lines[2].endswith("NOT met.")
    assert lines[3] == ("Target zero3 no larger than fsdp2: model state 4.0 MB vs 4.1 MB (met); peak RSS 900 MB "
                        "vs 950 MB (met).")  # fmt: skip
    assert report.stage3_verdicts(rows[1:]) == []


def test_contender_registry() -> None:
    assert set(ROWS) | {"local"} <= set(contenders.CONTENDERS)
    assert contenders.CONTENDERS["ddp"].kind == "lightning" and contenders.CONTENDERS["local"].kind == "loop"
    strategy = contenders.CONTENDERS["zero2"].build(BenchConfig(bucket_size=1000))
    assert strategy.zero_config.stage == 2 and strategy.zero_config.reduce_bucket_size == 1000
    zero3 = contenders.CONTENDERS["zero3"].build(BenchConfig(bucket_size=1000))
    assert (zero3.zero_config.stage, zero3.zero_config.reduce_bucket_size) == (3, 1000)
    assert zero3.zero_config.prefetch_bucket_size == 1000 and zero3.zero_config.param_persistence_threshold == 100_000
    assert not zero3.monitor and not strategy.monitor  # no ZeroStatsMonitor in the timed rows
    fsdp2 = contenders.CONTENDERS["fsdp2"].build(BenchConfig())
    assert isinstance(fsdp2, ModelParallelStrategy) and fsdp2.fsdp_options == {}
    table = report._table(["contender", "step ms"], [["ddp", "12"], ["zero2", "13"]], markdown=False)
    assert table.splitlines() == ["contender  step ms", "ddp             12", "zero2           13"]




@pytest.mark.slow
@pytest.mark.distributed
def test_run_all_quick_prints_the_peer_table_with_agreeing_losses(tmp_path: Path, gloo_pool: Any,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """run_all.py --quick on the tiny GPT with two systems: the peer table, the formula check and the loss
    agreement come out (nothing timed is asserted); the docs are not written without --write."""
    raw = tmp_path / "rows.json"
    argv = ["--quick", "--systems", "ddp,zero2", "--parts", "peers", "--docs", str(tmp_path), "--json", str(raw),
            "--timeout", "60"]  # fmt: skip
    out, err = _main("run_all", argv, gloo_pool, capsys)
    assert "| system | step ms |" in out and "| ddp |" in out and "| zero2 |" in out
    assert "every system within 0.0001: yes." in out
    assert "| zero2 |" in out.split("against the ZeRO formula")[1]  # the estimator check ran for zero2
    assert "Machine:" in out and "load average" in out and "Command: `python benchmarks/run_all.py --quick" in out
    assert "Plan: 1 cells, 2 system runs; estimated" in err
    rows = {r["name"]: r for r in json.loads(raw.read_text())["results"]["peers"]}
    assert set(rows) == {"ddp", "zero2"} and rows["ddp"]["loss"] == pytest.approx(rows["zero2"]["loss"], abs=1e-4)
    assert rows["zero2"]["state"]["grads"] == pytest.approx(rows["ddp"]["state"]["grads"] / 2, rel=0.02)
    assert not list(tmp_path.glob("*.md")) and not (tmp_path / "img").exists()


def test_a_loss_disagreement_is_reported_loudly() -> None:
    from benchmarks.harness import pages

    rows = [{"name": "ddp", "loss": 2.5}, {"name": "zero2", "loss": 2.5 + 5e-5},
            {"name": "ds_zero3", "loss": 2.5 + 2e-4}, {"name": "ddp_nosync", "loss": 3.0, "compared": False}]
    lines, bad = pages.loss_check(rows)
    assert bad == ["ds_zero3"] and "**NO: ds_zero3 trained a different model" in lines[0]
    assert pages.loss_check(rows[:2]) == (["Loss after the last step (mean over ranks): ddp 2.500000; every system "
                                           "within 0.0001: yes."], [])  # fmt: skip
    moved = [{**rows[0], "first_loss": 2.75}, rows[1]]  # how far the loss moved: the power of the check
    assert pages.loss_check(moved)[0][0].endswith("within 0.0001: yes. Over the run ddp's loss moved by 2.5e-01 (from "
                                                  "2.750000 at the first step): a system that skipped or mis-scaled "
                                                  "its updates would be off by about that much.")  # fmt: skip


def test_a_sweep_reading_says_whether_the_knob_stands_out_of_the_spread() -> None:
    from benchmarks.harness import pages

    def row(name: str, ratio: float, low: float, high: float) -> dict[str, object]:
        return {"name": name, "ratio": ratio, "low": low, "high": high}

    apart = [row("zero2", 1.0, 0.9, 1.0), row("zero3 k=1", 1.3, 1.25, 1.35), row("zero3 k=2", 1.1, 1.0, 1.1)]
    assert pages.sweep_reading(apart) == ("Reading: fastest zero3 k=2 (1.100x zero2), slowest zero3 k=1 (1.300x); "
                                          "their step ranges [1000-1100] and [1250-1350] ms are apart: a measured "
                                          "effect.")  # fmt: skip
    overlapping = [apart[0], row("zero3 k=1", 1.3, 1.05, 1.35), apart[2]]
    assert pages.sweep_reading(overlapping).endswith("overlap: in this run the knob's effect is within the spread "
                                                     "between rounds.")  # fmt: skip
    assert pages.sweep_reading(apart[:2]) == ""  # one setting: nothing to compare


@pytest.mark.slow
@pytest.mark.distributed
def test_bench_breakdown_quick_counts_every_part_of_a_step(tmp_path: Path, gloo_pool: Any,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """benchmarks/bench_breakdown.py on the tiny GPT: a row per system, each part measured (issue 35)."""
    path = tmp_path / "breakdown.json"
    out, _ = _main("bench_breakdown", ["--quick", "--systems", "ddp,zero2", "--json", str(path)], gloo_pool, capsys)
    assert "| ddp | " in out and "| zero2 | " in out and "load average" in out
    ddp, zero2 = json.loads(path.read_text())
    for row in (ddp, zero2):
        assert row["step_ms"] > 0 and row["main_cpu_ms"] > 0 and row["collectives"] >= 1 and row["mb"] > 0, row
        assert row["faults"] >= 0, row
    assert ddp["blocked_ms"] is None and zero2["blocked_ms"] > 0  # DDP's waits are inside its C++ reducer
    # the owner exchange sends half a ring all-reduce's bytes; ZeRO 2 also all-gathers the parameters once
    assert zero2["mb"] == pytest.approx(ddp["mb"], rel=0.05)


@pytest.mark.distributed
@pytest.mark.slow
def test_bench_tensor_parallel_counts_the_collectives_of_its_formula(gloo_pool: Any) -> None:
    """benchmarks/bench_tensor_parallel.py's traffic part on the session's 2-rank pool: one training step's
    all-reduces, counted at the call, are the Megatron formula it prints against, in number and payload bytes,
    for its own model under this project's layers and for the GPT under its plan (no all-gather in either)."""
    from benchmarks import bench_tensor_parallel as bench

    for model in ("bench", "gpt"):
        calls, total = bench._formula(model, 2)
        for rank, out in enumerate(gloo_pool.run("benchmarks.bench_tensor_parallel:traffic_body", model_name=model)):
            reduces = [b for c, b in out["calls"] if c == "all_reduce"]
            assert all(c == "all_reduce" for c, _ in out["calls"]), (model, rank, out["calls"])
            assert (len(reduces), sum(reduces)) == (calls, total), (model, rank, len(reduces), sum(reduces))


@pytest.mark.distributed
def test_bench_faults_probe_counts_phases_functions_and_reuse(gloo_pool: Any) -> None:
    """benchmarks/bench_faults.py's probe on the tiny GPT at stage 3 (issue 35): every phase of every measured
    step, the exchange's staging writes counted, and the engine's counters per step."""
    import dataclasses

    from benchmarks.bench_faults import PHASES, report
    from benchmarks.harness.config import BenchConfig

    config = dataclasses.asdict(BenchConfig(model="gpt_tiny", seq_len=64, steps=2, warmup=1))
    ranks = gloo_pool.run("benchmarks.bench_breakdown:body", system="zero3", config=config,
                          probe="benchmarks.bench_faults:probe")
    for r in ranks:
        probe = r["probe"]
        assert len(probe["phases"]) == 2 and all(set(s) == set(PHASES) for s in probe["phases"]), probe["phases"]
        faults, calls, cpu = probe["functions"]["MessageStaging.write"]
        assert faults >= 0 and calls > 0 and cpu > 0, probe["functions"]
        for counters in probe["counters"]:  # the tiny GPT's units are all under the persistence threshold
            assert counters["staging allocations"] >= 0
            assert 0 <= counters["gathers served by the pool"] <= counters["unit gathers"], counters
        assert all(h["pooled MB"] > 0 for h in probe["heaps"]), probe["heaps"]  # kept exchange buffers, gather pool
    assert "| MessageStaging.write |" in report("zero3", ranks)


def test_bench_expert_parallel_rows_count_their_bytes_and_gathers(gloo_pool: Any) -> None:
    """benchmarks/bench_expert_parallel.py's rows of this project on the session's 2-rank pool, tiny: ZeRO 3 with
    expert parallelism gathers half the expert bytes of ZeRO 3 without it, sends the all-to-all bytes of the
    formula (within the routing's imbalance) and trains the same model to the same loss."""
    cfg = {"layers": 2, "hidden": 32, "ffn": 64, "experts": 4, "vocab": 64, "batch": 2, "seq": 16, "steps": 2,
           "warmup": 1}
    rows = {row: gloo_pool.run("benchmarks.bench_expert_parallel:run_row", row=row, cfg=cfg)[0]
            for row in ("zero3", "zero3_ep", "zero0_ep")}
    assert rows["zero3_ep"]["experts_gathered"] * 2 == rows["zero3"]["experts_gathered"] > 0
    assert rows["zero3_ep"]["bytes"] < rows["zero3"]["bytes"]
    assert abs(rows["zero3_ep"]["a2a"] - rows["zero3_ep"]["a2a_formula"]) < 0.5 * rows["zero3_ep"]["a2a_formula"]
    assert abs(rows["zero3_ep"]["loss"] - rows["zero3"]["loss"]) < 1e-5 and rows["zero0_ep"]["a2a"] > 0
