"""Every output the docs quote, regenerated from the command that prints it; and the check that none drifted.

    .venv/bin/python docs/regenerate.py                     # rerun every quoting command as written, rewrite quotes
    .venv/bin/python docs/regenerate.py --check             # the same runs; write nothing, exit 1 naming each drift
    .venv/bin/python docs/regenerate.py --only reliability  # the docs whose path contains one of these words

The docs test (``tests/e2e/test_docs.py``) runs every documented command once per suite (most in the session's
warm pool: Note [shared launches] in ``tests/launches.py``) and checks each quote against that run with
:func:`problems`: a quote cannot drift from its command without the suite failing. This script is how a quote is
refreshed after a change that moves it (it reruns the commands as written, real processes, so it takes minutes:
the README's quote is a 3-minute run).

Note [quoted output]
    A quote is the output of one command, written in a doc as:

    - a ``console`` block: the lines after each ``$ command`` up to the next ``$`` line; a line
      ``(exit code N)`` is the exit code the command must end with (0 without it) (a ``bash`` block's commands
      quote nothing: :func:`quotes` lists them with an empty quote, so that it lists every documented command);
    - a fenced block right after a line ``<!-- output of: COMMAND -->``;
    - a fenced block right after ``<!-- output of the python block above -->``: that block's stdout;
    - a fenced block right after ``<!-- output of the test: <test file>::<test name> -->``: what that test's scenario
      prints (a rank killed, a rank stopped); the test checks the quote itself (:func:`check_test_quote`) and
      this script reruns the test to refresh it.

    The quote's lines must be lines of the output, in order (a run in the pool prints each rank's lines in turn:
    in any order). A quote may leave lines out: ``...`` or ``[... anything ...]`` alone on a line marks a gap;
    ``... `` at the start or `` ...`` at the end of a line leaves out the line's start or end, `` ... `` in it a
    part of it (a quoted line starting with ``... `` may go on the line the previous one matched); ``.../``
    before a path leaves out its leading directories. Blank lines in
    a quote are layout; a line's indentation is compared. Parts that change from run to run (:data:`VOLATILE`:
    timestamps, durations, throughput, the dated run directory) match any value; everything else, losses
    included, must be equal. Paths are compared relative to the command's working directory and the repository.

    A run in the test pool has no launcher of its own: the lines only a real launch prints
    (:data:`LAUNCH_ONLY`: Lightning's "Initializing distributed" banner) are not looked for there.
    A long run (the README's default job: 100 steps or 3 minutes; the docs test's ``LONG``) runs shortened in
    the suite: there each quoted line must match a line of the short run's output in form (every number stands
    for any number), and the lines only a long run prints (:data:`LONG_RUN_ONLY`: progress lines, validations,
    the time limit) are not looked for. Its numbers are this script's to refresh.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# parts of a line that change from run to run; each regex matches the quote's value and the run's
VOLATILE = [re.compile(p) for p in (
    r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}",  # logging's timestamp
    r"(?:outputs|multirun)/\d{4}-\d\d-\d\d/\d\d-\d\d-\d\d",  # Hydra's dated run directory
    r"fit_time=\d+(?:\.\d+)?s",
    r"tokens/s [\d,]+",
    r"(?:elapsed|ETA|Elapsed time is) \d+:\d\d:\d\d",
    r"measured \d+\.\d s",  # the hang watchdog's measured stall
    r"silent \d+ s",  # how long the watchdog saw a rank silent
    r"\.venv/bin/python3?(?= )",  # the interpreter's name in a venv: python or python3
)]
# lines only a real launch prints (Lightning initialising the process group): not looked for in a pool run
LAUNCH_ONLY = [re.compile(p) for p in (
    r"^Initializing distributed: ", r"^distributed_backend=", r"^All distributed processes registered",
    r"^-{20,}$",
)]
# lines only a long run prints: not looked for in the shortened run of a long quote
LONG_RUN_ONLY = [re.compile(p) for p in (r"^step \d+/\d+ ", r"^Time limit reached", r"^step \d+  val_loss ")]
_EXIT = re.compile(r"^\(exit code (\d+)\)$")
_GAP = re.compile(r"^(\.\.\.|\[\.\.\..*\])$")
_SESSION = re.compile(r"^<!-- session(?:: (?P<name>[\w-]+))? -->$")
_MARKER = re.compile(r"^<!-- output of(?::| (?P<what>the python block above|the test:))\s*(?P<command>.*?)\s*-->$")


@dataclass(frozen=True)
class Quote:
    """One quoted output: ``doc``'s lines ``[start, end)`` are the quote (0-based), of ``command``.

    ``kind``: ``"command"`` (a shell command in the docs' venv form), ``"python"`` (``command`` is the code of the
    python block above), or ``"test"`` (``command`` is a pytest node id). ``block``: the line of the command's
    fenced block (several commands of one ``console`` block run in order in one directory). ``session``: the name
    of the session its block belongs to (:func:`session_of`), else ``None``. ``cd``: the directory an earlier
    ``$ cd DIR`` of its block moved to (relative to the repository; :func:`enter`), else ``None``."""

    doc: Path
    start: int
    end: int
    command: str
    kind: str = "command"
    block: int = 0
    session: str | None = None
    cd: str | None = None

    @property
    def name(self) -> str:
        """``doc:line``, the line of the quote's first line (1-based)."""
        return f"{self.doc.relative_to(ROOT).as_posix()}:{self.start + 1}"

    def lines(self) -> list[str]:
        """The quote's lines, the exit-code line included."""
        return self.doc.read_text().splitlines()[self.start:self.end]

    def exit_code(self) -> int:
        """The exit code the quote shows (``(exit code N)``), else 0."""
        return next((int(m.group(1)) for m in map(_EXIT.match, self.lines()) if m), 0)


