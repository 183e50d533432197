"""Sharded checkpoints (docs/checkpoints.md): exact resume, other world sizes and stages,
consolidation / conversion, atomic saves under failures, refusal of unsafe or bad input."""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn

from lightning_zero import ZeroStrategy
from lightning_zero.checkpoint import CheckpointError, ShardedCheckpoint, consolidate_checkpoint, publish
from lightning_zero.checkpoint.plain import from_plain, to_plain
from lightning_zero.cli import main as cli_main
from tests.models import (
    STAGE3_SHARDED,
    VOCAB,
    StackedLM,
    TinyTransformer,
    assert_released,
    make_trainer,
    params_of,
    token_loader,
    units_released,
)

REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------------------------- helpers
class DropoutLM(TinyTransformer):
    """TinyTransformer with dropout, so that an exact resume needs the RNG state too."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        h = nn.functional.dropout(self.emb(x[:, :-1]), 0.2, training=True)
        h = self.enc(self.frozen(h))
        loss = nn.functional.cross_entropy(self.head(h).reshape(-1, VOCAB), x[:, 1:].reshape(-1))
        self.losses.append(loss.item())
        return loss


class ResumableLoader:
    """A loader Lightning can resume mid-epoch (``state_dict`` / ``load_state_dict``): it skips the
    batches the saved epoch had already trained on."""

    def __init__(self, loader: Any) -> None:
        self.loader, self.trainer, self._skip = loader, None, 0

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):  # type: ignore[no-untyped-def]
        skip, self._skip = self._skip, 0
        for i, batch in enumerate(self.loader):
            if i >= skip:
                yield batch

    def state_dict(self) -> dict[str, int]:
        return {"skip": self.trainer.fit_loop.epoch_loop.batch_progress.current.processed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._skip = state["skip"]


def _fit(model: Any, strategy: Any, devices: int = 2, batch_size: int = 4, ckpt_path: str | None = None,
         callbacks: list | None = None, max_steps: int = 10) -> Any:
    loader = ResumableLoader(token_loader(n=48, batch_size=batch_size))
    trainer = make_trainer(strategy, devices=devices, max_steps=max_steps, enable_checkpointing=bool(callbacks),
                           callbacks=callbacks or [])
    loader.trainer = trainer
    trainer.fit(model, loader, ckpt_path=ckpt_path)
    return trainer


def _saver(dirpath: str, every: int = 4, **kw: Any) -> ModelCheckpoint:
    return ModelCheckpoint(dirpath=dirpath, every_n_train_steps=every, save_top_k=-1, **kw)


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b))


# ---------------------------------------------------------------------------------------------- exact resume
def mid_epoch_body(stage: int, root: str, precision: str = "32-true") -> dict[str, Any]:
    """Uninterrupted 10 steps (6 batches per epoch, saves every 4 steps: mid-epoch) vs. resumed from
    step 4, at the same stage and world size, with dropout."""
    fmt = {"checkpoint_format": "sharded"} if stage == 0 else STAGE3_SHARDED if stage == 3 else {}
    full, first = DropoutLM("adamw"), ZeroStrategy(stage=stage, precision=precision, **fmt)
    _fit(full, first, callbacks=[_saver(root)])
    resumed, second = DropoutLM("adamw"), ZeroStrategy(stage=stage, precision=precision, **fmt)
    _fit(resumed, second, ckpt_path=os.path.join(root, "epoch=0-step=4.ckpt"))
    released = [units_released(first, full), units_released(second, resumed)] if stage == 3 else []
    # trainable parameters: frozen ones hold the 16-bit values in a checkpoint (a bf16 run keeps its
    # frozen fp32 originals in memory and restores them at teardown)
    trained = [n for n, p in full.named_parameters() if p.requires_grad]
    full_p, resumed_p = dict(full.named_parameters()), dict(resumed.named_parameters())
    diff = _max_diff([full_p[n].detach() for n in trained], [resumed_p[n].detach() for n in trained])
    return {"full": full.losses, "resumed": resumed.losses, "diff": diff, "released": released,
            "is_dir": os.path.isdir(os.path.join(root, "epoch=0-step=4.ckpt"))}


@pytest.mark.distributed
@pytest.mark.parametrize(("stage", "precision"), [(0, "32-true"), (1, "32-true"), (2, "32-true"), (3, "32-true"),
                                                  (2, "bf16-mixed")])
def test_mid_epoch_resume_equals_the_uninterrupted_run(gloo_pool, tmp_path, stage: int, precision: str) -> None:
    for r in gloo_pool.run("tests.e2e.test_checkpoints:mid_epoch_body", stage=stage, root=str(tmp_path),
                           precision=precision):
        assert r["is_dir"]
        assert len(r["resumed"]) == 6
        assert r["resumed"] == pytest.approx(r["full"][4:], rel=1e-6, abs=0), r
        assert r["diff"] < 1e-6, r
        assert len(r["released"]) == (2 if stage == 3 else 0)
        for info in r["released"]:  # stage 3 sharded for real (every parameter is below the default threshold)
            assert_released(info)


def two_rank_run_body(stage: int, root: str, ckpt_path: str | None = None) -> dict[str, Any]:
    from lightning_zero.checkpoint.tensor_file import TensorFile

    model, strategy = TinyTransformer("adamw"), ZeroStrategy(stage=stage, **(STAGE3_SHARDED if stage == 3 else {}))
    read, original = [0], TensorFile.read

    def counting(self: TensorFile, key: str, start: int = 0, end: int | None = None, out: Any = None) -> Any:
        value = original(self, key, start, end, out)
        if key.startswith("g"):  # shards: parameters, masters, optimizer state
            read[0] += value.numel() * torch.empty((), dtype=self.dtype(key)).element_size()
        return value

    TensorFile.read = counting  # type: ignore[method-assign]
    try:
        _fit(model, strategy, callbacks=None if ckpt_path else [_saver(root)], ckpt_path=ckpt_path)
    finally:
        TensorFile.read = original  # type: ignore[method-assign]
    return {"losses": model.losses, "params": params_of(model), "shard_bytes_read": read[0],
            "released": units_released(strategy, model) if stage == 3 else None}


def _global(per_rank: list[list[float]]) -> list[float]:
    """The loss of the global batch: the mean of the ranks' (equal-sized) batches."""
    return [sum(v) / len(v) for v in zip(*per_rank)]


