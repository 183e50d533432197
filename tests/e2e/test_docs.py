"""The docs cannot drift from the code.

- Every command in README.md and docs/*.md (``console`` and ``bash`` blocks, and the commands whose output a
  block quotes: ``<!-- output of: ... -->``) that starts with ``lightning-zero`` or ``python`` runs (or is in
  :data:`SKIP` with the reason), with the exit code the docs show, and each output the docs quote holds for
  that run (Note [quoted output] in docs/regenerate.py, which also regenerates them).
- Every ``python`` block runs as written, or is a fragment (``<!-- fragment of: <file> -->`` on the line before
  it) whose code lines stand, in order, in that file: an example a docs command runs, or code the suite runs.
- Every relative link resolves, no file refers to a path outside the repository, and every command is written
  in the README's venv form.

Where the commands run (Note [shared launches] in tests/launches.py): a ``lightning-zero`` command that starts no
training process (estimate, advise, convert, ``--help`` / ``--cfg``, a refusal with exit code 2) and a
one-device run in this process, through ``lightning_zero.cli.main``; a 2-rank ``train`` in this process with its
ranks in the session's pool; a ``python docs/examples/...`` script of 2 ranks on the pool's ranks, one of one
process (:data:`ONE_PROCESS`) in this process; only what needs processes of its own (:data:`PROCESS`) in a
subprocess. A command the docs show as a long run runs shortened (:data:`LONG`) and its quote is checked by form.
Each command runs once per session: a test that runs the same command (``launches.pool_cli(...)``) reads the same
run, and so does a second quote of it. The commands of a ``console`` block after ``<!-- session -->`` run in
order in one directory of their own (the second may resume the first's checkpoint).
"""

from __future__ import annotations

import ast
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from docs.regenerate import Quote, enter, normalize, problems, quotes, runnable_command, session_of, workdir
from tests.in_pool import run_in_process, run_script_in_pool, run_script_in_process
from tests.launches import GPT_TINY, MULTIRUN, Launch, SharedLaunches

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# a long run, shortened here (its quote is checked by form: Note [quoted output]); docs/regenerate.py runs it whole
SHORT = ["trainer.max_steps=2", "trainer.max_time=null", "trainer.val_check_interval=null",
         "trainer.limit_val_batches=1", "data.max_bytes=100000", "data.max_val_samples=8",
         "trainer.enable_model_summary=false"]
LONG: dict[str, str] = {  # the command as the docs show it -> the command run here
    "lightning-zero train": "lightning-zero train " + " ".join(SHORT),  # the default job: 100 steps or 3 minutes
    # 6 steps of gpt_small with every state on disk (~20 s a step on 2 cores)
    "lightning-zero train experiment=gpt_small_disk_offload trainer.max_steps=6 trainer.val_check_interval=3 "
    "logger=none": "lightning-zero train experiment=gpt_small_disk_offload logger=none " + " ".join(SHORT),
    # 4 x 200 steps on 2 ranks
    "python docs/examples/mixed_precision.py all 200": "python docs/examples/mixed_precision.py all 3",
}
# commands that need processes of their own (the rest run in this process or the pool)
PROCESS: dict[str, str] = {
    "lightning-zero train experiment=gpt_tiny":
        "the session's real launch GPT_TINY (shared with tests/e2e/test_cli.py and test_cli_runs.py)",
    "python docs/examples/reliability.py diverge": "the hang watchdog ends the ranks' processes (exit code 76)",
}
# command (as run: comment and `.venv/bin/` removed) -> why it is not run here
SKIP: dict[str, str] = {
    'python3 -m venv .venv && .venv/bin/pip install -q torch==2.13.0 -e ".[dev]" && .venv/bin/lightning-zero train':
        "creates a venv and installs from the network; `lightning-zero train` itself runs from docs/configs.md",
    'python3 -m venv .venv && .venv/bin/pip install -q torch==2.13.0 -e ".[dev]" && .venv/bin/python -m pytest -q':
        "installs from the network and runs this whole suite (it is what CI runs)",
    "lightning-zero train experiment=gpt_text_file data.path=/path/to/corpus.txt":
        "a placeholder path for the reader's own corpus",
}
# benchmark commands take minutes each (their numbers in docs/benchmarks.md are measured runs, listed with the
# commands that printed them)
SKIP_PREFIXES = {
    "lightning-zero hostfile hostfile": "needs a hostfile naming reachable hosts (tests/e2e/test_multinode.py runs the "
                                        "command on a generated one)",
    "python benchmarks/": "a benchmark run (minutes); tests/e2e/test_benchmarks.py runs each benchmark small",
    "python -m torch.distributed.run --nproc_per_node 4 benchmarks/": "a 4-rank benchmark run (minutes); "
                                                                      "tests/e2e/test_pipeline.py covers its code",
    "python -m torch.distributed.run --nproc_per_node 2 benchmarks/": "a benchmark run (minutes)",
}
# the examples of one process (run in this process); every other example trains on 2 ranks (run on the pool's)
ONE_PROCESS = {"docs/examples/sparse_attention.py", "docs/examples/save_tiny_hf_model.py"}