def runnable_command(line: str) -> str:
    """A docs command as run: its ``  # comment`` and the ``.venv/bin/`` prefix (``../../.venv/bin/`` after a
    ``cd``) left out."""
    command = re.split(r"\s{2,}#", line)[0].strip()
    return re.sub(r"^(?:\.\./)*\.venv/bin/", "", command)


def enter(cwd: Path, target: str) -> Path:
    """``cd target`` from ``cwd`` (a :func:`workdir`): every folder on the way becomes a real folder of links to the
    repository's entries, and ``target`` a copy of the repository's, so that what a command writes there never lands
    in the checkout."""
    here, parts = cwd, Path(target).parts
    for i, part in enumerate(parts):
        here = here / part
        if here.is_symlink():
            source = here.resolve()
            here.unlink()
            if i == len(parts) - 1:
                shutil.copytree(source, here, ignore=shutil.ignore_patterns("__pycache__", "outputs", "multirun"))
            else:
                here.mkdir()
                for entry in source.iterdir():
                    (here / entry.name).symlink_to(entry)
    return here


def quotes(docs: Iterable[Path] = DOCS) -> list[Quote]:
    """Every quote of ``docs`` (Note [quoted output]), in document order."""
    found: list[Quote] = []
    for doc in docs:
        lines = doc.read_text().splitlines()
        i = 0
        while i < len(lines):
            fence = re.match(r"^```(\w*)\s*$", lines[i])
            if not fence:
                i += 1
                continue
            end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), len(lines))
            marker = _MARKER.match(lines[i - 1].strip()) if i > 0 else None
            if marker:
                what = marker.group("what") or ""
                kind = "python" if what.startswith("the python") else "test" if what.startswith("the test") else \
                    "command"
                command = marker.group("command")
                session = None
                if kind == "python":
                    command = _python_block_before(lines, i - 1)
                    session = session_of(lines, _python_fence_before(lines, i - 1))
                elif kind == "command":
                    command = runnable_command(command)
                found.append(Quote(doc, i + 1, end, command, kind, i + 1, session))
            elif fence.group(1) in ("console", "bash"):
                console, j, cd = fence.group(1) == "console", i + 1, None
                while j < end:
                    if (console and not lines[j].startswith("$ ")) or not lines[j].strip() or \
                            lines[j].lstrip().startswith("#"):
                        j += 1
                        continue
                    command, k = lines[j][2:] if console else lines[j], j + 1
                    while command.endswith("\\") and k < end:
                        command, k = command[:-1] + " " + lines[k].strip(), k + 1
                    stop = next((m for m in range(k, end) if lines[m].startswith("$ ")), end) if console else k
                    if command.startswith("cd "):  # the block's later commands run there
                        cd = command[3:].strip()
                    else:
                        found.append(Quote(doc, k, stop, runnable_command(command), block=i + 1,
                                           session=session_of(lines, i), cd=cd))
                    j = stop
            i = end + 1
    return found


