"""The docs cannot drift from the code: every command in README.md and docs/*.md fenced as ``console`` or
``bash`` that starts with ``lightning-zero`` or ``python`` is run (or is in :data:`SKIP` with the reason),
with the exit code the docs show (``(exit code N)`` after it in a console block, else 0); every relative
link resolves; and no file refers to a path outside the repository.

Short settings: ``lightning-zero train`` commands get :data:`SHORT` appended (a couple of steps on a slice
of the data) unless ``LIGHTNING_ZERO_DOCS_FULL=1``, which runs every command exactly as written.

A ``lightning-zero`` command that starts no process (:func:`_starts_no_process`: the estimator, the advisor,
``train --help`` / ``--cfg``, a ``train`` refused with exit code 2) runs through ``lightning_zero.cli.main`` in
the test's process: the same parser and checks, without ~6 s of a fresh interpreter importing torch and
Lightning per command. Every other command runs in its own process.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHORT = ["trainer.max_steps=2", "trainer.max_time=null", "trainer.val_check_interval=null",
         "trainer.limit_val_batches=1", "data.max_bytes=100000", "data.max_val_samples=8",
         "trainer.enable_model_summary=false"]

# command (as written, comments and the `.venv/bin/` prefix removed) -> why it is not run here
SKIP: dict[str, str] = {
    'python3 -m venv .venv && .venv/bin/pip install -q torch==2.13.0 -e ".[dev]" && .venv/bin/lightning-zero train':
        "creates a venv and installs from the network; `lightning-zero train` itself runs from docs/configs.md",
    'python3 -m venv .venv && .venv/bin/pip install -q torch==2.13.0 -e ".[dev]" && .venv/bin/python -m pytest -q':
        "installs from the network and runs this whole suite (it is what CI runs)",
    "lightning-zero train experiment=gpt_text_file data.path=/path/to/corpus.txt":
        "a placeholder path for the reader's own corpus",
    "python docs/examples/mixed_precision.py bf16-true 200":
        "200 steps on 2 ranks (minutes on 2 cores); the same script runs here as `mixed_precision.py 16-mixed`",
    "lightning-zero train deepspeed_config=seed_bf16.json trainer.devices=3":
        "a JSON file the reader writes from the page's example; the same conflict is tested in test_deepspeed_cli.py",
    "lightning-zero train experiment=gpt_tiny":
        "the same run (with 3 steps) is tests/e2e/test_cli.py's two-rank run (the suite's time: one 2-rank run each)",
    "lightning-zero train experiment=gpt_tiny zero=stage1 trainer.devices=2 trainer.max_steps=3":
        "the same run is the first job of tests/e2e/test_cli.py's multirun over zero=stage1,stage2 (2 ranks, 3 steps)",
    "lightning-zero train -m experiment=gpt_tiny zero=stage1,stage2":
        "the same multirun (with 3 steps) is tests/e2e/test_cli.py's, through the console script (two 2-rank runs)",
    "lightning-zero train experiment=gpt_tiny model.attention=sparse_fixed":
        "the same run is tests/e2e/test_sparse_gpt.py's CLI test (the suite's time: one 2-rank run each)",
    "lightning-zero train experiment=gpt_tiny sequence_parallel=sp2 trainer.devices=2 data.deterministic_order=true":
        "the same run is tests/e2e/test_sequence_parallel.py's CLI test, against the 1-rank run",
    "lightning-zero train experiment=gpt_tiny tensor_parallel=tp2 trainer.devices=2 zero=stage2 "
    "hydra.run.dir=outputs/tp2":
        "the page's first command (run here) trains TP 2 on 2 ranks and saves its sharded checkpoints the same way; "
        "the suite's time: one 2-rank run each",
    "lightning-zero train experiment=gpt_tiny zero=stage2 trainer.devices=1 trainer.max_steps=30 "
    "trainer.resume_from=outputs/tp2/checkpoints/last.ckpt":
        "resumes the previous command's checkpoint (each doc command runs alone); tests/e2e/test_deepspeed_cli.py runs "
        "the same TP 2 -> 1 rank resume and checks its losses",
    "lightning-zero convert outputs/tp2/checkpoints/last.ckpt model.safetensors":
        "converts the first command's checkpoint (each doc command runs alone); "
        "tests/distributed/test_tensor_parallel_checkpoints.py converts a TP-2 checkpoint and checks the unsplit "
        "weights",
    "lightning-zero train experiment=gpt_tiny model.moe.num_experts=8 expert_parallel=ep2 trainer.devices=2":
        "the same run (6 steps) is tests/e2e/test_expert_parallel_cli.py's, against the 1-rank run and 2-rank data "
        "parallelism without expert parallelism",
    "lightning-zero train experiment=gpt_tiny model.attention=sparse_bigbird":
        "another preset of the same path; tests/e2e/test_sparse_gpt.py's CLI test trains bigbird from a JSON section",
    "lightning-zero train model=hf_causal_lm model.path=outputs/tiny_llama data=text_file  "
    "data.path=outputs/corpus.txt data.seq_len=32 data.micro_batch_size=2 data.max_val_samples=8 zero=stage3  "
    "model.lr=1e-2 trainer.max_steps=10 trainer.val_check_interval=5 hydra.run.dir=outputs/llama_run":
        "trains the model the page's previous command saved (each doc command runs alone); tests/e2e/test_hf_models.py "
        "trains the same tiny Llama (and a GPT-2) at stage 3 on 2 ranks",
    "lightning-zero convert outputs/llama_run/checkpoints/last.ckpt outputs/llama_finetuned --hf --shard-size 40KB":
        "converts the previous command's run; tests/e2e/test_hf_models.py converts its runs the same way and loads "
        "them with from_pretrained",
    "lightning-zero validate model=hf_causal_lm model.path=outputs/tiny_llama data=text_file  "
    "data.path=outputs/corpus.txt data.seq_len=32 data.micro_batch_size=2 data.max_val_samples=8 zero=stage3  "
    "ckpt_path=outputs/llama_run hydra.run.dir=outputs/llama_validate":
        "validates the run of the page's train command; tests/e2e/test_hf_models.py validates its run's directory",
}
# benchmark commands take minutes each (their numbers in docs/benchmarks.md are measured runs)
SKIP_PREFIXES = {
    "lightning-zero hostfile hostfile": "needs a hostfile naming reachable hosts (tests/e2e/test_multinode.py runs the "
                                        "command on a generated one)",
    "python benchmarks/": "a benchmark run (minutes); tests/e2e/test_benchmarks.py runs each benchmark small",
    "python -m torch.distributed.run --nproc_per_node 4 benchmarks/": "a 4-rank benchmark run (minutes); "
                                                                      "tests/e2e/test_pipeline.py covers its code",
    "python -m torch.distributed.run --nproc_per_node 2 benchmarks/": "a benchmark run (minutes)",
}


def _blocks(text: str) -> list[tuple[str, list[str]]]:
    return [(m.group(1), m.group(2).splitlines()) for m in
            re.finditer(r"^```(console|bash)[ \t]*\n(.*?)^```", text, re.S | re.M)]


def _strip_comment(line: str) -> str:
    """The command without a trailing ``  # comment`` (two spaces or more before the ``#``)."""
    return re.split(r"\s{2,}#", line)[0].strip()


