"""Optimizer offload ("cpu", "nvme"): parity with the same stage without offload, own storage, counters.

Parity runs both sides with ``AdamW(fused=True)`` (offload switches a torch optimizer to its fused
CPU kernel; with the same kernel on both sides the results must be bitwise equal, in every
precision mode: the masters see the same gradients and are cast back the same way), with
gradient accumulation and a clip value below the observed norm, over 5 optimizer steps on 2 ranks.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_zero import ZeroPrecision, ZeroStrategy
from lightning_zero.core.settings.offload import OffloadConfig
from lightning_zero.core.settings.precision import LossScalerConfig
from tests.models import (
    STAGE3_SHARDED,
    TinyTransformer,
    assert_released,
    make_trainer,
    params_of,
    token_loader,
    units_released,
)

PIECE = 64  # master pieces of 64 elements: many pieces, several sub-groups of SUB_GROUP elements
SUB_GROUP = 200


class FusedTiny(TinyTransformer):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        optimizer = super().configure_optimizers()
        for group in optimizer.param_groups:
            group["fused"], group["foreach"] = True, False
        return optimizer


class OffloadProbe(pl.Callback):
    """At every optimizer step: the counters advanced, masters and state live in the store's storage;
    with ``offload_param``, every released unit's shards live in the param store's own storage."""

    def __init__(self) -> None:
        self.steps: list[dict[str, int]] = []
        self.units: list[tuple[int, int]] = []  # (offloaded shards, releases so far) per micro-step
        self.fused: list[bool] = []
        self.swap_dir: str | None = None

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        engine = trainer.strategy.engine
        sharded, store = engine.sharded, engine.sharded.offload
        if store is None:
            return
        c = store.counters
        shards = store.params.counters if store.params is not None else None
        self.steps.append(dict(steps=c.steps, grad_in=c.grad_bytes_in, out=c.param_bytes_out,
                               read=c.bytes_read, written=c.bytes_written,
                               shard_in=shards.bytes_in if shards else 0, shard_out=shards.bytes_out if shards else 0))
        self.fused.append(all(g.get("fused") for g in sharded.optimizer.param_groups))
        params = [p.untyped_storage().data_ptr() for p in pl_module.parameters()]
        shards = [g.own_shard().untyped_storage().data_ptr() for g in engine.groups]
        for fi, master in enumerate(sharded.masters):
            # fp32 masters with the parameter shards on disk: the master is the shard's own swap file (file_store.py)
            shard_file = store.params.file_of(engine.groups[fi]) if store.params is not None else None
            if shard_file is not None and master.dtype == shard_file.dtype:
                assert master.data_ptr() == shard_file.tensor.data_ptr(), "an fp32 master is not its shard's file"
                continue
            assert master.untyped_storage().data_ptr() not in params + shards, "master shares the params' storage"
            if store.nvme and c.steps:
                swap = store.files[(fi, "master")].tensor
                assert master.data_ptr() == swap.data_ptr(), "master is not its swap file"
                for k, piece in enumerate(sharded.pieces_of[fi]):
                    for key in ("exp_avg", "exp_avg_sq"):
                        t = sharded.optimizer.state[piece][key]
                        assert t.data_ptr() == store.files[(fi, key)].tensor[k * PIECE:].data_ptr(), key
        if store.params is not None:
            self.units.append(_check_param_shards(engine, store.params, params))
        if store.directory is not None:
            self.swap_dir = store.directory.name
            assert os.path.isdir(self.swap_dir) and not os.listdir(self.swap_dir), "swap files must be unlinked"


def _check_param_shards(engine: Any, store: Any, params: list[int]) -> tuple[int, int]:
    """Each released unit's shards live in the param store (its buffers or swap files), not the module's storage."""
    released = [u for u in engine.units if not u.persistent]
    assert released and all(u.shard_io is store for u in released)
    for u in released:
        for g in u.groups:
            assert g.shard.untyped_storage().data_ptr() not in params, "param shard shares the module's storage"
            assert g.shard.data_ptr() == store.homes[id(g)].data_ptr(), "param shard is not in the store"
            if store.nvme:
                assert g.shard.data_ptr() == store.files[id(g)].tensor.data_ptr(), "param shard is not its swap file"
    return store.counters.shards, sum(u.releases for u in released), sum(u.releases > 0 for u in released)


def _devices(device: str) -> dict[str, str]:
    """``"cpu"`` / ``"nvme"``: optimizer offload; ``"param_cpu"`` / ``"param_nvme"``: parameters too."""
    where = device.removeprefix("param_")
    return {"optimizer_device": where, "param_device": where if device.startswith("param_") else "none"}


def _strategy(stage: int, mode: str, **offload: Any) -> ZeroStrategy:
    extra = STAGE3_SHARDED if stage == 3 else {}  # several units, all released
    scaler = LossScalerConfig(initial_scale_power=8) if mode == "16-mixed" else None
    return ZeroStrategy(stage=stage, reduce_bucket_size=100, precision=ZeroPrecision(mode, loss_scaler=scaler),
                        **extra, **offload)


def _fit(strategy: ZeroStrategy) -> dict[str, Any]:
    probe = OffloadProbe()
    model = FusedTiny("adamw")
    trainer = make_trainer(strategy, accumulate_grad_batches=2, gradient_clip_val=0.05, max_steps=5, callbacks=[probe])
    trainer.fit(model, token_loader(n=80))
    return {"losses": model.losses, "params": params_of(model), "steps": probe.steps, "fused": probe.fused,
            "units": probe.units,
            "swap_dir_left": probe.swap_dir is not None and os.path.exists(probe.swap_dir)}


def parity_body(runs: list[tuple[int, str, str]]) -> dict[tuple[int, str, str], dict[str, Any]]:
    from lightning_zero.core.zero import optimizer as zero_optimizer

    default, zero_optimizer.MASTER_PIECE_NUMEL = zero_optimizer.MASTER_PIECE_NUMEL, PIECE
    out: dict[tuple[int, str, str], dict[str, Any]] = {}
    try:
        with tempfile.TemporaryDirectory() as nvme:
            for stage, mode, device in runs:
                if (stage, mode, "none") not in out:
                    out[(stage, mode, "none")] = _fit(_strategy(stage, mode))
                config = OffloadConfig(**_devices(device), nvme_path=nvme, sub_group_size=SUB_GROUP)
                out[(stage, mode, device)] = _fit(_strategy(stage, mode, offload=config))
    finally:
        zero_optimizer.MASTER_PIECE_NUMEL = default
    return out


RUNS = [(stage, "32-true", device) for stage in (1, 2, 3) for device in ("cpu", "nvme")] + [
    (2, "bf16-mixed", "nvme"), (3, "bf16-mixed", "cpu"), (1, "16-mixed", "cpu"), (3, "16-mixed", "nvme"),
    (2, "bf16-true", "cpu"),
] + [(3, mode, f"param_{device}") for mode in ("32-true", "bf16-mixed", "16-mixed") for device in ("cpu", "nvme")]


@pytest.fixture(scope="module")
def offload_results(gloo_pool) -> list[dict]:
    return gloo_pool.run("tests.distributed.test_offload:parity_body", runs=RUNS)


@pytest.mark.slow
@pytest.mark.parametrize("run", RUNS, ids=lambda r: "-".join(map(str, r)))
def test_offload_matches_the_same_stage_without_offload(offload_results: list[dict], run: tuple) -> None:
    stage, mode, _ = run
    for by_run in offload_results:
        base, off = by_run[(stage, mode, "none")], by_run[run]
        assert len(off["losses"]) == 10
        # same kernels on the same values in the same order: bitwise, whatever the precision
        assert off["losses"] == base["losses"]
        for a, b in zip(off["params"], base["params"]):
            assert torch.equal(a, b), (a - b).abs().max()


@pytest.mark.slow
@pytest.mark.parametrize("run", RUNS, ids=lambda r: "-".join(map(str, r)))
def test_offload_counters_advance_every_step_and_files_go(offload_results: list[dict], run: tuple) -> None:
    _, mode, device = run
    where = _devices(device)["optimizer_device"]
    for by_run in offload_results:
        off = by_run[run]
        steps = off["steps"][1::2]  # the boundary micro-steps (accumulation 2)
        assert [s["steps"] for s in steps] == [1, 2, 3, 4, 5]
        on_disk = _file_system(tempfile.gettempdir()) not in ("tmpfs", "ramfs")  # the swap files' directory
        for before, after in zip([dict.fromkeys(steps[0], 0), *steps], steps):
            assert after["out"] > before["out"]
            if where == "cpu" or mode not in ("32-true", "bf16-true"):
                assert after["grad_in"] > before["grad_in"]
            if where == "nvme" and on_disk:  # real disk traffic (/proc/self/io): the state written at every
                # step (this state is a few pages, partly left in the page cache: its reads are measured with
                # a larger one in test_nvme_byte_counters_are_the_disk_traffic_of_the_steps)
                assert after["written"] > before["written"] and after["read"] >= before["read"]
            if device.startswith("param_"):  # shards read at every gather, written at every step
                assert after["shard_in"] > before["shard_in"] and after["shard_out"] > before["shard_out"]
        if device.startswith("param_"):
            shards, releases, units = zip(*off["units"])
            assert min(shards) >= 2 and releases[-1] > releases[0] > 0 and units[-1] >= 2  # sharded, released
        assert all(off["fused"])  # stepped with the fused CPU kernels
        assert not off["swap_dir_left"]


# ---------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(("kwargs", "error", "message"), [
    (dict(stage=2, offload_param="cpu"), ValueError, r"offload_param='cpu' needs ZeRO stage 3"),
    (dict(stage=0, offload_optimizer="cpu"), ValueError, r"needs ZeRO stage 1, 2 or 3 .*, got stage=0"),
    (dict(stage=2, offload_optimizer="nvme"), ValueError, r"'nvme' keeps its swap files under nvme_path"),
    (dict(stage=2, offload_optimizer="nvme", nvme_path="/no/such/dir"), ValueError, r"does not exist"),
    (dict(stage=3, offload_param="nvme"), ValueError, r"offload_param='nvme' keeps its swap files under nvme_path"),
    (dict(stage=1, offload_optimizer="nvme", offload_param="nvme", nvme_path="/tmp"), ValueError,
     r"offload_param='nvme' needs ZeRO stage 3 \(partitioned parameters\), got stage=1. Fix: stage=3"),
])
def test_bad_offload_input_is_refused_when_the_strategy_is_built(kwargs: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        ZeroStrategy(**kwargs)


def test_a_file_in_place_of_the_directory_and_a_full_disk_are_refused(tmp_path, monkeypatch) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    with pytest.raises(ValueError, match="does not exist or is not a directory"):
        OffloadConfig(optimizer_device="nvme", nvme_path=str(not_a_dir)).check_path()
    monkeypatch.setattr("lightning_zero.core.settings.offload.os.access", lambda path, mode: False)
    with pytest.raises(ValueError, match="is not writable"):
        OffloadConfig(optimizer_device="nvme", nvme_path=str(tmp_path)).check_path()


def test_the_engine_refuses_a_disk_without_room_for_the_estimated_state(tmp_path, monkeypatch) -> None:
    from collections import namedtuple

    from lightning_zero import ZeroConfig, ZeroEngine
    from lightning_zero.core.comm.data_parallel import DataParallelComm

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr("lightning_zero.core.settings.offload.shutil.disk_usage", lambda path: usage(10**6, 0, 1000))
    model = torch.nn.Linear(100, 100)
    with pytest.raises(ValueError, match=r"has 1 kB free but the offloaded state needs 162 kB. Fix: nvme_path=<"):
        ZeroEngine(model, torch.optim.AdamW(model.parameters()), ZeroConfig(stage=2), DataParallelComm(),
                   offload=OffloadConfig(optimizer_device="nvme", nvme_path=str(tmp_path)))
    assert not os.listdir(tmp_path)  # refused before any swap file


def test_pin_memory_without_an_accelerator_warns_and_stays_unpinned() -> None:
    from lightning_zero.core.offload.store import open_shard_store

    if torch.cuda.is_available():
        pytest.skip("an accelerator is present: pinning is used")
    with pytest.warns(UserWarning, match="pin_memory=True needs an accelerator"):
        store = open_shard_store(OffloadConfig(optimizer_device="cpu", pin_memory=True))
    assert not store.pin and not store.new_master(0, torch.zeros(10), torch.float32).is_pinned()


def test_an_engine_without_an_optimizer_says_that_it_offloads_nothing() -> None:
    from lightning_zero import ZeroConfig, ZeroEngine
    from lightning_zero.core.comm.data_parallel import DataParallelComm

    model = torch.nn.Linear(4, 4)
    with pytest.warns(UserWarning, match=r"offload=param_cpu .* without an optimizer .* every shard stays in memory"):
        ZeroEngine(model, None, ZeroConfig(stage=3), DataParallelComm(),
                   offload=OffloadConfig(optimizer_device="cpu", param_device="cpu"))


def test_swap_files_are_never_left_readable_after_a_crash(tmp_path) -> None:
    """A process killed mid-run leaves at most an empty private directory: its files were unlinked at once."""
    import signal
    import subprocess
    import sys

    script = (
        "import os, sys, torch\n"
        "from lightning_zero.core.settings.offload import OffloadConfig\n"
        "from lightning_zero.core.offload.store import open_shard_store\n"
        f"store = open_shard_store(OffloadConfig(optimizer_device='nvme', nvme_path={str(tmp_path)!r}))\n"
        "master = store.new_master(0, torch.zeros(1 << 20), torch.float32)\n"
        "master.fill_(3.0)\n"
        "print(store.directory.name, flush=True)\n"
        "sys.stdin.read()\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        private = proc.stdout.readline().strip()
        assert os.path.isdir(private) and os.listdir(private) == []  # live, 4 MB mapped, no name on disk
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    leftovers = [os.path.join(d, f) for d, _, files in os.walk(tmp_path) for f in files]
    assert leftovers == []


# ---------------------------------------------------------------------------------------------- checkpoints
def resume_body(directory: str) -> dict[str, Any]:
    """2 steps + save + 2 resumed steps, without offload throughout, against switching offload on or
    off at the save (the saved state must be the same, and so must the resumed steps)."""
    nvme = OffloadConfig(optimizer_device="nvme", nvme_path=directory, sub_group_size=SUB_GROUP)

    def run(offload: OffloadConfig | None, steps: int, save: str | None = None, resume: str | None = None):
        model = FusedTiny("adamw")
        strategy = _strategy(2, "32-true", **({"offload": offload} if offload else {}))
        trainer = make_trainer(strategy, accumulate_grad_batches=2, gradient_clip_val=0.05, max_steps=steps)
        trainer.fit(model, token_loader(n=80), ckpt_path=resume)
        if save:
            trainer.save_checkpoint(save)
        return model.losses, params_of(model)

    plain, switched = os.path.join(directory, "plain.ckpt"), os.path.join(directory, "offload.ckpt")
    head = run(None, 2, save=plain)
    tail = run(None, 4, resume=plain)
    runs = {"offload_then_none": (run(nvme, 2, save=switched), run(None, 4, resume=switched)),
            "none_then_offload": (head, run(nvme, 4, resume=plain))}
    return {name: (h[0] == head[0] and t[0] == tail[0], all(torch.equal(a, b) for a, b in zip(t[1], tail[1])))
            for name, (h, t) in runs.items()}


@pytest.mark.slow
def test_checkpoints_saved_with_offload_resume_without_it_and_back(gloo_pool, tmp_path) -> None:
    for by_rank in gloo_pool.run("tests.distributed.test_offload:resume_body", directory=str(tmp_path)):
        assert by_rank == {"offload_then_none": (True, True), "none_then_offload": (True, True)}


# ---------------------------------------------------------------------------------------------- resident memory
def resident_main(mode: str, path: str) -> None:
    """One process: a 16.8M-parameter MLP (AdamW fp32: 201 MB of master + moments when offloaded), 3 steps;
    prints the peak resident set's increase over the steps (anonymous and mapped file pages alike).
    ``mode``: ``"none"`` (no offload), ``"nvme"``, or ``"kept"`` (nvme stepping the files' mappings in place
    and never releasing their pages from the process: what the measurement must catch)."""
    import json

    from lightning_zero import ZeroConfig, ZeroEngine
    from lightning_zero.core.comm.data_parallel import DataParallelComm
    from lightning_zero.core.offload.file_store import FileStore
    from lightning_zero.core.offload.host_store import HostStore
    from lightning_zero.core.offload.swap_file import SwapFile
    from lightning_zero.testing.memory import proc_status_bytes, reset_peak_rss

    if mode == "kept":
        FileStore._run_sub_groups = HostStore._run_sub_groups  # type: ignore[method-assign]
        SwapFile.release = lambda self, lo, hi: 0  # type: ignore[method-assign]
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(16)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)  # the kernel offload uses
    x, target = torch.randn(8, 1024), torch.randn(8, 1024)
    reset_peak_rss()
    base = proc_status_bytes("VmRSS")  # the model's parameters are in it; what the engine adds is not
    offload = OffloadConfig(optimizer_device="nvme", nvme_path=path) if mode != "none" else None
    engine = ZeroEngine(model, optimizer, ZeroConfig(stage=1), DataParallelComm(), offload=offload)
    losses = []
    for _ in range(3):
        loss = torch.nn.functional.mse_loss(model(x), target)
        loss.backward()
        engine.finish_backward()
        engine.prepare_step()
        optimizer.step()
        engine.after_step()
        losses.append(loss.item())
    store = engine.sharded.offload
    swapped = getattr(store, "swapped", None)  # the fixed swap buffers the step goes through (swap_step.py)
    buffers = sum(b.numel() * b.element_size() for s in swapped.sets for b in s.buffers.values()) if swapped else 0
    print(json.dumps({"losses": losses, "peak_increase": proc_status_bytes("VmHWM") - base,
                      "resident_after": proc_status_bytes("VmRSS") - base, "buffers": buffers}))


def _run_resident(directory: Path) -> dict[str, dict[str, Any]]:
    """:func:`resident_main` in a process of its own per mode, one after another: what each printed."""
    import json
    import subprocess
    import sys

    results = {}
    for mode in ("none", "nvme", "kept"):
        code = f"from tests.distributed.test_offload import resident_main; resident_main({mode!r}, {str(directory)!r})"
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=Path(__file__).resolve().parents[2])
        assert proc.returncode == 0, proc.stderr[-3000:]
        results[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    return results


@pytest.mark.slow
@pytest.mark.lane(run=_run_resident)  # processes of their own (Note [background lane] in tests/lane.py)
def test_with_its_optimizer_state_on_disk_a_step_keeps_only_sub_groups_resident(lane_result: dict) -> None:
    state = 16 * (1024 * 1024 + 1024) * 4 * 3  # fp32 master + AdamW's two moments
    results = lane_result
    assert results["nvme"]["losses"] == results["none"]["losses"] == results["kept"]["losses"]  # the same training
    none, nvme, kept = results["none"], results["nvme"], results["kept"]
    moments = state * 2 // 3
    # Measured (ext4, 2 cores): none 296 MB resident after the steps (grads 67, moments 134, ...), nvme 117
    # (of which 48 MB are the swap buffers: 3 sets of 4 sub-group buffers of 1M fp32 elements), kept 280;
    # peaks 296 / 190 / 352 MB. The measurement sees mapped file pages: an offload that leaves its pages in the
    # process ("kept") is resident by the whole state more than nvme without its buffers, at the peak and after
    buffers = nvme["buffers"]
    assert 0 < buffers <= 3 * 4 * 1_000_000 * 4, results
    assert kept["resident_after"] - nvme["resident_after"] + buffers > 0.9 * state, results
    assert kept["peak_increase"] - nvme["peak_increase"] + buffers > 0.8 * state, results
    # and the released state is less resident than the moments held in memory without offload
    assert none["resident_after"] - nvme["resident_after"] > 0.9 * moments, results


# ---------------------------------------------------------------------------------------------- measured I/O
def _file_system(path: str) -> str:
    """The type of the file system ``path`` is on (the longest mount point above it in /proc/mounts)."""
    best, kind = "", ""
    with open("/proc/mounts") as f:
        for line in f:
            mount, fstype = line.split()[1:3]
            if os.path.realpath(path).startswith(mount.rstrip("/") + "/") and len(mount) > len(best):
                best, kind = mount, fstype
    return kind


def _nvme_io_per_step(path: str, steps: int = 4) -> tuple[int, list[tuple[int, int]]]:
    """A 1M-parameter MLP at stage 1 with its AdamW state in swap files: the state's bytes, and the
    counters' (read, written) of each step."""
    from lightning_zero import ZeroConfig, ZeroEngine
    from lightning_zero.core.comm.data_parallel import DataParallelComm

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    engine = ZeroEngine(model, optimizer, ZeroConfig(stage=1), DataParallelComm(),
                        offload=OffloadConfig(optimizer_device="nvme", nvme_path=path, sub_group_size=200_000))
    counters, out = engine.sharded.offload.counters, []
    x = torch.randn(8, 512)
    for _ in range(steps):
        model(x).square().mean().backward()
        engine.finish_backward()
        engine.prepare_step()
        before = (counters.bytes_read, counters.bytes_written)
        optimizer.step()
        engine.after_step()
        out.append((counters.bytes_read - before[0], counters.bytes_written - before[1]))
    engine.detach(keep_optimizer_state=False)
    return 3 * 4 * sum(p.numel() for p in model.parameters()), out


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="measures /proc/self/io")
def test_nvme_byte_counters_are_the_disk_traffic_of_the_steps(tmp_path, monkeypatch) -> None:
    if _file_system(str(tmp_path)) in ("tmpfs", "ramfs"):
        pytest.skip("the swap files would be in memory: no disk traffic to measure")
    state, io = _nvme_io_per_step(str(tmp_path))
    # after the first step (its state still in the page cache) every step reads the whole state back from
    # the disk (the writer dropped it from the page cache) and writes it out again
    for read, written in io[1:]:
        assert state <= read <= 1.2 * state + 2**20, (state, io)
        assert state <= written <= 1.2 * state + 2**20, (state, io)
    # with pages left in the page cache the disk reads nothing, and the counter says so (a count of the
    # ranges handed to the reader would still say the whole state)
    from lightning_zero.core.offload.swap_file import SwapFile

    settle = SwapFile.settle
    monkeypatch.setattr(SwapFile, "settle", lambda self, lo, hi, drop=True: settle(self, lo, hi, drop=False))
    state, io = _nvme_io_per_step(str(tmp_path))
    for read, written in io[1:]:
        assert read < 0.05 * state and written >= state, (state, io)