def session_of(lines: Sequence[str], fence: int) -> str | None:
    """The session of the fenced block opening at ``lines[fence]`` (0-based): ``""`` after a line
    ``<!-- session -->`` (its commands run in order in one directory), ``NAME`` after ``<!-- session: NAME -->``
    (the commands and ``python`` blocks of every block of that doc with that name run in order in one directory:
    a later block reads what an earlier one wrote), else ``None``."""
    match = _SESSION.match(lines[fence - 1].strip()) if fence > 0 else None
    return None if match is None else match.group("name") or ""


def session_key(quote: Quote) -> tuple[Path, str]:
    """The directory a quote's command runs in, as a key: one per named session of a doc, else one per block."""
    return (quote.doc, f"session {quote.session}") if quote.session else (quote.doc, f"block {quote.block}")


def _python_fence_before(lines: list[str], index: int) -> int:
    """The line (0-based) opening the ```python block that ends right before line ``index`` (the marker's line)."""
    end = index - 1
    while end >= 0 and not lines[end].startswith("```"):
        end -= 1
    start = end - 1
    while start >= 0 and not lines[start].startswith("```python"):
        start -= 1
    if start < 0 or end < 0:
        raise ValueError(f"'output of the python block above' at line {index + 1} follows no python block")
    return start


def _python_block_before(lines: list[str], index: int) -> str:
    """The code of the ```python block that ends right before line ``index`` (the marker's line)."""
    start = _python_fence_before(lines, index)
    end = start + 1
    while not lines[end].startswith("```"):
        end += 1
    return "\n".join(lines[start + 1:end]) + "\n"


def normalize(output: str, cwd: Path | None = None) -> list[str]:
    """The output's lines as the docs show them: paths relative to ``cwd`` and to the repository."""
    for base in filter(None, [cwd, ROOT]):
        output = output.replace(f"{base}/", "").replace(str(base), ".")
    return [line.rstrip() for line in output.splitlines()]


def _part(text: str, shape: bool) -> str:
    """A regex for ``text``: its volatile parts match any value; with ``shape``, so does every number."""
    regex, i = [], 0
    while i < len(text):
        volatile = next((m for m in (v.match(text, i) for v in VOLATILE) if m), None)
        number = re.compile(r"-?\d+").match(text, i) if shape else None
        if volatile:
            regex.append(volatile.re.pattern)
            i = volatile.end()
        elif number:
            regex.append(r"-?\d+")
            i = number.end()
        elif text.startswith(".../", i):  # a path's leading directories left out (none included)
            regex.append(r"(?:[^\s()]*/)?")
            i += 4
        else:
            regex.append(re.escape(text[i]))
            i += 1
    return "".join(regex)


def _pattern(line: str, shape: bool) -> re.Pattern[str]:
    """A quoted line as a regex (``...`` at its start, its end or between spaces in it: any text)."""
    head, tail = line.startswith("... "), line.endswith(" ...")
    body = line[4 if head else 0:len(line) - 4 if tail else len(line)]
    regex = " .* ".join(f"({_part(part, shape)})" for part in body.split(" ... "))  # a group per part: refreshed()
    return re.compile(("" if head else "^") + regex + ("" if tail else "$"))