def doc_commands() -> list[tuple[str, str, int]]:
    """``(doc file, command, expected exit code)`` of every runnable command in the docs."""
    found = []
    for doc in DOCS:
        for kind, lines in _blocks(doc.read_text()):
            i = 0
            while i < len(lines):
                line = lines[i]
                if kind == "console" and not line.startswith("$ "):
                    i += 1
                    continue
                command = line[2:] if kind == "console" else line
                while command.endswith("\\") and i + 1 < len(lines):
                    i += 1
                    command = command[:-1] + " " + lines[i].strip()
                i += 1
                code = 0
                if kind == "console":
                    output = []
                    while i < len(lines) and not lines[i].startswith("$ "):
                        output.append(lines[i])
                        i += 1
                    match = re.search(r"\(exit code (\d+)\)", "\n".join(output))
                    code = int(match.group(1)) if match else 0
                command = _strip_comment(command)
                if command.startswith(".venv/bin/"):
                    command = command[len(".venv/bin/"):]
                if command.startswith(("lightning-zero", "python")):
                    found.append((doc.relative_to(ROOT).as_posix(), command, code))
    return found


def _runnable(command: str) -> list[str]:
    args = shlex.split(command)
    if args[0] == "lightning-zero":
        args = [sys.executable, "-m", "lightning_zero", *args[1:]]
        if args[3:4] == ["train"] and os.environ.get("LIGHTNING_ZERO_DOCS_FULL") != "1" and \
                not {"--help", "--cfg", "-h"} & set(args):
            args += SHORT
    elif args[0] in ("python", "python3"):
        args[0] = sys.executable
    return args