def _one_rank(stage: int, root: str | None, ckpt_path: str | None = None) -> Any:
    """One rank with the global batch of two ranks (batch 8 = the two ranks' batches of 4)."""
    model = TinyTransformer("adamw")
    _fit(model, ZeroStrategy(stage=stage), devices=1, batch_size=8, ckpt_path=ckpt_path,
         callbacks=[_saver(root)] if root else None)
    return model


@pytest.mark.distributed
@pytest.mark.parametrize(("stage", "resume_stage"), [(2, 2), (2, 3), (3, 1)])
def test_resume_at_another_world_size_or_stage(gloo_pool, tmp_path, stage: int, resume_stage: int) -> None:
    root = str(tmp_path / "ckpt")
    ckpt = os.path.join(root, "epoch=0-step=4.ckpt")
    full = gloo_pool.run("tests.e2e.test_checkpoints:two_rank_run_body", stage=stage, root=root)
    reference = _global([r["losses"] for r in full])[4:]
    for r in full if stage == 3 else []:
        assert_released(r["released"])
    if stage == resume_stage:  # 2 -> 1 ranks
        resumed = _one_rank(resume_stage, None, ckpt_path=ckpt).losses
    else:  # 2 -> 2 ranks at another stage
        runs = gloo_pool.run("tests.e2e.test_checkpoints:two_rank_run_body",
                             stage=resume_stage, root=root, ckpt_path=ckpt)
        resumed = _global([r["losses"] for r in runs])
        for r in runs if resume_stage == 3 else []:
            assert_released(r["released"])
            # each rank read only the slices it owns: about half of the parameters and of AdamW's two
            # moments (4 bytes each), never the whole (3 x 4 bytes x every trainable element)
            trainable = sum(p.numel() for p in TinyTransformer("adamw").parameters() if p.requires_grad)
            assert 0 < r["shard_bytes_read"] < 0.6 * 12 * trainable, (r["shard_bytes_read"], 12 * trainable)
    assert len(resumed) == 6
    assert resumed == pytest.approx(reference, rel=1e-5), (resumed, reference)


@pytest.mark.distributed
def test_resume_from_one_rank_on_two(gloo_pool, tmp_path) -> None:
    root = str(tmp_path / "ckpt")
    full = _one_rank(2, root)
    assert ShardedCheckpoint(os.path.join(root, "epoch=0-step=4.ckpt")).world_size == 1
    runs = gloo_pool.run("tests.e2e.test_checkpoints:two_rank_run_body", stage=2, root=root,
                         ckpt_path=os.path.join(root, "epoch=0-step=4.ckpt"))
    resumed = _global([r["losses"] for r in runs])
    assert resumed == pytest.approx(full.losses[4:], rel=1e-5), (resumed, full.losses)
    # AdamW divides by sqrt(v): a different reduction order (1 vs 2 ranks) shows in the weights' 4th digit
    assert _max_diff(runs[0]["params"], params_of(full)) < 1e-3