def _wanted(line: str, pool: bool, long: bool) -> bool:
    """Whether a quoted line must be found in the output (gaps, blanks, the exit code and the lines the run could
    not print are not)."""
    text = line.strip()
    if not text or _GAP.match(text) or _EXIT.match(text):
        return False
    if pool and any(p.search(text) for p in LAUNCH_ONLY):
        return False
    return not (long and any(p.search(text) for p in LONG_RUN_ONLY))


def problems(quoted: Sequence[str], output: Sequence[str], ordered: bool = True, pool: bool = False,
             long: bool = False) -> list[str]:
    """What of ``quoted`` the ``output`` lines do not show (Note [quoted output]); empty when the quote holds.

    Args:
        quoted: the quote's lines.
        output: the run's lines (:func:`normalize`).
        ordered: the quote's lines must come in the output's order (``False`` for a run whose ranks printed
            in turn).
        pool: the run was in the test pool (:data:`LAUNCH_ONLY` lines are not looked for).
        long: a long run's quote checked on a shortened run: by form only (:data:`LONG_RUN_ONLY`).
    """
    found, at = [], 0
    for line in quoted:
        if not _wanted(line, pool, long):
            continue
        pattern = _pattern(line.rstrip(), shape=long)
        start = (at - 1 if line.startswith("... ") else at) if ordered and at else (at if ordered else 0)
        hit = next((i for i in range(start, len(output)) if pattern.search(output[i])), None)
        if hit is None:
            close = difflib.get_close_matches(line.rstrip(), output, n=1, cutoff=0.3)
            found.append(f"quoted: {line.rstrip()}\n  the run printed {'nothing like it' if not close else close[0]}")
        elif ordered:
            at = hit + 1
    return found


def refreshed(quoted: Sequence[str], output: Sequence[str]) -> tuple[list[str], list[str]]:
    """``quoted`` with each line replaced by the output line it stands for (found by form, in order), and the
    quoted lines no output line has the form of (left as they were: edit them by hand)."""
    new, missing, at = [], [], 0
    for line in quoted:
        text = line.rstrip()
        if not text.strip() or _GAP.match(text.strip()) or _EXIT.match(text.strip()):
            new.append(line)
            continue
        pattern = _pattern(text, shape=True)
        hit = next(((i, m) for i in range(at, len(output)) if (m := pattern.search(output[i]))), None)
        if hit is None:
            new.append(line)
            missing.append(text)
            continue
        at, match = hit[0] + 1, hit[1]
        head, tail = "... " if text.startswith("... ") else "", " ..." if text.endswith(" ...") else ""
        new.append(head + " ... ".join(match.groups()) + tail)
    return new, missing


# ------------------------------------------------------------------------------------------------ running commands
def workdir(where: Path) -> Path:
    """``where`` holding links to the repository's files (a command's outputs land there, not in the checkout)."""
    where.mkdir(parents=True, exist_ok=True)
    for entry in ROOT.iterdir():
        if not entry.name.startswith(".") and entry.name not in ("outputs", "multirun", "runs"):
            (where / entry.name).symlink_to(entry)
    return where


def program(command: str) -> list[str]:
    """A docs command as an argument list for this checkout's interpreter and console script."""
    args = shlex.split(command)
    if args[0] == "lightning-zero":
        script = shutil.which("lightning-zero", path=str(Path(sys.executable).parent))
        return [*([script] if script else [sys.executable, "-m", "lightning_zero"]), *args[1:]]
    if args[0] in ("python", "python3"):
        return [sys.executable, *args[1:]]
    return args