def _starts_no_process(command: str, code: int) -> bool:
    """Whether ``command`` is a ``lightning-zero`` command that starts no training process: ``estimate``,
    ``advise``, ``train --help`` / ``--cfg``, or a ``train`` the docs show refused (exit code 2: stopped
    before any process starts, the CLI's contract)."""
    args = shlex.split(command)
    if args[0] != "lightning-zero" or len(args) < 2:
        return False
    return args[1] in ("estimate", "advise") or (args[1] == "train" and (code == 2 or bool(
        {"--help", "-h", "--cfg"} & set(args))))


COMMANDS = doc_commands()
# what a launcher sets for the ranks it starts (Lightning writes some into os.environ even for one rank)
LAUNCHER_VARIABLES = {"MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "RANK", "WORLD_SIZE", "GROUP_RANK",
                      "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"}


# One form for the docs' commands: the README's own, `.venv/bin/lightning-zero` and `.venv/bin/python`
# (the README never activates the venv, so a bare `lightning-zero` / `python` is "command not found").
# Pages another branch is editing today, converted when it merges (remove them from here then).
CONVENTION_PENDING: set[str] = set()


def test_every_doc_command_uses_the_venv_form_of_the_readme() -> None:
    bare = []
    for doc in DOCS:
        name = doc.relative_to(ROOT).as_posix()
        if doc.name in CONVENTION_PENDING:
            continue
        for kind, lines in _blocks(doc.read_text()):
            for line in lines:
                command = line[2:] if kind == "console" and line.startswith("$ ") else line if kind == "bash" else ""
                if re.match(r"(lightning-zero|python3?)\b", command) and not command.startswith("python3 -m venv"):
                    bare.append(f"{name}: {command}")
        # a command in any other fence (``text``, plain): shown to be copied too
        for lang, body in re.findall(r"^```(\w*)[ \t]*\n(.*?)^```", doc.read_text(), re.S | re.M):
            if lang in ("console", "bash", "python"):
                continue
            for line in body.splitlines():
                # at the line's start, after a `$ ` prompt, or in a second column; not a program's `name: error`
                for match in re.finditer(r"(?:^\$ |^|\s{3,})((?:lightning-zero|python3?) (?![\w-]+:).*)", line):
                    bare.append(f"{name}: {match.group(1).strip()}")
        # an inline command with arguments (`lightning-zero train x=y`, `python some/script.py`) too
        for match in re.finditer(r"`((?:lightning-zero|python3?) [^`]*[=/][^`]*)`", doc.read_text()):
            if not match.group(1).startswith("python -m lightning_zero.config.run.worker"):  # what the launcher runs
                bare.append(f"{name}: {match.group(1)}")
    assert not bare, "write .venv/bin/lightning-zero / .venv/bin/python, as the README does:\n" + "\n".join(bare)


def test_every_doc_page_is_linked_from_the_readme() -> None:
    linked = set(_LINK.findall((ROOT / "README.md").read_text()))
    missing = [p.name for p in DOCS[1:] if f"docs/{p.name}" not in linked]
    assert not missing, f"add them to README.md's Documentation list: {missing}"