# ---------------------------------------------------------------------------------------------- composition
def _stage3(offload: OffloadConfig | None, **kwargs: Any) -> ZeroStrategy:
    return ZeroStrategy(stage=3, **STAGE3_SHARDED, **kwargs, **({"offload": offload} if offload else {}))


def _nvme(directory: str) -> OffloadConfig:
    return OffloadConfig(optimizer_device="nvme", param_device="nvme", nvme_path=directory, sub_group_size=SUB_GROUP)


def composition_body(root: str) -> dict[str, Any]:
    """Stage 3 with both offloads on "nvme": (a) with activation checkpointing, against the same without
    offload; (b) 10 steps saving a sharded checkpoint at step 4 (resumed at 1 rank by the test)."""
    from tests.e2e.test_checkpoints import _fit, _saver

    out: dict[str, Any] = {}
    for name, offload in (("plain", None), ("offload", _nvme(root))):
        model, strategy = FusedTiny("adamw"), _stage3(offload, activation_checkpointing=True)
        _fit(model, strategy, max_steps=5)
        out[name] = (model.losses, params_of(model), units_released(strategy, model))
    model, strategy = FusedTiny("adamw"), _stage3(_nvme(root))
    _fit(model, strategy, callbacks=[_saver(os.path.join(root, "ckpt"))])
    out["saved_run"] = model.losses
    return out


