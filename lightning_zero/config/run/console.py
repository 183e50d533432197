"""What the launcher shows of its ranks' stderr: the run's ``train.log`` gets every line, the console
only what a user needs, and a failed launch ends with a short summary of the failing rank.

The ranks' stderr (Lightning's info lines and warnings, tracebacks, torchrun's failure report, the
non-terminal progress lines) comes through one pipe; their stdout (Lightning's progress bar on a
terminal, prints) stays the launcher's. :data:`NOISE` lists the lines that are dropped from the
console (never from ``train.log``). A run of one process trains in the launcher itself, under Hydra's
logging: :func:`in_process_console` gives its console the same lines, once each.
"""

from __future__ import annotations

import contextlib
import logging
import re
import signal
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from lightning_zero.config.schema import GPTModelSchema, TextDataSchema, TrainConfig

# lines every run prints that tell the user nothing they can act on (they stay in train.log)
NOISE: tuple[re.Pattern[str], ...] = tuple(re.compile(p) for p in (
    r"Tip: For seamless cloud logging",  # Lightning advertising litlogger
    r"isinstance\(treespec, LeafSpec\)` is deprecated",  # torch's pytree deprecation inside Lightning
    r"Using `DistributedSampler` with the dataloaders\. During `trainer\.validate\(\)`",
    r"^\*{20,}$|Setting OMP_NUM_THREADS environment variable for each process",  # torchrun's OMP banner
))


def _is_noise(text: str) -> bool:
    return any(p.search(text) for p in NOISE)


class _NotNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not _is_noise(record.getMessage())


class _NotPrinted(logging.Filter):
    """For Hydra's console handler: the records the plain handler prints already."""

    def __init__(self, names: tuple[str, ...]) -> None:
        super().__init__()
        self.names = names

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.name.startswith(self.names)


@contextlib.contextmanager
def in_process_console() -> Iterator[None]:
    """While a run trains in this process (``trainer.devices=1``) under Hydra's logging (a console handler and
    ``train.log`` on the root logger): Lightning's lines and the warnings go to the console once, as the ranks
    print them (plain, without :data:`NOISE`), and into ``train.log`` with everything else.

    Without it each Lightning line came twice (Lightning's own ``INFO:`` handler, and Hydra's through
    propagation), the model summary too, and the warnings the ranks' console drops were printed.
    """
    printed = ("lightning", "py.warnings")  # what `plain` prints: Hydra's console leaves these out
    own = {name: logging.getLogger(name) for name in ("lightning", "lightning.pytorch", "lightning.fabric")}
    saved = {name: (list(lg.handlers), lg.propagate) for name, lg in own.items()}
    consoles = [h for h in logging.getLogger().handlers if type(h) is logging.StreamHandler]  # Hydra's, not the file
    plain = logging.StreamHandler(sys.stderr)
    plain.setFormatter(logging.Formatter("%(message)s"))
    plain.addFilter(_NotNoise())
    hide = _NotPrinted(printed)
    for lg in own.values():  # Lightning's handlers ("INFO: ...", or its own when imported before Hydra's logging)
        lg.handlers, lg.propagate = [], True
    for name in printed:
        logging.getLogger(name).addHandler(plain)
    for handler in consoles:
        handler.addFilter(hide)
    logging.captureWarnings(True)  # warnings as records of `py.warnings`: train.log gets them too
    try:
        yield
    finally:
        logging.captureWarnings(False)
        for handler in consoles:
            handler.removeFilter(hide)
        for name in printed:
            logging.getLogger(name).removeHandler(plain)
        for name, (handlers, propagate) in saved.items():
            own[name].handlers, own[name].propagate = handlers, propagate