def _skip_reason(command: str) -> str | None:
    return SKIP.get(command) or next((r for p, r in SKIP_PREFIXES.items() if command.startswith(p)), None)


def _runnable(quote: Quote) -> bool:
    return quote.kind == "command" and quote.command.startswith(("lightning-zero", "python"))


def _block_key(doc: Path, line: int, session: str | None) -> str:
    """The test a command (or a python block of a named session) runs in: one per session (``<!-- session -->``:
    its block; ``<!-- session: NAME -->``: every block of the doc with that name), else one per command."""
    return f"{doc.relative_to(ROOT).as_posix()}:{session or line}"


COMMANDS = [q for q in quotes(DOCS) if _runnable(q)]
# a session's commands (and python blocks) run in order in one directory (one test); every other command runs
# alone, in the test session's shared run of it (Note [shared launches] in tests/launches.py)
BLOCKS: dict[str, list[Quote]] = {}
for _quote in COMMANDS:
    _where = _quote.block if _quote.session == "" else _quote.start
    BLOCKS.setdefault(_block_key(_quote.doc, _where, _quote.session), []).append(_quote)


def _starts_no_process(command: str, code: int) -> bool:
    """A ``lightning-zero`` command that starts no training process: ``estimate``, ``advise``, ``convert``,
    ``train --help`` / ``--cfg``, or a ``train`` the docs show refused (exit code 2: stopped before any process
    starts, the CLI's contract)."""
    args = shlex.split(command)
    if args[0] != "lightning-zero" or len(args) < 2:
        return False
    return args[1] in ("estimate", "advise", "convert") or (args[1] == "train" and (code == 2 or bool(
        {"--help", "-h", "--cfg"} & set(args))))


def _run(quote: Quote, cwd: Path | None, launches: SharedLaunches) -> tuple[Launch, bool]:
    """Run one docs command (the module docstring says where), once per session outside a session block (``cwd``
    ``None``); the run, and whether its ranks ran in the pool."""
    command, code = quote.command, quote.exit_code()
    if quote.cd:  # after `$ cd DIR` in its block: in a copy of that directory (docs.regenerate.enter)
        cwd = enter(cwd or workdir(launches.new_dir() / "cwd"), quote.cd)
    args = shlex.split(LONG.get(command, command))
    if args[0] == "lightning-zero":
        if command in PROCESS:
            return launches.cli(*args[1:], cwd=cwd), False
        if _starts_no_process(command, code):
            return launches.once(("in process", *args), lambda where: run_in_process(args[1:], where), cwd), False
        return launches.pool_cli(*args[1:], cwd=cwd), True
    script, argv = ROOT / args[1], args[2:]
    if command in PROCESS:
        return launches.script(*args[1:], cwd=cwd), False
    if args[1] in ONE_PROCESS:
        return launches.once(("in process", *args), lambda where: run_script_in_process(script, argv, where), cwd), \
            False
    return launches.once(("pool", *args), lambda where: run_script_in_pool(launches.pool(), script, argv, where),
                         cwd), True


def _block_param(block: str) -> Any:
    """The block's test parameter; a command of its own process outside a session starts on the background lane
    (Note [shared launches] in tests/launches.py)."""
    real = [shlex.split(LONG.get(q.command, q.command)) for q in BLOCKS[block]
            if q.command in PROCESS and q.session is None and not q.cd]
    return pytest.param(block, marks=[pytest.mark.real_launch(tuple(c)) for c in real])


