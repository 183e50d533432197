"""Stage 3 for models larger than one rank: sharded construction, streaming weights in.

Memory is measured as the process's peak resident set (``VmHWM``, reset through
``/proc/self/clear_refs``): a true peak over the whole setup, not a snapshot.
"""

from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_zero import ZeroStrategy
from tests.large_model_phases import reset_peak, return_freed_memory_to_the_os, status
from tests.models import assert_released, make_trainer, token_loader, units_released

DIM, BLOCKS, VOCAB = 2048, 16, 17  # 16 blocks of 4.2M parameters: 268 MB in fp32 whole
WHOLE_BYTES = BLOCKS * (DIM * DIM + DIM) * 4


class WideStack(pl.LightningModule):
    """Built in configure_model (meta under stage 3): an embedding, 16 wide linear blocks, a head."""

    def __init__(self, dim: int = DIM, blocks: int = BLOCKS) -> None:
        super().__init__()
        self.dim, self.num_blocks = dim, blocks
        self.net: nn.Module | None = None
        self.probe: dict[str, Any] = {}

    def configure_model(self) -> None:
        if self.net is not None:
            return
        self.net = nn.ModuleDict({
            "emb": nn.Embedding(VOCAB, self.dim),
            "blocks": nn.ModuleList(nn.Linear(self.dim, self.dim) for _ in range(self.num_blocks)),
            "head": nn.Linear(self.dim, VOCAB),
        })

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.net["emb"](x)
        for block in self.net["blocks"]:
            h = torch.tanh(block(h))
        return self.net["head"](h)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return nn.functional.cross_entropy(self(x[:, :-1]).reshape(-1, VOCAB), x[:, 1:].reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class _PeakAtTrainStart(pl.Callback):
    def __init__(self, start_rss: int) -> None:
        self.start_rss = start_rss

        self.peak_increase = -1

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.peak_increase = status("VmHWM") - self.start_rss
        trainer.should_stop = True  # setup is what is measured: no step


def sharded_construction_body(limit_bytes: int | None) -> dict[str, Any]:
    import gc

    return_freed_memory_to_the_os()
    gc.collect()
    reset_peak()  # VmHWM := VmRSS
    start = status("VmRSS")
    probe = _PeakAtTrainStart(start)
    # RLIMIT_DATA bounds the process's private writable memory (heap and anonymous mmaps, where
    # tensors live); RLIMIT_AS would also count thread stacks and allocator reservations
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    out: dict[str, Any] = {}
    try:
        if limit_bytes is not None:
            resource.setrlimit(resource.RLIMIT_DATA, (status("VmData") + limit_bytes, hard))
            try:  # the limit really is below one whole copy of the model
                torch.empty(WHOLE_BYTES // 4)
                out["whole_fits"] = True
            except (RuntimeError, MemoryError):
                out["whole_fits"] = False
        model = WideStack()
        strategy = ZeroStrategy(stage=3, param_persistence_threshold=0, prefetch_bucket_size=1,
                                gather_on_teardown=False)
        make_trainer(strategy, max_steps=1, callbacks=[probe]).fit(model, token_loader(n=8, batch_size=2))
        out["peak_increase"] = probe.peak_increase
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
    return out


@pytest.mark.distributed
@pytest.mark.slow
def test_sharded_construction_never_holds_the_whole_model(gloo_pool) -> None:
    unit = (DIM * DIM + DIM) * 4
    for r in gloo_pool.run("tests.e2e.test_large_models:sharded_construction_body", limit_bytes=None):
        # this rank's shards (half the model) plus the unit being materialised, plus slack for
        # Lightning's own allocations during setup; the whole model would be 268 MB
        assert r["peak_increase"] <= WHOLE_BYTES / 2 + 2 * unit + 40e6, r
        assert r["peak_increase"] < 0.85 * WHOLE_BYTES, r


@pytest.mark.distributed
@pytest.mark.slow
def test_sharded_construction_fits_under_a_memory_limit_the_whole_model_exceeds(gloo_pool) -> None:
    for r in gloo_pool.run("tests.e2e.test_large_models:sharded_construction_body",
                           limit_bytes=int(0.85 * WHOLE_BYTES)):
        assert r["whole_fits"] is False and r["peak_increase"] > 0


# ---------------------------------------------------------------------------- weights in, init
SMALL = dict(dim=24, blocks=3)


class _OutputsAtStart(pl.Callback):
    """Loads ``source`` at fit start (when given) and records the model's outputs before any step."""

    def __init__(self, source: str | None) -> None:
        self.source = source
        self.outputs: torch.Tensor | None = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.source is not None:
            trainer.strategy.load_full_state_dict(self.source)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        x = torch.arange(16).reshape(2, 8) % VOCAB
        with torch.no_grad():
            self.outputs = pl_module(x).clone()
        trainer.strategy.engine.end_forward_only()  # stage 3: free what the forward gathered
        trainer.should_stop = True


def _reference() -> tuple[WideStack, torch.Tensor]:
    torch.manual_seed(123)
    ref = WideStack(**SMALL)
    ref.configure_model()  # real tensors: the unsharded model
    with torch.no_grad():
        out = ref(torch.arange(16).reshape(2, 8) % VOCAB)
    return ref, out


def loading_body(fmt: str) -> dict[str, Any]:
    from safetensors.torch import save_file

    ref, expected = _reference()
    path = os.path.abspath(f"weights.{fmt}")
    if fmt == "safetensors":
        save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, path)
    else:
        torch.save(ref.state_dict(), path)
    probe = _OutputsAtStart(path)
    strategy = ZeroStrategy(stage=3, param_persistence_threshold=0, prefetch_bucket_size=1)
    model = WideStack(**SMALL)
    make_trainer(strategy, max_steps=1, callbacks=[probe]).fit(model, token_loader(n=8, batch_size=2))
    return {"equal": torch.equal(probe.outputs, expected), "max_diff": (probe.outputs - expected).abs().max().item(),
            "released": units_released(strategy, model)}


@pytest.mark.distributed
@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
def test_a_full_state_dict_streams_into_stage3_and_matches_the_unsharded_model(gloo_pool, fmt: str) -> None:
    for r in gloo_pool.run("tests.e2e.test_large_models:loading_body", fmt=fmt):
        assert r["equal"], r
        assert_released(r["released"])  # the forward gathered one unit at a time


def init_body(devices: int = 2) -> list[torch.Tensor]:
    torch.manual_seed(7)
    model = WideStack(**SMALL)
    make_trainer(ZeroStrategy(stage=3, param_persistence_threshold=0), devices=devices, max_steps=1,
                 callbacks=[_OutputsAtStart(None)]).fit(model, token_loader(n=8, batch_size=2))
    return [p.detach().clone() for p in model.parameters()]  # gathered back whole at teardown


@pytest.mark.distributed
def test_sharded_initialisation_does_not_depend_on_the_world_size(gloo_pool) -> None:
    two_ranks = gloo_pool.run("tests.e2e.test_large_models:init_body")
    assert all(torch.equal(a, b) for a, b in zip(two_ranks[0], two_ranks[1]))
    one_rank = init_body(devices=1)  # this process, no process group
    assert len(one_rank) == len(two_ranks[0]) == 1 + 2 * SMALL["blocks"] + 2  # emb, blocks, head
    assert all(torch.equal(a, b) for a, b in zip(one_rank, two_ranks[0]))
    assert all(torch.isfinite(p).all() and p.std() > 0 for p in one_rank if p.dim() == 2)


# ---------------------------------------------------------------------------- default threshold
class MixedBlock(nn.Module):
    """A block whose big weights are sharded and whose small tensors (biases, LayerNorm) are
    persistent at the default threshold: one module's parameters in two units."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.out(torch.relu(self.fc(self.norm(h))))


class MixedLM(pl.LightningModule):
    """Embeddings, blocks, a final norm and a head, built in configure_model so that stage 3
    constructs it unit by unit (Note [split owners] in core/stage3/materialize.py)."""

    def __init__(self, dim: int = 160, blocks: int = 2, vocab: int = 700) -> None:
        super().__init__()
        self.dim, self.blocks, self.vocab = dim, blocks, vocab
        self.net: nn.Module | None = None

    def configure_model(self) -> None:
        if self.net is None:
            self.net = nn.ModuleDict({
                "emb": nn.Embedding(self.vocab, self.dim),  # 112k elements: a root unit member
                "pos": nn.Embedding(8, self.dim),  # 1.3k: persistent
                "blocks": nn.ModuleList(MixedBlock(self.dim) for _ in range(self.blocks)),
                "norm": nn.LayerNorm(self.dim),
                "head": nn.Linear(self.dim, self.vocab),
            })

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.net["emb"](x) + self.net["pos"](torch.arange(x.shape[1]))
        for block in self.net["blocks"]:
            h = block(h)
        return self.net["head"](self.net["norm"](h))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return nn.functional.cross_entropy(self(x[:, :-1]).reshape(-1, self.vocab), x[:, 1:].reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def default_threshold_body(threshold: int | None) -> dict[str, Any]:
    torch.manual_seed(3)
    model = MixedLM()
    kwargs = {} if threshold is None else {"param_persistence_threshold": threshold}
    strategy = ZeroStrategy(stage=3, **kwargs)
    probe = _OutputsAtStart(None)
    make_trainer(strategy, max_steps=1, callbacks=[probe]).fit(model, token_loader(n=8, batch_size=2))
    runtime = strategy._run.last_runtime
    return {"outputs": probe.outputs, "units": [(u.name, u.numel, u.releases) for u in runtime.units],
            "peak_live": runtime.peak_live_numel, "total": sum(p.numel() for p in model.parameters()),
            "params": {k: v.detach().clone() for k, v in model.state_dict().items()}}


@pytest.mark.distributed
def test_sharded_construction_at_the_default_threshold_mixes_persistent_and_sharded_tensors(gloo_pool) -> None:
    """Biases, LayerNorms and a small embedding are persistent at the default threshold while
    their modules' weights are sharded: construction must not write into storage-less tensors
    (it crashed the interpreter) and must give the values a threshold of 0 gives."""
    default = gloo_pool.run("tests.e2e.test_large_models:default_threshold_body", threshold=None)
    sharded = gloo_pool.run("tests.e2e.test_large_models:default_threshold_body", threshold=0)
    names = [name for name, _, _ in default[0]["units"]]
    assert "<persistent>" in names and len(names) >= 3, names  # really split: blocks, root, persistent
    for r in default:
        released = [releases for name, _, releases in r["units"] if name != "<persistent>"]
        assert min(released) > 0, r["units"]  # the blocks and the root were released
        assert r["peak_live"] < 0.75 * r["total"], r  # never the whole model gathered at once
    for a, b in zip(default, sharded):
        assert torch.equal(a["outputs"], b["outputs"])
        assert torch.isfinite(a["outputs"]).all()
    params = default[0]["params"]
    assert torch.equal(params["net.blocks.0.norm.weight"], torch.ones(160))  # LayerNorm reset
    assert params["net.blocks.0.fc.bias"].abs().max() > 0  # Linear bias initialised, not left empty


# ---------------------------------------------------------------------------- teardown
class _FailAt(pl.Callback):
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int) -> None:
        if trainer.global_step == 2:
            raise RuntimeError("boom at step 2")


def teardown_body(room: int | None, fail: bool = False) -> dict[str, Any]:
    """A stage-3 fit (sharded for real) whose teardown sees ``room`` bytes available (None: the
    real figure); returns what the module holds afterwards and the warnings."""
    import warnings

    import torch.distributed as dist

    from lightning_zero.core.stage3 import memory_room

    real = memory_room.memory_pools
    if room is not None:  # one pool per rank, shared with no other
        memory_room.memory_pools = lambda device: [memory_room.MemoryPool(f"test:{dist.get_rank()}", room, "test")]
    torch.manual_seed(0)
    model = MixedLM()
    strategy = ZeroStrategy(stage=3, param_persistence_threshold=0, prefetch_bucket_size=1)
    error = None
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            make_trainer(strategy, max_steps=3, callbacks=[_FailAt()] if fail else []).fit(
                model, token_loader(n=16, batch_size=2))
    except RuntimeError as exc:
        error = str(exc)
    finally:
        memory_room.memory_pools = real
    weights = [p.detach() for p in model.parameters()]
    opt = model.trainer.optimizers[0] if model.trainer.optimizers else None
    save_after = None
    if room is not None and not fail:
        try:  # nothing to save once released: refused, never a file of NaNs
            model.trainer.save_checkpoint(os.path.abspath(f"after-{room}.ckpt"))
        except Exception as exc:
            save_after = f"{type(exc).__name__}: {exc}"
    return {
        "error": error,
        "save_after": save_after,
        "warnings": [str(w.message) for w in caught if "ZeroStrategy" in str(w.message)],
        "all_nan": all(torch.isnan(w).all() for w in weights),
        "any_nan": any(torch.isnan(w).any() for w in weights),
        "zeros": sum(int((w == 0).sum()) for w in weights),
        "opt_state": bool(opt and opt.state),
        "peak_live": strategy._run.last_runtime.peak_live_numel,
        "total": sum(w.numel() for w in weights),
    }


@pytest.mark.distributed
def test_teardown_gathers_only_what_fits_and_warns_once(gloo_pool) -> None:
    everything = gloo_pool.run("tests.e2e.test_large_models:teardown_body", room=None)
    for r in everything:
        assert r["peak_live"] < r["total"], r  # units were released during training
        assert not r["any_nan"] and r["opt_state"] and r["warnings"] == [], r
    total = everything[0]["total"]
    # room for the parameters (4 bytes each, plus 5% and 64 MiB) but not for AdamW's 8 more bytes each
    params_only = gloo_pool.run("tests.e2e.test_large_models:teardown_body",
                                room=int(total * 4 * 1.06) + 64 * 2**20 + 1)
    for r in params_only:
        assert not r["any_nan"] and not r["opt_state"] and r["save_after"] is None, r
    assert len(params_only[0]["warnings"]) == 1 and params_only[1]["warnings"] == []
    assert "only the parameters were gathered" in params_only[0]["warnings"][0]
    assert "gather_on_teardown=False" in params_only[0]["warnings"][0]
    nothing = gloo_pool.run("tests.e2e.test_large_models:teardown_body", room=1)
    for r in nothing:
        assert r["error"] is None and r["all_nan"] and not r["opt_state"], r  # released, fit did not fail
        assert "were left released at the end of fit" in r["save_after"], r
    assert len(nothing[0]["warnings"]) == 1 and "left released" in nothing[0]["warnings"][0]


@pytest.mark.distributed
def test_a_failed_stage3_fit_leaves_parameters_released_never_partly_zero(gloo_pool) -> None:
    for r in gloo_pool.run("tests.e2e.test_large_models:teardown_body", room=None, fail=True):
        assert r["error"] and "boom at step 2" in r["error"], r
        assert r["all_nan"] and r["zeros"] == 0, r  # before: this rank's shard and zeros elsewhere
    r = gloo_pool.run("tests.e2e.test_large_models:teardown_body", room=None, fail=True)[0]
    assert len(r["warnings"]) == 1 and "fit failed" in r["warnings"][0] and "released" in r["warnings"][0]


REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _new_memory_cgroup(name: str) -> tuple[Path, int] | str:
    """A fresh memory cgroup (v1 under /sys/fs/cgroup/memory, else v2 under /sys/fs/cgroup) and its version, or why
    none can be made here."""
    if os.geteuid() != 0:
        return "making a memory cgroup needs root"
    v1, v2 = Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup")
    if (v1 / "memory.limit_in_bytes").exists():
        parent, version = v1, 1
    elif "memory" in ((v2 / "cgroup.subtree_control").read_text().split() if (v2 / "cgroup.subtree_control").exists()
                      else []):
        parent, version = v2, 2
    else:
        return "no memory cgroup hierarchy (v1 /sys/fs/cgroup/memory, or v2 with the memory controller) is mounted"
    try:
        (parent / name).mkdir()
    except OSError as err:
        return f"cannot make a memory cgroup under {parent}: {err}"
    return parent / name, version


def _run_teardown_in_one_cgroup(root: Path) -> dict[str, Any]:
    """Both ranks in one memory cgroup: the cgroup, each rank's exit code and output."""
    made = _new_memory_cgroup(f"lz_teardown_{os.getpid()}")
    if isinstance(made, str):
        pytest.skip(made)
    cgroup, version = made
    port = _free_port()
    procs = []
    try:
        for rank in range(2):
            env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
                   "RANK": str(rank), "LOCAL_RANK": str(rank), "PYTHONPATH": str(REPO), "PL_DISABLE_FORK": "1",
                   "OMP_NUM_THREADS": "1"}
            join = f'echo $$ > "{cgroup}/cgroup.procs" && exec "$0" "$@"'  # in the cgroup before Python starts
            procs.append(subprocess.Popen(
                ["sh", "-c", join, sys.executable, str(REPO / "tests" / "teardown_cgroup_script.py"), str(root),
                 str(cgroup), str(version)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outputs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
        cgroup.rmdir()
    return {"cgroup": cgroup, "codes": [p.returncode for p in procs], "outputs": outputs, "root": root}


@pytest.mark.slow
@pytest.mark.lane(run=_run_teardown_in_one_cgroup)  # processes of their own (Note [background lane], tests/lane.py)
def test_a_teardown_gather_over_the_jobs_memory_cgroup_is_not_started_and_the_run_exits_0(
        lane_result: dict[str, Any]) -> None:
    """Two ranks in one memory cgroup whose limit (set at the end of fit) leaves room for one rank's parameters:
    the end-of-fit gather of both would pass it. It read only MemAvailable and the RLIMITs, gathered, and the
    kernel killed a rank after a finished fit (issue 41, 10). Now every rank reads the cgroup, the ranks sharing it
    sum their needs, and the run ends with exit 0, the parameters left released and the warning naming the
    cgroup."""
    cgroup, codes, outputs = lane_result["cgroup"], lane_result["codes"], lane_result["outputs"]
    root = lane_result["root"]
    assert codes == [0, 0], f"exit codes {codes} (-9: killed by the cgroup's OOM killer)\n" + outputs[0][-3000:]
    results = [json.loads((root / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(r["released"] for r in results), results
    assert len(results[0]["warnings"]) == 1 and results[1]["warnings"] == [], results
    warning = results[0]["warnings"][0]
    assert "the parameters are left released" in warning and f"memory cgroup {cgroup}" in warning, warning
    print(outputs[0].split("LIMIT")[1].splitlines()[0] if "LIMIT" in outputs[0] else "", warning)


# ---------------------------------------------------------------------------- bigger than a rank
def _phase(phase: str, root: str) -> None:
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    script = str(repo / "tests" / "large_model_phases.py")
    launcher = [] if phase == "convert" else ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    env = {**os.environ, "PYTHONPATH": str(repo), "PL_DISABLE_FORK": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, *launcher, script, phase, root], env=env, capture_output=True, text=True,
                          timeout=400)
    assert proc.returncode == 0, f"{phase} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


def _results(root: str, phase: str, ranks: int = 2) -> list[dict[str, Any]]:
    import json

    out = []
    for r in range(ranks):
        with open(os.path.join(root, f"{phase}-rank{r}.json")) as f:
            out.append(json.load(f))
    return out


def _run_phases(root: Path) -> str:
    """Train, resume and convert, each in fresh processes: the directory they wrote to."""
    for phase in ("train", "resume", "convert"):
        _phase(phase, str(root))
    return str(root)


@pytest.mark.slow
@pytest.mark.lane(run=_run_phases)  # processes of their own (Note [background lane] in tests/lane.py)
def test_a_model_whose_ddp_state_exceeds_the_memory_limit_trains_saves_resumes_and_converts(lane_result: str) -> None:
    """Issue 24's end-to-end run (tests/large_model_phases.py): every phase in fresh processes
    under RLIMIT_DATA = 0.9 x DDP's per-rank state, the model built in configure_model at the
    default persistence threshold, gather_on_teardown left at its default."""
    from safetensors import safe_open

    from lightning_zero.checkpoint import ShardedCheckpoint

    root = lane_result
    train, resume, (convert,) = _results(root, "train"), _results(root, "resume"), _results(root, "convert", 1)
    for r in (*train, *resume, convert):
        assert r["ddp_state_fits"] is False and r["limit"] < r["ddp_state"], r
    for t, s in zip(train, resume):
        assert t["persistent"] and t["released"] > 0 and t["peak_live"] < t["psi"] / 2, t  # sharded for real
        assert len(t["losses"]) == 4 and s["losses"] == t["losses"][2:], (t["losses"], s["losses"])  # exact
        assert t["any_nan_after"] and not t["all_nan_after"], t  # too big to gather: released, persistent kept
        train_peak = max(t["peaks"]["setup"], t["peaks"]["train"])
        assert t["peaks"]["save"] <= 1.05 * train_peak, t["peaks"]
        assert s["peaks"]["setup"] <= 1.05 * train_peak, (s["peaks"], t["peaks"])  # construction + reading
        assert max(s["peaks"].values()) <= 1.05 * train_peak, (s["peaks"], t["peaks"])
        assert train_peak - t["start_rss"] < t["limit"], t
    assert convert["code"] == 0 and convert["peaks"]["convert"] - convert["start_rss"] < 64 * 2**20, convert
    ckpt = ShardedCheckpoint(os.path.join(root, "step2.ckpt"))
    with safe_open(os.path.join(root, "model.safetensors"), "pt") as f:
        assert set(f.keys()) == set(ckpt.state_dict())
        for key in ("net.blocks.3.fc1.weight", "net.blocks.0.ln1.bias", "net.head.weight"):
            value = f.get_tensor(key)
            assert torch.equal(value, ckpt.state_dict()[key]) and torch.isfinite(value).all(), key