@dataclass(frozen=True)
class RankExit:
    """The first failure torchrun observed: which rank, its exit code (negative: killed by that signal)
    and whether it left a traceback."""

    rank: int
    exitcode: int
    traceback: bool

    @property
    def signal_name(self) -> str | None:
        """``SIGKILL`` etc. when the rank was killed by a signal."""
        if self.exitcode >= 0:
            return None
        try:
            return signal.Signals(-self.exitcode).name
        except ValueError:
            return f"signal {-self.exitcode}"


class RankConsole:
    """Feed it the ranks' stderr line by line: it appends each to ``log_file`` and echoes the useful ones.

    Args:
        log_file: the run's ``train.log`` (appended to; Hydra's own handler appends too).
        echo: where console lines go (default ``sys.stderr``).
    """

    def __init__(self, log_file: Path, echo: Callable[[str], object] | None = None) -> None:
        self.log_file = log_file
        self._log: IO[str] = open(log_file, "a", encoding="utf-8")  # noqa: SIM115 (closed by close())
        self._echo = echo or (lambda text: (sys.stderr.write(text), sys.stderr.flush()))
        self._dropped_last = False
        self._report: list[str] = []  # torchrun's failure report, from "Failures:" on
        self._in_report = False

    def feed(self, line: str) -> None:
        """One line of the ranks' stderr (with its newline)."""
        self._log.write(line)
        self._log.flush()
        text = line.rstrip("\n")
        if text.strip() == "Failures:":
            self._in_report, self._report = True, []
        elif self._in_report:
            self._report.append(text)
        noise = _is_noise(text) or (self._dropped_last and not text.strip())
        self._dropped_last = noise
        if not noise:
            self._echo(line)

    def close(self) -> None:
        """Close the log file."""
        self._log.close()

    def first_failure(self) -> RankExit | None:
        """The rank whose failure ended the run, from torchrun's failure report (``None`` without one).

        torchrun names as root cause the failure with the earliest timestamp, in whole seconds, the lowest
        rank winning a tie: a rank it stopped with SIGTERM because another was SIGKILLed in the same
        second can come first. The hang watchdog's exit (75, 76) is preferred (its finding is the cause; a
        silent rank it ended shows as SIGKILL, Note [ending a silent rank]), then a failure the launcher did not
        cause (any other signal, or an exit code) over a SIGTERM/SIGINT, the root cause over the others.
        """
        failures: list[tuple[bool, RankExit]] = []  # (is the root cause, failure)
        root = False
        for block in re.split(r"\n(?=\s*\[\d+\]:)|\n(?=Root Cause)", "\n".join(self._report)):
            root = root or block.startswith("Root Cause")
            parsed = _parse_failure(block)
            if parsed is not None:
                failures.append((root, parsed))
        if not failures:
            return None

        def rank_key(item: tuple[bool, RankExit]) -> tuple[bool, bool, bool]:
            is_root, failure = item  # the hang watchdog's exit first: it ended a silent rank with SIGKILL
            return (failure.exitcode not in _HANG_EXITS, failure.signal_name in _LAUNCHER_SIGNALS, not is_root)

        return min(failures, key=rank_key)[1]


# the hang watchdog's exit codes (core/reliability/hang_finding.py;
# literal: the launcher does not import torch for them)
_HANG_EXITS = {75: "a rank or the store stopped answering",
               76: "every rank alive, no progress: their collectives differ"}
_LAUNCHER_SIGNALS = ("SIGTERM", "SIGINT")  # what torchrun sends the surviving ranks when one fails


def _parse_failure(block: str) -> RankExit | None:
    """One ``[i]: ... rank : r ... exitcode : c ... traceback : t`` block of torchrun's report."""
    rank = re.search(r"rank\s*:\s*(\d+)", block)
    code = re.search(r"exitcode\s*:\s*(-?\d+)", block)
    if rank is None or code is None:
        return None
    tb = re.search(r"traceback\s*:\s*(.*)", block)
    has_tb = tb is not None and not tb.group(1).startswith(("Signal", "To enable traceback"))
    return RankExit(int(rank.group(1)), int(code.group(1)), has_tb)