# ---------------------------------------------------------------------------------------------- consolidation
def stage3_save_body(root: str) -> dict[str, Any]:
    """StackedLM (tied weights, a frozen unit) at stage 3: save at the last step, return the
    trained weights and outputs."""
    model = StackedLM("adamw")
    model.save_hyperparameters({"optimizer": "adamw", "num_blocks": 3})
    strategy = ZeroStrategy(stage=3, param_persistence_threshold=0, prefetch_bucket_size=1)
    make_trainer(strategy, max_steps=3, enable_checkpointing=True,
                 callbacks=[ModelCheckpoint(dirpath=root, every_n_train_steps=3, save_last=True)]).fit(
        model, token_loader(n=32))
    x = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return {"state": {k: v.clone() for k, v in model.state_dict().items()}, "out": model(x), "x": x,
                "released": units_released(strategy, model)}


@pytest.fixture(scope="module")
def stage3_checkpoint(gloo_pool, tmp_path_factory) -> tuple[Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("stage3")
    result = gloo_pool.run("tests.e2e.test_checkpoints:stage3_save_body", root=str(root))[0]
    return root / "last.ckpt", result


@pytest.mark.distributed
def test_consolidate_loads_strictly_into_the_plain_module(stage3_checkpoint) -> None:
    path, trained = stage3_checkpoint
    assert_released(trained["released"])  # the checkpoint was written from released units
    assert path.is_symlink() and ShardedCheckpoint(path).stage == 3
    state = consolidate_checkpoint(path)
    assert all(v.dtype == torch.float32 for v in state.values())
    plain = StackedLM()
    plain.load_state_dict(state, strict=True)
    for k, v in trained["state"].items():
        assert torch.equal(state[k], v), k
    with torch.no_grad():
        assert torch.equal(plain(trained["x"]), trained["out"])


@pytest.mark.distributed
def test_convert_cli_writes_pt_safetensors_and_a_lightning_ckpt(stage3_checkpoint, tmp_path) -> None:
    path, trained = stage3_checkpoint
    assert cli_main(["convert", str(path), str(tmp_path / "model.pt")]) == 0
    assert cli_main(["convert", str(path), str(tmp_path / "model.safetensors")]) == 0
    assert cli_main(["convert", str(path), str(tmp_path / "model.ckpt"), "--lightning"]) == 0
    from safetensors.torch import load_file

    for state in (torch.load(tmp_path / "model.pt", weights_only=True), load_file(tmp_path / "model.safetensors")):
        plain = StackedLM()
        plain.load_state_dict(state, strict=True)
        with torch.no_grad():
            assert torch.equal(plain(trained["x"]), trained["out"])
    loaded = StackedLM.load_from_checkpoint(tmp_path / "model.ckpt", weights_only=True)
    with torch.no_grad():
        assert torch.equal(loaded(trained["x"]), trained["out"])
    ckpt = torch.load(tmp_path / "model.ckpt", weights_only=True)
    assert ckpt["global_step"] == 3 and ckpt["optimizer_states"][0]["state"]


# ---------------------------------------------------------------------------------------------- failures
class _FaultAfter(Callback):
    """From global step ``step`` on, make rank ``rank``'s checkpoint writer fail: ``"raise"`` an
    OSError after it wrote its files, or ``"kill"`` the process there (``publish.after_write_hook``)."""

    def __init__(self, step: int, rank: int, how: str) -> None:
        self.step, self.rank, self.how = step, rank, how

    def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
        if trainer.global_step >= self.step:
            publish.after_write_hook = self._fault

    def _fault(self, rank: int, directory: Path) -> None:
        if rank != self.rank:
            return
        if self.how == "kill":
            import signal

            os.kill(os.getpid(), signal.SIGKILL)
        raise OSError(f"injected writer failure on rank {rank}")

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        publish.after_write_hook = None


class _StartStep(Callback):
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        pl_module.start_step = trainer.global_step


def writer_error_body(root: str) -> dict[str, Any]:
    error = None
    try:
        _fit(TinyTransformer("sgd"), ZeroStrategy(stage=2), max_steps=4,
             callbacks=[_saver(root, every=2, save_last=True), _FaultAfter(3, 1, "raise")])
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    finally:
        publish.after_write_hook = None
    return {"error": error, **resume_last_body(root)}


def resume_last_body(root: str) -> dict[str, Any]:
    model = TinyTransformer("sgd")
    _fit(model, ZeroStrategy(stage=2), max_steps=6, callbacks=[_saver(root, every=100, save_last=True), _StartStep()],
         ckpt_path="last")
    return {"start_step": model.start_step, "losses": model.losses}


@pytest.mark.distributed
def test_an_error_in_one_ranks_writer_keeps_the_previous_checkpoint(gloo_pool, tmp_path) -> None:
    root = str(tmp_path)
    results = gloo_pool.run("tests.e2e.test_checkpoints:writer_error_body", root=root)
    assert "injected writer failure on rank 1" in results[1]["error"]
    assert "failed on rank(s) [1]" in results[0]["error"]
    assert all(r["start_step"] == 2 for r in results), results  # resumed from the step-2 "last"


def _run_killed_mid_save(root: Path) -> tuple[str, subprocess.CompletedProcess[str]]:
    """Two ranks under torchrun, one killed in the middle of its step-4 save: where they saved, and the run."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(REPO / "tests" / "checkpoint_kill_script.py"), str(root)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "PL_DISABLE_FORK": "1"}
    return str(root), subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.distributed
@pytest.mark.lane(run=_run_killed_mid_save)  # processes of their own (Note [background lane] in tests/lane.py)
def test_a_rank_killed_mid_save_keeps_the_previous_checkpoint(gloo_pool, lane_result) -> None:
    root, proc = lane_result
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "SAVED step 2" in proc.stdout, proc.stdout + proc.stderr
    assert any(".tmp-" in name for name in os.listdir(root))  # the killed save's leftovers, never published
    ckpt = ShardedCheckpoint(os.path.join(root, "last.ckpt"))
    assert ckpt.lightning_state()["global_step"] == 2
    results = gloo_pool.run("tests.e2e.test_checkpoints:resume_last_body", root=root)
    assert all(r["start_step"] == 2 for r in results), results


# ---------------------------------------------------------------------------------------------- unsafe / bad input
@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("small")
    _fit(TinyTransformer("adamw"), ZeroStrategy(stage=1), devices=1, batch_size=8, max_steps=2,
         callbacks=[_saver(str(root), every=2)])
    return root / "epoch=0-step=2.ckpt"


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src.resolve(), dst)
    return dst


class _Bomb:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (Path.touch, (Path(self.marker),))


@pytest.mark.parametrize("victim", ["metadata.json", "rank-00000.safetensors", "extra.safetensors", "evil.pt"])
def test_a_pickle_bomb_anywhere_in_the_directory_is_refused(small_checkpoint, tmp_path, victim: str) -> None:
    ckpt = _copy(small_checkpoint, tmp_path / "ckpt")
    marker = tmp_path / "pwned"
    (ckpt / victim).write_bytes(pickle.dumps({"state_dict": _Bomb(str(marker))}))
    with pytest.raises(CheckpointError, match="refused"):
        consolidate_checkpoint(ckpt)
    with pytest.raises(CheckpointError, match="refused"):
        ZeroStrategy(stage=1).load_checkpoint(ckpt)
    assert cli_main(["convert", str(ckpt), str(tmp_path / "out.pt")]) != 0
    assert not marker.exists()


def test_bad_input_gets_a_clear_error(small_checkpoint, tmp_path) -> None:
    import json

    ckpt = _copy(small_checkpoint, tmp_path / "v3")
    meta = json.loads((ckpt / "metadata.json").read_text())
    (ckpt / "metadata.json").write_text(json.dumps({**meta, "version": 3}))
    with pytest.raises(CheckpointError, match="format version 3; this version of lightning_zero reads versions 1, 2"):
        consolidate_checkpoint(ckpt)
    ckpt = _copy(small_checkpoint, tmp_path / "missing")
    (ckpt / "rank-00000.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"incomplete: missing \['rank-00000.safetensors'\]"):
        consolidate_checkpoint(ckpt)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"not a lightning_zero sharded checkpoint: it has no metadata\.json"):
        consolidate_checkpoint(tmp_path / "empty")
    with pytest.raises(CheckpointError, match="No checkpoint at"):
        consolidate_checkpoint(tmp_path / "nowhere")


def test_plain_data_round_trips_and_other_objects_are_named() -> None:
    from omegaconf import OmegaConf

    tensors: dict[str, torch.Tensor] = {}
    value = {"cfg": OmegaConf.create({"lr": 0.1, "layers": [1, 2]}), "t": (1, float("inf")), 3: torch.ones(2),
             "__x": None, "dtype": torch.bfloat16}
    back = from_plain(json_round_trip(to_plain(value, tensors)), tensors)
    assert back["cfg"] == {"lr": 0.1, "layers": [1, 2]} and type(back["cfg"]) is dict
    assert back["t"] == (1, float("inf")) and torch.equal(back[3], torch.ones(2)) and back["__x"] is None
    assert back["dtype"] is torch.bfloat16
    with pytest.raises(CheckpointError, match=r"checkpoint\['hyper_parameters'\]\['fn'\] holds a builtins.function"):
        to_plain({"hyper_parameters": {"fn": lambda: 0}}, {})


def json_round_trip(value: Any) -> Any:
    import json

    return json.loads(json.dumps(value))


def test_stage_0_keeps_the_single_file_by_default(tmp_path) -> None:
    trainer = _fit(TinyTransformer("sgd"), ZeroStrategy(stage=0), devices=1, max_steps=1)
    trainer.save_checkpoint(tmp_path / "a.ckpt")
    assert (tmp_path / "a.ckpt").is_file()


def test_a_deepspeed_checkpoint_is_not_read_yet(tmp_path) -> None:
    from lightning_zero.checkpoint import convert_checkpoint

    (tmp_path / "latest").write_text("global_step10")
    with pytest.raises(NotImplementedError, match="DeepSpeed ZeRO checkpoint"):
        convert_checkpoint(tmp_path, tmp_path / "out.pt")


# ---------------------------------------------------------------------------------------------- streamed files
def test_streamed_files_are_safetensors_and_read_errors_say_what_failed(tmp_path) -> None:
    """Files are written without a copy (pieces end to end) and open with the safetensors library;
    a read that fails for I/O or memory is reported as such, not as an invalid file."""
    from safetensors.torch import load_file

    from lightning_zero.checkpoint.tensor_file import TensorFile, save_tensors

    pieces = [torch.arange(5, dtype=torch.bfloat16), torch.ones(3, dtype=torch.bfloat16)]
    tensors = {"w": torch.randn(4, 6).t(), "p": pieces, "flag": torch.tensor(True), "empty": torch.empty(0, 3)}
    save_tensors(tmp_path / "a.safetensors", tensors, {"k": "v"})
    loaded = load_file(tmp_path / "a.safetensors")
    assert torch.equal(loaded["w"], tensors["w"]) and torch.equal(loaded["p"], torch.cat(pieces))
    assert loaded["flag"].item() is True and loaded["empty"].shape == (0, 3)
    f = TensorFile(tmp_path / "a.safetensors")
    out = torch.zeros(5, dtype=torch.float64)
    assert torch.equal(f.read("w", 7, 12, out), tensors["w"].reshape(-1)[7:12].double())  # cast into `out`
    assert f.metadata() == {"k": "v"}
    data = (tmp_path / "a.safetensors").read_bytes()
    (tmp_path / "a.safetensors").write_bytes(data[:-40])  # truncated under an open reader: an I/O failure
    with pytest.raises(CheckpointError, match="I/O or memory error, not a problem of the file") as err:
        f.read("p")
    assert "not a valid safetensors" not in str(err.value)
    (tmp_path / "b.safetensors").write_bytes(b"\x80\x04" + b"x" * 64)
    with pytest.raises(CheckpointError, match=r"not a valid safetensors file \(it looks like a pickle\)"):
        TensorFile(tmp_path / "b.safetensors")


def _run_read_over_the_limit(tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """A 200 MiB tensor read whole by a process whose data segment may grow by 64 MiB."""
    from lightning_zero.checkpoint.tensor_file import save_tensors

    save_tensors(tmp_path / "big.safetensors", {"t": torch.zeros(50 * 2**20)})  # 200 MiB
    script = (
        "import resource, torch\n"
        "from lightning_zero.checkpoint.tensor_file import TensorFile\n"
        "from tests.large_model_phases import status\n"
        f"f = TensorFile({str(tmp_path / 'big.safetensors')!r})\n"
        "resource.setrlimit(resource.RLIMIT_DATA, (status('VmData') + 64 * 2**20, resource.RLIM_INFINITY))\n"
        "part = f.read('t', 0, 4 * 2**20)\n"  # a bounded slice fits
        "f.read('t')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.slow
@pytest.mark.lane(run=_run_read_over_the_limit)  # a process of its own (Note [background lane] in tests/lane.py)
def test_a_read_that_exceeds_the_memory_limit_is_reported_as_a_memory_error(lane_result) -> None:
    proc = lane_result
    assert proc.returncode != 0
    assert "CheckpointError: Reading 209715200 bytes of 't'" in proc.stderr, proc.stderr[-2000:]
    assert "I/O or memory error" in proc.stderr and "not a valid safetensors" not in proc.stderr