@pytest.mark.slow
@pytest.mark.parametrize("block", [_block_param(b) for b in BLOCKS])
def test_doc_commands_run_and_print_what_the_docs_quote(block: str, launches: SharedLaunches) -> None:
    """Every docs command runs with the exit code the docs show, and prints what they quote; a named session's
    python blocks run in their place, in the session's directory."""
    commands = [q for q in BLOCKS[block] if not _skip_reason(q.command)]
    if not commands:
        pytest.skip(_skip_reason(BLOCKS[block][0].command))
    cwd = workdir(launches.new_dir() / "session") if commands[0].session is not None else None
    python = [b for b in PYTHON_BLOCKS if b.session and _block_key(ROOT / b.doc, 0, b.session) == block]
    for quote in commands:
        for earlier in [b for b in python if b.line < quote.start]:
            assert cwd is not None
            _run_python_block(earlier, cwd, launches)
            python.remove(earlier)
        done, pooled = _run(quote, cwd, launches)
        base = Path(str(done.cwd).removesuffix(f"/{quote.cd}")) if quote.cd else done.cwd  # before the cd
        output = normalize(done.output, base)
        assert done.returncode == quote.exit_code(), f"{quote.name}: {quote.command}\n" + "\n".join(output[-60:])
        issues = problems(quote.lines(), output, ordered=not pooled, pool=pooled, long=quote.command in LONG)
        assert not issues, (f"{quote.name}: the output of `{quote.command}` drifted from the quote (refresh it: "
                            f".venv/bin/python docs/regenerate.py --only {quote.doc.stem}):\n" + "\n".join(issues)
                            + "\n----- the run printed -----\n" + "\n".join(output[-80:]))
    for later in python:
        assert cwd is not None
        _run_python_block(later, cwd, launches)


def test_every_doc_command_is_collected_and_the_lists_are_current() -> None:
    commands = {q.command for q in COMMANDS}
    assert " ".join(("lightning-zero", *GPT_TINY)) in PROCESS and " ".join(("lightning-zero", *MULTIRUN)) in commands
    assert len(commands) >= 40  # the parser finds the docs' commands
    for listed in (SKIP, LONG, PROCESS):
        assert set(listed) <= commands, set(listed) - commands  # an entry for a command that is gone: delete it


# ------------------------------------------------------------------------------------------------ python blocks
_FRAGMENT = re.compile(r"^<!-- fragment of: (\S+) -->$")


class PythonBlock(NamedTuple):
    doc: str  # relative to the repository
    line: int  # of the opening fence, 1-based
    code: str
    example: str | None  # the example a fragment is completed in
    session: str | None  # the named session it runs in (docs.regenerate.session_of), else it runs alone

    @property
    def name(self) -> str:
        return f"{self.doc}:{self.line}"


def python_blocks() -> list[PythonBlock]:
    """Every ``python`` block of the docs."""
    found = []
    for doc in DOCS:
        text = doc.read_text()
        lines = text.splitlines()
        for m in re.finditer(r"^```python[ \t]*\n(.*?)^```", text, re.S | re.M):
            line = text[:m.start()].count("\n") + 1
            fragment = _FRAGMENT.match(lines[line - 2].strip())
            found.append(PythonBlock(doc.relative_to(ROOT).as_posix(), line, m.group(1), fragment and fragment.group(1),
                                     session_of(lines, line - 1)))
    return found


PYTHON_BLOCKS = python_blocks()


def _code_lines(code: str) -> list[str]:
    """A block's code lines as compared: comments, blank lines and ``...`` (a gap) left out, whitespace stripped."""
    lines = []
    for line in code.splitlines():
        text = re.split(r"\s+#\s|^#", line)[0].strip()
        if text and text != "...":
            lines.append(text)
    return lines


def _line_pattern(line: str) -> re.Pattern[str]:
    """A fragment's code line: ``...`` inside it stands for anything (arguments the fragment leaves out)."""
    return re.compile(".*".join(re.escape(part) for part in line.split("...")) + "$")


@pytest.mark.parametrize(("block", "code", "example"), [(b.name, b.code, b.example) for b in PYTHON_BLOCKS
                                                      if b.example], ids=[b.name for b in PYTHON_BLOCKS if b.example])
def test_a_python_fragment_stands_in_its_example_which_the_docs_run(block: str, code: str, example: str) -> None:
    """Its code lines (comments left out; ``...`` alone is a gap, inside a line any text) are lines of the
    example, in order; an example under docs/examples/ is run by a docs command (any other file it names is code
    of the repository's that the suite runs: the library, a test model)."""
    path = ROOT / example
    assert path.is_file(), f"{block}: the fragment's example {example} does not exist"
    have, at = _code_lines(path.read_text()), 0
    for line in _code_lines(code):
        pattern = _line_pattern(line)
        hit = next((i for i in range(at, len(have)) if pattern.match(have[i])), None)
        assert hit is not None, f"{block}: `{line}` is not in {example} (after the fragment's previous line)"
        at = hit + 1
    if example.startswith("docs/examples/"):
        run = [q for q in COMMANDS if shlex.split(q.command)[1:2] == [example] and not _skip_reason(q.command)]
        assert run, f"{block}: no docs command runs {example} (add one, e.g. `.venv/bin/python {example}`)"