def failure_summary(failed: RankExit | None, devices: int, run_dir: Path, advice: str | None) -> str:
    """The few lines that end a failed launch: which rank, how it ended, the likely cause, what to try.

    Args:
        failed: torchrun's first observed failure (``None`` when it printed none).
        devices: the number of ranks launched.
        run_dir: the run directory (its ``train.log`` has every rank's full output).
        advice: the estimator's suggestion of a configuration that fits (for out-of-memory kills).
    """
    log = run_dir / "train.log"
    if failed is None:
        return f"the {devices} ranks of {run_dir} failed; the full output is in {log}."
    sig = failed.signal_name
    if failed.exitcode in _HANG_EXITS:
        return (f"rank {failed.rank} of {devices} was stopped by the hang watchdog (exit code {failed.exitcode}: "
                f"{_HANG_EXITS[failed.exitcode]}); the finding, the same on every rank, is above ('[lightning-zero] "
                f"hang detected'), and every rank's full output is in {log} (docs/reliability.md).")
    if sig is None:
        return (f"rank {failed.rank} of {devices} failed with exit code {failed.exitcode}; its traceback is "
                f"above, and every rank's full output is in {log}.")
    lines = [f"rank {failed.rank} of {devices} was killed by {sig} (it printed no traceback; the other ranks' "
             f"errors, e.g. 'Connection reset/closed by peer', follow from it). Full output: {log}."]
    if sig == "SIGKILL":
        lines.append("Likely cause: the out-of-memory killer (a SIGKILL without a traceback usually is; "
                     "`dmesg | grep -i oom` or `journalctl -k` confirms it).")
        if advice:
            lines.append(advice)
    return "\n".join(lines)


def oom_advice(cfg: TrainConfig) -> str | None:
    """The estimator's suggestion (:func:`~lightning_zero.estimator.advisor.advise`) of a configuration of ``cfg``'s
    model that fits this machine: per-rank memory is the GPU's, or on CPU the host memory over the ranks."""
    import os

    import torch

    from lightning_zero.config.describe import count_model_parameters
    from lightning_zero.config.model_zoo import gpt_config
    from lightning_zero.estimator.advisor import advise

    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    t = cfg.trainer
    gpu = t.accelerator in ("gpu", "cuda", "auto") and torch.cuda.is_available()
    device = torch.cuda.get_device_properties(0).total_memory if gpu else host / t.devices
    precision = cfg.precision.name.value
    shape: dict[str, int] = {}
    if isinstance(cfg.model, GPTModelSchema) and isinstance(cfg.data, TextDataSchema):
        g = gpt_config(cfg.model)
        shape = dict(micro_batch=cfg.data.micro_batch_size, seq_len=cfg.data.seq_len, layers=g.n_layer,
                     hidden=g.n_embd, heads=g.n_head)
    params = count_model_parameters(cfg)
    if params is None:  # a model not counted before launch (your own `_target_`): no figure to advise from
        return None
    try:
        tp = cfg.tensor_parallel.size
        adv = advise(params, device_memory=device, cpu_memory=host, world_size=t.devices,
                     precision=precision, tensor_parallel=tp if tp > 1 else None, **shape)
    except ValueError:
        return None
    where = "GPU" if gpu else f"host memory / {t.devices} ranks"
    size = f"{device / 1e9:.1f} GB per rank ({where})"
    if adv.choice is None:
        return f"The estimator finds no configuration of this model that fits {size}: see `lightning-zero advise`."
    return (f"The estimator suggests for {size}: {adv.choice.label} -> {adv.overrides} "
            f"(`lightning-zero advise --device-memory {device / 1e9:.1f}GB --params "
            f"{params} --precision {precision}` explains why).")


def _offload_of(cfg: TrainConfig) -> str:
    """The estimator's offload option of ``cfg`` (``none``, ``optimizer_cpu``, ``param_nvme``...)."""
    o = cfg.offload
    if o.param_device.value != "none":
        return f"param_{o.param_device.value}"
    return "none" if o.optimizer_device.value == "none" else f"optimizer_{o.optimizer_device.value}"