def test_the_readme_python_snippet_runs_and_measures_the_model_states(tmp_path: Path, monkeypatch,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Its `print(trainer.strategy.model_state_bytes())` once ran after fit, where it raises."""
    from tests.models import TinyTransformer, token_loader

    readme = (ROOT / "README.md").read_text()
    snippet = re.search(r"## Use it\n+```python\n(.*?)^```", readme, re.S | re.M).group(1)
    assert "devices=2" in snippet
    monkeypatch.chdir(tmp_path)  # Lightning's default logger writes lightning_logs/ here
    monkeypatch.setenv("PL_DISABLE_FORK", "1")
    # one process (devices=2 would make Lightning re-run pytest's command line for rank 1), two steps
    one_process = snippet.replace("devices=2", "devices=1, max_steps=2, enable_progress_bar=False")
    exec(one_process, {"model": TinyTransformer(), "datamodule": token_loader(n=16)})
    printed = capsys.readouterr().out
    assert re.search(r"ModelStateBytes\(params=[1-9][\d.]*, grads=[\d.]+, optimizer=[1-9][\d.]*", printed), printed


def test_every_doc_command_is_collected_and_the_skip_list_is_current() -> None:
    commands = {c for _, c, _ in COMMANDS}
    assert len(commands) >= 15  # the parser finds the docs' commands
    assert set(SKIP) <= commands, set(SKIP) - commands  # a skip entry for a command that is gone: delete it


@pytest.mark.slow
@pytest.mark.parametrize(("doc", "command", "code"), COMMANDS, ids=[f"{d}:{c[:60]}" for d, c, _ in COMMANDS])
def test_doc_command_runs(doc: str, command: str, code: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                          capsys: pytest.CaptureFixture[str]) -> None:
    reason = SKIP.get(command) or next((r for p, r in SKIP_PREFIXES.items() if command.startswith(p)), None)
    if reason:
        pytest.skip(reason)
    for entry in ROOT.iterdir():  # the repository's files, but outputs/ and multirun/ land in tmp_path
        if not entry.name.startswith(".") and entry.name not in ("outputs", "multirun"):
            (tmp_path / entry.name).symlink_to(entry)
    if _starts_no_process(command, code):  # in this process (the module docstring says why)
        from lightning_zero.cli import main

        monkeypatch.chdir(tmp_path)
        got = main(_runnable(command)[3:])  # after `python -m lightning_zero`
        out = capsys.readouterr()
        assert got == code, f"{doc}: {command}\n{(out.out + out.err)[-3000:]}"
        return
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}  # the command launches its own ranks
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run(_runnable(command), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == code, f"{doc}: {command}\n{(done.stdout + done.stderr)[-3000:]}"


_LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_every_relative_link_in_the_docs_resolves() -> None:
    broken = []
    for doc in DOCS:
        for target in _LINK.findall(doc.read_text()):
            if re.match(r"[a-z]+:|#", target):
                continue
            if not (doc.parent / target.split("#")[0]).exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
    assert not broken, broken


def test_every_file_reference_resolves_inside_the_repository() -> None:
    outside, missing = [], []
    refs = re.compile(r"(?<![\w./-])((?:docs|benchmarks|tests|conf|lightning_zero|experiments)/"
                      r"[\w./-]+\.(?:md|py|yaml))")
    elsewhere = re.compile("|".join([r"\.\./shared/\S*", "/" + r"work/\S+"]))  # split: this line is not a hit
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=False)  # the repository's files, not run outputs
    names = listed.stdout.splitlines() if listed.returncode == 0 else \
        [str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if not p.relative_to(ROOT).parts[0].startswith(".")]
    files = [ROOT / n for n in names if Path(n).suffix in (".py", ".md", ".yaml", ".toml", ".json")
             and (ROOT / n).is_file()]
    for path in files:
        text = path.read_text(errors="replace")
        rel = path.relative_to(ROOT)
        outside += [f"{rel}: {m}" for m in elsewhere.findall(text)]
        for ref in refs.findall(text):
            if not (ROOT / ref).exists():
                missing.append(f"{rel}: {ref}")
    assert not outside, outside
    assert not missing, missing