def _run_python_block(block: PythonBlock, cwd: Path, launches: SharedLaunches) -> None:
    """Run ``block`` in ``cwd``: on the pool's ranks when it trains on 2 ranks, else in this process; its stdout
    holds the quote that follows it (``<!-- output of the python block above -->``)."""
    ast.parse(block.code)  # a syntax error names the block first
    script = cwd / "block.py"
    script.write_text(block.code)
    if re.search(r"\bdevices=2\b", block.code) and ".fit(" in block.code:
        done = run_script_in_pool(launches.pool(), script, [], cwd)
    else:
        done = run_script_in_process(script, [], cwd)
    output = normalize(done.output, cwd)
    assert done.returncode == 0, f"{block.name}:\n" + "\n".join(output[-60:])
    quoted = [q for q in quotes([ROOT / block.doc]) if q.kind == "python" and q.command == block.code]
    for quote in quoted:
        issues = problems(quote.lines(), normalize(done.stdout, cwd))
        assert not issues, f"{quote.name}: the block's output drifted from the quote:\n" + "\n".join(issues)


@pytest.mark.slow
@pytest.mark.parametrize("block", [b for b in PYTHON_BLOCKS if not b.example and not b.session],
                         ids=[b.name for b in PYTHON_BLOCKS if not b.example and not b.session])
def test_a_python_block_runs_as_written_and_prints_what_the_docs_quote(block: PythonBlock,
                                                                       launches: SharedLaunches) -> None:
    """A block that trains on 2 ranks runs on the pool's ranks, any other in this process, each in a directory of
    its own (a block of a named session runs in the session's test:
    test_doc_commands_run_and_print_what_the_docs_quote)."""
    _run_python_block(block, workdir(launches.new_dir()), launches)


def test_every_test_a_doc_quotes_checks_that_quote() -> None:
    """``<!-- output of the test: <test file>::<name> -->``: the test exists and checks the quote
    (``docs.regenerate.check_test_quote``), so the quote cannot drift either."""
    for quote in (q for q in quotes(DOCS) if q.kind == "test"):
        path, _, name = quote.command.partition("::")
        source = (ROOT / path).read_text()
        body = source.split(f"def {name}(", 1)
        assert len(body) == 2, f"{quote.name}: no test {quote.command}"
        assert "check_test_quote(" in body[1].split("\ndef ", 1)[0], f"{quote.command} does not check its quote"


# ------------------------------------------------------------------------------------------------ form and links
# One form for the docs' commands: the README's own, `.venv/bin/lightning-zero` and `.venv/bin/python`
# (the README never activates the venv, so a bare `lightning-zero` / `python` is "command not found").
def _blocks(text: str) -> list[tuple[str, list[str]]]:
    return [(m.group(1), m.group(2).splitlines()) for m in
            re.finditer(r"^```(console|bash)[ \t]*\n(.*?)^```", text, re.S | re.M)]


def test_every_doc_command_uses_the_venv_form_of_the_readme() -> None:
    bare = []
    for doc in DOCS:
        name = doc.relative_to(ROOT).as_posix()
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
        # an inline command with arguments (`lightning-zero train x=y`, `python some/script.py`) too, and a quote's
        for match in re.finditer(r"`((?:lightning-zero|python3?) [^`]*[=/][^`]*)`|<!-- output of: "
                                 r"((?:lightning-zero|python3?) .*?) -->", doc.read_text()):
            command = match.group(1) or match.group(2)
            if not command.startswith("python -m lightning_zero.config.run.worker"):  # what the launcher runs
                bare.append(f"{name}: {command}")
    assert not bare, "write .venv/bin/lightning-zero / .venv/bin/python, as the README does:\n" + "\n".join(bare)


def test_every_doc_page_is_linked_from_the_readme() -> None:
    linked = set(_LINK.findall((ROOT / "README.md").read_text()))
    missing = [p.name for p in DOCS[1:] if f"docs/{p.name}" not in linked]
    assert not missing, f"add them to README.md's Documentation list: {missing}"


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


def test_runnable_command_drops_the_venv_prefix_and_the_comment() -> None:
    assert runnable_command(".venv/bin/lightning-zero train x=1   # two ranks") == "lightning-zero train x=1"