@pytest.mark.slow
def test_offload_composes_with_checkpointing_and_resumes_at_another_world_size(gloo_pool, tmp_path) -> None:
    from tests.e2e.test_checkpoints import _fit, _global

    runs = gloo_pool.run("tests.distributed.test_offload:composition_body", root=str(tmp_path))
    for r in runs:  # activation checkpointing recomputes the forward: the units are gathered again from the store
        (plain_losses, plain_params, plain_units), (losses, params, units) = r["plain"], r["offload"]
        assert losses == plain_losses and len(losses) == 5
        assert all(torch.equal(a, b) for a, b in zip(params, plain_params))
        assert_released(units) and assert_released(plain_units)
    reference = _global([r["saved_run"] for r in runs])[4:]  # steps 5-10 of the 2-rank run
    ckpt = os.path.join(str(tmp_path), "ckpt", "epoch=0-step=4.ckpt")
    for offload in (None, _nvme(str(tmp_path))):  # 2 ranks with offload -> 1 rank without it, and with it
        model = FusedTiny("adamw")
        _fit(model, _stage3(offload), devices=1, batch_size=8, ckpt_path=ckpt)
        assert model.losses == pytest.approx(reference, rel=1e-5), (offload, model.losses, reference)


# ---------------------------------------------------------------------------------------------- every part on disk
class _Losses(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.store: dict[str, Any] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *args: Any) -> None:
        self.losses.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))
        store = trainer.strategy.engine.sharded.store
        io = store.io_counters()
        self.store = {"grads_in_files": store.streamed_grads() is not None,
                      "read": io.bytes_read if io else 0, "written": io.bytes_written if io else 0}