def run(quote: Quote, cwd: Path, timeout: float = 1800) -> tuple[int, list[str]]:
    """Run what prints ``quote`` as written, in ``cwd`` (or the directory its block's ``cd`` entered there); its
    exit code and output lines normalized against ``cwd``."""
    where = enter(cwd, quote.cd) if quote.cd else cwd
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if quote.kind == "python":
        (where / "block.py").write_text(quote.command)
        command = [sys.executable, "block.py"]
    elif quote.kind == "test":
        out = cwd / "quote.txt"
        env["LIGHTNING_ZERO_QUOTE_FILE"] = str(out)
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", quote.command],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False)
        text = out.read_text() if out.exists() else done.stdout + done.stderr
        return (0 if out.exists() else done.returncode), normalize(text, cwd)
    else:
        command = program(quote.command)
    done = subprocess.run(command, cwd=where, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    return done.returncode, normalize(done.stdout + done.stderr, cwd)


def check_test_quote(doc: str, test: str, output: str, cwd: Path | None = None) -> list[str]:
    """For a test whose scenario a doc quotes (``<!-- output of the test: <test> -->`` in ``doc``): the quote's
    problems against ``output`` (the test asserts there are none), after writing ``output`` where this script
    asked for it when it reruns the test to refresh the quote."""
    if os.environ.get("LIGHTNING_ZERO_QUOTE_FILE"):
        Path(os.environ["LIGHTNING_ZERO_QUOTE_FILE"]).write_text(output)
    (quote,) = [q for q in quotes([ROOT / doc]) if q.kind == "test" and q.command == test]
    return problems(quote.lines(), normalize(output, cwd))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when a quote drifted")
    parser.add_argument("--only", nargs="*", default=[], help="docs whose path contains one of these words")
    args = parser.parse_args(argv)
    chosen = [q for q in quotes() if (not args.only or any(w in q.name for w in args.only))
              and any(_wanted(line, False, False) for line in q.lines())]  # a command that quotes nothing: not run
    sessions = {session_key(q) for q in chosen if q.session}  # ... unless a later one of its session needs it
    chosen = [q for q in quotes() if q in chosen or (q.session and session_key(q) in sessions)]
    drifted = 0
    with tempfile.TemporaryDirectory(prefix="docs_regenerate_") as tmp:
        blocks: dict[tuple[Path, str], Path] = {}
        edits: dict[Path, list[tuple[Quote, list[str]]]] = {}
        for quote in chosen:
            cwd = blocks.get(session_key(quote))
            if cwd is None:  # the commands of one block (or one named session) run in order in one directory
                cwd = blocks[session_key(quote)] = workdir(Path(tmp) / f"block{len(blocks)}")
            if not quote.command.startswith(("lightning-zero", "python")) and quote.kind == "command":
                print(f"{quote.name}: not a command of this checkout's, not run: {quote.command[:80]}")
                continue
            print(f"{quote.name}: {quote.command.splitlines()[0][:100]}", flush=True)
            code, output = run(quote, cwd)
            if code != quote.exit_code():
                print(f"  exit code {code}, the doc shows {quote.exit_code()}:\n" + "\n".join(output[-30:]))
                drifted += 1
                continue
            issues = problems(quote.lines(), output)
            if issues:
                drifted += 1
                print("  drifted:\n  " + "\n  ".join(issues))
                new, missing = refreshed(quote.lines(), output)
                if missing:
                    print("  no line of the output has the form of (edit by hand):\n    " + "\n    ".join(missing))
                edits.setdefault(quote.doc, []).append((quote, new))
        if not args.check:
            for doc, changes in edits.items():
                lines = doc.read_text().splitlines()
                for quote, new in sorted(changes, key=lambda c: -c[0].start):  # bottom up: indices stay valid
                    lines[quote.start:quote.end] = new
                doc.write_text("\n".join(lines) + "\n")
                print(f"rewrote {len(changes)} quote(s) in {doc.relative_to(ROOT)}")
    print(f"{len(chosen)} quote(s), {drifted} drifted" + (" (nothing written)" if args.check else ""))
    return 1 if drifted and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