def host_memory_note(cfg: TrainConfig) -> str | None:
    """For a rank killed by SIGKILL: the estimator's host-memory figure of ``cfg`` (per rank and for this
    node's ranks) and the settings of the same model that lower it, each with its figure.

    Host memory is what the estimator puts on the CPU: everything (model states and activations) when the
    ranks train on CPU, the offloaded model states on GPU. The processes' own footprint (Python, torch,
    the data) comes on top."""
    import torch

    from lightning_zero.config.describe import count_model_parameters
    from lightning_zero.core.common.memory import OFFLOAD_STAGES
    from lightning_zero.estimator import estimate_memory, format_bytes

    t = cfg.trainer
    on_cpu = not (t.accelerator in ("gpu", "cuda", "auto") and torch.cuda.is_available())
    shape: dict[str, int] = {}
    if isinstance(cfg.model, GPTModelSchema) and isinstance(cfg.data, TextDataSchema):
        from lightning_zero.config.model_zoo import gpt_config

        g = gpt_config(cfg.model)
        shape = dict(micro_batch=cfg.data.micro_batch_size, seq_len=cfg.data.seq_len, layers=g.n_layer,
                     hidden=g.n_embd, heads=g.n_head)
    params, precision = count_model_parameters(cfg), cfg.precision.name.value
    if params is None:
        return None

    tp = cfg.tensor_parallel.size  # offload composes with TP: its settings are offered as without it

    def host(stage: int, offload: str, **change: int) -> float:
        c = estimate_memory(params, world_size=t.devices * t.num_nodes, gpus_per_node=t.devices,
                            precision=precision, offload=offload, tensor_parallel=tp,
                            **{**shape, **change}).config(stage, offload)
        return c.cpu_bytes + (c.device_total() if on_cpu else 0.0)

    stage, offload = cfg.zero.stage, _offload_of(cfg)
    try:
        now = host(stage, offload)
        options: list[tuple[str, float]] = [(f"zero=stage{s}", host(s, offload)) for s in range(stage + 1, 4)
                                            if s in OFFLOAD_STAGES[offload]]
        if offload in ("none", "optimizer_cpu") and (on_cpu or offload == "optimizer_cpu"):
            s = max(stage, 1)
            options.append(("offload=optimizer_nvme offload.nvme_path=<fast disk>"
                            + ("" if s == stage else f" zero=stage{s}"), host(s, "optimizer_nvme")))
        if offload != "param_nvme" and (on_cpu or offload == "param_cpu"):
            options.append(("offload=param_nvme offload.nvme_path=<fast disk> zero=stage3", host(3, "param_nvme")))
        if shape.get("micro_batch", 1) > 1:
            half = shape["micro_batch"] // 2
            options.append((f"data.micro_batch_size={half}", host(stage, offload, micro_batch=half)))
    except ValueError:
        return None
    where = "everything, the ranks train on CPU" if on_cpu else "the offloaded model states"
    tp_text = f", tensor parallel {tp}" if tp > 1 else ""
    lines = [f"The estimator's host memory for this configuration (stage {stage}, offload {offload}{tp_text}, "
             f"{precision}, {t.devices} ranks per node; {where}): {format_bytes(now)} per rank, "
             f"{format_bytes(now * t.devices)} for this node's ranks, plus each process's own (Python, torch, data)."]
    lower = [f"{o} ({format_bytes(b)} per rank)" for o, b in sorted(options, key=lambda x: x[1]) if b < now]
    if lower:
        lines.append("Settings that lower it: " + "; ".join(lower) + "; fewer ranks per node (trainer.devices).")
    else:
        lines.append("Fewer ranks per node (trainer.devices) lower it; no other stage or offload of this model does.")
    return "\n".join(lines)