def gpt_1m_body(directory: str) -> dict[str, Any]:
    """The 1.06M-parameter GPT at stage 3, 3 steps, without offload and with its parameter shards, gradient
    shards, fp32 masters and AdamW moments all in swap files (the same fused kernel on both sides)."""
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_zero.models.gpt import GPTLightningModule
    from tests.models import RankSampler, rank_and_world

    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (24, 33), generator=gen)
    rank, world = rank_and_world()
    out = {}
    for name, offload in (("none", None), ("disk", OffloadConfig(optimizer_device="nvme", param_device="nvme",
                                                                  nvme_path=directory))):
        model = GPTLightningModule("gpt_1m", warmup_steps=0, fused=True, build_in_configure_model=True,
                                   model_overrides={"seq_len": 32})
        recorder = _Losses()
        strategy = ZeroStrategy(stage=3, offload=offload) if offload else ZeroStrategy(stage=3)
        trainer = make_trainer(strategy, max_steps=3, callbacks=[recorder])
        loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=2,
                            sampler=RankSampler(len(tokens), rank, world))
        trainer.fit(model, loader)
        out[name] = {"losses": recorder.losses, "params": params_of(model), **recorder.store}
    return out


def test_a_1m_gpt_with_every_part_on_disk_trains_bitwise_as_without_offload(gloo_pool, tmp_path) -> None:
    for by_rank in gloo_pool.run("tests.distributed.test_offload:gpt_1m_body", directory=str(tmp_path)):
        base, disk = by_rank["none"], by_rank["disk"]
        assert len(disk["losses"]) == 3 and disk["losses"] == base["losses"]
        assert all(torch.equal(a, b) for a, b in zip(disk["params"], base["params"]))
        assert disk["grads_in_files"] and disk["read"] > 0 and disk["written"] > 0
