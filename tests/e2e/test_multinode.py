"""Several nodes through the CLI (Note [multi-node] in lightning_zero/config/multinode.py): two
``lightning-zero train`` invocations as nodes 0 and 1 (one process each, rendezvous on 127.0.0.1) give
bitwise the losses of one node with two processes, and two runs of the same seed and config give
bitwise identical losses (determinism). Also: node rank / endpoint resolution and the hostfile."""

from __future__ import annotations

import csv
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_zero.cli import main
from lightning_zero.config.multinode import host_commands, parse_hostfile, resolve_node
from tests.in_pool import run_in_process

SHORT = ["experiment=mlp", "trainer.max_epochs=null", "trainer.max_steps=4", "logger=csv",
         "trainer.log_every_n_steps=1", "trainer.checkpoint.enabled=false", "trainer.validate_at_start=false",
         "trainer.validate_at_end=false", "trainer.enable_model_summary=false", "data.num_train=256",
         "data.num_val=64", "trainer.limit_val_batches=0"]


def _start(args: list[str], cwd: Path) -> subprocess.Popen:
    cwd.mkdir(parents=True)
    env = {**os.environ, "HYDRA_FULL_ERROR": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "lightning_zero", "train", *SHORT, *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _losses(cwd: Path) -> list[float]:
    (metrics,) = cwd.glob("outputs/*/*/csv/metrics.csv")
    with open(metrics) as f:
        return [float(row["train/loss"]) for row in csv.DictReader(f) if row.get("train/loss")]


@pytest.mark.slow
def test_two_nodes_of_one_process_match_one_node_of_two_and_runs_are_deterministic(tmp_path: Path,
                                                                                   gloo_pool) -> None:
    """Nodes 0 and 1 are two real ``lightning-zero train`` processes (each its torchrun and its one rank, meeting at
    the rendezvous endpoint); the one node of two ranks runs twice, its ranks in the session's pool (Note [shared
    launches] in tests/launches.py): every loss bitwise equal, across fresh processes and the pool's."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    nodes = ["trainer.num_nodes=2", "trainer.devices=1", f"trainer.rdzv_endpoint=127.0.0.1:{port}"]
    runs = {
        "node0": _start([*nodes, "trainer.node_rank=0"], tmp_path / "node0"),
        "node1": _start([*nodes, "trainer.node_rank=1"], tmp_path / "node1"),
    }
    pooled = {name: run_in_process(["train", *SHORT], tmp_path / name, gloo_pool) for name in ("one", "again")}
    outputs = {name: p.communicate(timeout=400)[0] for name, p in runs.items()}
    for name, p in runs.items():
        assert p.returncode == 0, f"{name}:\n{outputs[name][-4000:]}"
    for name, done in pooled.items():
        assert done.returncode == 0, f"{name}:\n{done.output[-4000:]}"
    assert "--nnodes=2 --node_rank=1" in outputs["node1"] and "--standalone" in pooled["one"].output
    one = _losses(tmp_path / "one")
    assert len(one) == 4
    assert _losses(tmp_path / "again") == one  # determinism: bitwise
    assert _losses(tmp_path / "node0") == one  # 2 nodes x 1 process == 1 node x 2 processes, bitwise
    assert (tmp_path / "node1").glob("outputs/*/*/result.json")  # node 1's launcher found its result


def test_node_rank_and_endpoint_come_from_the_config_or_the_launcher_environment() -> None:
    assert resolve_node(1, None, None, env={}) is None
    node = resolve_node(2, 1, "10.0.0.1:1234", env={})
    assert node is not None and node.torchrun_args() == ["--nnodes=2", "--node_rank=1", "--master_addr=10.0.0.1",
                                                         "--master_port=1234"]
    slurm = resolve_node(4, None, None, env={"SLURM_NODEID": "3", "MASTER_ADDR": "n001", "MASTER_PORT": "29600"})
    assert slurm == type(node)(4, 3, "n001", 29600)
    with pytest.raises(ValueError, match=r"trainer\.node_rank=0\.\.\.1"):
        resolve_node(2, None, "h:1", env={})
    with pytest.raises(ValueError, match=r"trainer\.rdzv_endpoint=HOST:PORT"):
        resolve_node(2, 0, None, env={})
    with pytest.raises(ValueError, match=r"must be in 0\.\.1"):
        resolve_node(2, 2, "h:1", env={})


def test_an_incomplete_multi_node_config_stops_before_anything_starts(tmp_path: Path, capsys, monkeypatch) -> None:
    for key in ("NODE_RANK", "GROUP_RANK", "SLURM_NODEID", "MASTER_ADDR"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.chdir(tmp_path)
    assert main(["train", "experiment=mlp", "trainer.num_nodes=2"]) == 2
    assert "trainer.node_rank" in capsys.readouterr().err
    assert not (tmp_path / "outputs").exists()


def test_a_hostfile_becomes_one_command_per_host(tmp_path: Path, capsys) -> None:
    hosts = parse_hostfile("# cluster\nworker-1 slots=4\n\nworker-2 slots=4  # second\n")
    commands = host_commands(hosts, ["experiment=gpt_small"], port=29600)
    assert [h for h, _ in commands] == ["worker-1", "worker-2"]
    assert commands[1][1] == ("lightning-zero train experiment=gpt_small trainer.num_nodes=2 trainer.node_rank=1 "
                              "trainer.devices=4 trainer.rdzv_endpoint=worker-1:29600")
    for bad, message in (("a slots=x", "line 1"), ("a slots=2\na slots=2", "listed twice"),
                         ("a slots=2\nb slots=4", "same slots"), ("", "no host")):
        with pytest.raises(ValueError, match=message):
            parse_hostfile(bad)
    path = tmp_path / "hostfile"
    path.write_text("a slots=1\nb slots=1\n")
    assert main(["hostfile", str(path), "zero=stage1"]) == 0
    out = capsys.readouterr().out
    assert "# on b\nlightning-zero train zero=stage1 trainer.num_nodes=2 trainer.node_rank=1" in out
    path.write_text("a slots=1\nb slots=2\n")
    assert main(["hostfile", str(path)]) == 2 and "same slots" in capsys.readouterr().err
