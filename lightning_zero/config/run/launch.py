"""``lightning-zero train``: compose ``conf/`` with Hydra, validate, and launch the ranks of each run.

The flow of one run (each job of a ``-m`` multirun does the same in its own output directory):

1. Before Hydra starts any job, every job of the command line (a sweep expanded like Hydra's basic
   sweeper) is composed, its ``deepspeed_config`` JSON (if any) merged in
   (:func:`~lightning_zero.config.run.deepspeed.apply_deepspeed_config`), and validated
   (:func:`~lightning_zero.config.validate.validate_config`), so an invalid or unbuilt combination
   stops the command before any run or process starts.
2. ``hydra.main`` runs the job: it writes ``.hydra/`` (composed config, overrides) into the job's
   output directory, and :func:`run_job` writes the resolved, typed config to ``config.yaml`` there.
3. With ``trainer.devices=1`` the run trains in this process. Otherwise :func:`launch_ranks` starts
   ``python -m torch.distributed.run --standalone --nproc_per_node=N -m lightning_zero.config.run.worker
   <job dir>/config.yaml``: the ranks read that file and never re-enter Hydra, so no rank creates an
   output directory or re-runs a sweep (Lightning's own launcher would re-run ``sys.argv``).
   A rank's failure makes torchrun exit non-zero, which fails the job and the command.

This process imports no Lightning unless it trains in process (``trainer.devices=1``): only the ranks need it
(Note [lazy package names] in ``core/lazy.py``; ``tests/unit/test_lazy_imports.py`` checks it).
"""

from __future__ import annotations

import copy
import difflib
import json
import logging
import os
import re
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf, open_dict

from lightning_zero.checkpoint.reader import resume_path
from lightning_zero.config.describe import describe
from lightning_zero.config.multinode import NodeLaunch, resolve_node
from lightning_zero.config.paths import (
    COMMAND_NAMES,
    CONFIG_NAME,
    FIT,
    RESULT_FILE,
    SCHEMAS,
    EvalResult,
    FitResult,
    checkpoint_of,
    conf_dir,
    group_options,
    register_configs,
    register_run_name,
)
from lightning_zero.config.run.deepspeed import apply_deepspeed_config
from lightning_zero.config.schema import TextDataSchema, TrainConfig, to_train_config, to_yaml
from lightning_zero.config.validate import config_warnings, validate_config
from lightning_zero.core.common.choices import OffloadDevice
from lightning_zero.core.common.errors import USAGE_EXIT, UsageError
from lightning_zero.core.offload.host_store import MMAP_THRESHOLD_BYTES
from lightning_zero.project.locate import record_project_dir

CONFIG_FILE = "config.yaml"  # the resolved config the ranks read, in the job's output directory
log = logging.getLogger("lightning_zero.train")


class RankFailure(RuntimeError):
    """The rank processes of a run exited with an error (``code``: the command's exit code)."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def _refuse_schema_choices(overrides: Sequence[str]) -> None:
    """``zero=zero_schema`` would compose the bare schema (its defaults) as if it were an option: refuse it; and
    ``zero=3``, which Hydra refuses with "Config group override must be a string or a list. Got int", naming no
    group: say which option it means (the one whose name ends in that number)."""
    schemas = {(group, name) for group, name in SCHEMAS if group is not None}
    for override in overrides:
        key, _, value = override.partition("=")
        group = key.lstrip("+~").lstrip("/")
        for name in value.split(","):
            name = name.strip()
            if (group, name) in schemas:
                raise ValueError(f"{group}={name}: `{name}` is the typed schema behind conf/{group}/, "
                                 f"not an option. Options: {', '.join(group_options(group))}.")
            if re.fullmatch(r"[-+]?\d+(\.\d*)?", name) and (conf_dir() / group).is_dir():
                options = group_options(group)
                meant = [o for o in options if re.search(rf"\D{re.escape(name)}$", o)]
                hint = f" Did you mean {group}={meant[0]}?" if len(meant) == 1 else ""
                raise ValueError(f"{group}={name}: a config group takes an option's name, not a number.{hint} "
                                 f"Options: {', '.join(options)}.")


def with_config_dir(overrides: Sequence[str], config_dir: str | None) -> list[str]:
    """``overrides`` with ``--config-dir`` as the compose API takes it: first in ``hydra.searchpath`` (both come after
    the package's ``conf/``, as Hydra searches them: an option of the same name as the package's is hidden)."""
    if config_dir is None:
        return list(overrides)
    from hydra.core.override_parser.overrides_parser import OverridesParser

    extra = [f"file://{Path(config_dir).resolve()}"]
    rest = []
    for override in overrides:
        parsed = OverridesParser.create().parse_override(override)
        if parsed.get_key_element() == "hydra.searchpath":
            extra += list(parsed.value())  # type: ignore[arg-type]
        else:
            rest.append(override)
    return [*rest, f"hydra.searchpath=[{','.join(extra)}]"]


def shadowed_options(config_dir: str | None) -> list[str]:
    """The options of ``config_dir`` that the package's options of the same name hide, each with its fix."""
    if config_dir is None:
        return []
    ours = conf_dir()
    return [f"{Path(config_dir) / group.name / option.name} is hidden by the package's {group.name}={option.stem} "
            f"(conf/ is searched before --config-dir). Fix: give yours another name."
            for group in sorted(Path(config_dir).iterdir()) if group.is_dir()
            for option in sorted(group.glob("*.yaml")) if (ours / group.name / option.name).is_file()]


def _without_hydra_node(cfg: DictConfig) -> DictConfig:
    """The composed config without its ``hydra`` node, Hydra's runtime set as a job's would be (the output directory
    as the run would name it), so that ``${hydra:runtime.output_dir}`` in the user's yaml resolves when checked."""
    from hydra.core.hydra_config import HydraConfig

    probe = copy.deepcopy(cfg)
    HydraConfig.instance().set_config(probe)  # (it makes the node read-only)
    try:
        out = OmegaConf.select(probe, "hydra.run.dir")
    except Exception:  # an interpolation only a running job resolves: any directory will do for the checks
        out = "outputs"
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(Path(out).resolve())
        cfg.hydra.runtime.cwd = os.getcwd()
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg


def compose_config(overrides: Sequence[str] = (), config_name: str = CONFIG_NAME,
                   config_dir: str | None = None) -> DictConfig:
    """Compose ``conf/`` with Hydra's compose API (what ``train`` runs, without starting anything); ``config_dir``:
    ``--config-dir``, the user's own config groups.

    Raises:
        ValueError: a group choice names a schema (``zero=zero_schema``) instead of an option.
    """
    _refuse_schema_choices(overrides)
    register_configs()
    register_run_name()
    with initialize_config_dir(str(conf_dir()), version_base="1.3", job_name="train"):
        cfg = compose(config_name, overrides=with_config_dir(overrides, config_dir), return_hydra_config=True)
    return _without_hydra_node(cfg)


def expand_sweep(overrides: Sequence[str]) -> list[list[str]]:
    """The overrides of every job of a multirun, as Hydra's basic sweeper expands them."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(list(overrides))
    return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


def check_jobs(jobs: Sequence[Sequence[str]], config_name: str = CONFIG_NAME,
               config_dir: str | None = None) -> list[TrainConfig]:
    """Compose and validate every job; errors name the job's overrides when there are several jobs."""
    out = []
    for job in jobs:
        try:
            out.append(validate_config(apply_deepspeed_config(compose_config(job, config_name, config_dir), job)))
        except (ValueError, NotImplementedError) as err:
            if len(jobs) > 1:
                raise type(err)(f"job [{' '.join(job)}]: {err}") from err
            raise
    return out


def explain(err: BaseException) -> str:
    """A composition error's message with its cause, and the closest valid key for a misspelt one."""
    text = str(err)
    missing = re.search(r"Could not find '([^']+)/([^'/]+)'", text)
    if missing and (conf_dir() / missing.group(1)).is_dir():  # a misspelt group option: one line, not the search path
        group, name = missing.groups()
        options = group_options(group)
        close = difflib.get_close_matches(name, options, n=1, cutoff=0.5)
        return (f"{group}={name}: no such option in conf/{group}/."
                f"{f' Did you mean {group}={close[0]}?' if close else ''} Options: {', '.join(options)}.")
    if err.__cause__ is not None and str(err.__cause__) not in text:
        text += f"\n{err.__cause__}"
    match = re.search(r"Could not override '([^']+)'", text)
    if match:
        try:
            keys = _flat_keys(OmegaConf.to_container(compose_config(), resolve=False))
        except Exception:  # the defaults themselves do not compose: no suggestion
            keys = []
        close = difflib.get_close_matches(match.group(1), keys, n=1)
        text = text.split("\nTo append")[0] + (f" Did you mean {close[0]}?" if close else "") + \
            " Keys are fixed by the schemas in lightning_zero/config/schema.py (lightning-zero train --help)."
    return text


def _flat_keys(node: object, prefix: str = "") -> list[str]:
    if not isinstance(node, dict):
        return [prefix.rstrip(".")]
    return [k for key, value in node.items() for k in _flat_keys(value, f"{prefix}{key}.")]


def torchrun_command(config_file: Path, devices: int, node: NodeLaunch | None = None,
                     command: str = FIT) -> list[str]:
    """The command that starts this node's ``devices`` ranks of the worker on ``config_file`` running ``command``."""
    where = node.torchrun_args() if node is not None else ["--standalone"]
    return [sys.executable, "-m", "torch.distributed.run", *where, f"--nproc_per_node={devices}",
            "-m", "lightning_zero.config.run.worker", str(config_file), *([command] if command != FIT else [])]


def launch_ranks(config_file: Path, devices: int, node: NodeLaunch | None = None, command: str = FIT,
                 env_extra: dict[str, str] | None = None) -> None:
    """Run ``devices`` ranks of the worker on ``config_file`` with ``torch.distributed.run`` (free port), or
    this node's ranks of a multi-node job (``node``: Note [multi-node] in config/multinode.py).

    The ranks' stderr goes through :class:`~lightning_zero.config.run.console.RankConsole`: all of it into
    the run's ``train.log``, the console without the known noise (their stdout is left alone).

    Raises:
        RankFailure: torchrun exited non-zero; the message says which rank failed and how (a rank killed
            by a signal has no traceback: the likely cause and a configuration that fits instead).
    """
    from lightning_zero.config.run.console import RankConsole, failure_summary, host_memory_note, oom_advice

    cmd = torchrun_command(config_file, devices, node, command)
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[3])  # the ranks import this checkout
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default, without its banner
    for key, value in (env_extra or {}).items():
        env.setdefault(key, value)
    log.info("launching %d ranks: %s", devices, " ".join(cmd))
    run_dir = config_file.parent
    console = RankConsole(run_dir / "train.log")
    try:
        with subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True, errors="replace") as proc:
            assert proc.stderr is not None
            for line in proc.stderr:
                console.feed(line)
            code = proc.wait()
    finally:
        console.close()
    if code != 0:
        failed = console.first_failure()
        if failed is not None and failed.exitcode == USAGE_EXIT:  # a UsageError, printed once by rank 0
            raise RankFailure(f"the ranks refused the configuration (the error above); nothing was trained. Full "
                              f"output: {run_dir / 'train.log'}.", USAGE_EXIT)
        advice = None
        if failed is not None and failed.signal_name == "SIGKILL":
            cfg = to_train_config(OmegaConf.to_container(OmegaConf.load(config_file)))  # type: ignore[arg-type]
            advice = "\n".join(filter(None, [host_memory_note(cfg), oom_advice(cfg)]))
        raise RankFailure(failure_summary(failed, devices, run_dir, advice))


def run_job(cfg: DictConfig | TrainConfig, run_dir: Path, overrides: Sequence[str] = (),
            command: str = FIT) -> FitResult | EvalResult:
    """Validate ``cfg`` (its ``deepspeed_config`` merged in, ``overrides`` being the explicit command line),
    write ``run_dir/config.yaml`` and train (or ``command``: validate, test or predict with ``ckpt_path``): in
    process for one device, else via torchrun."""
    from hydra.utils import to_absolute_path

    typed = copy.deepcopy(validate_config(apply_deepspeed_config(cfg, overrides)))
    if typed.ckpt_path:
        typed.ckpt_path = str(checkpoint_of(to_absolute_path(typed.ckpt_path)))
    if typed.deepspeed_config:
        typed.deepspeed_config = to_absolute_path(typed.deepspeed_config)
    if isinstance(typed.data, TextDataSchema) and typed.data.path:
        typed.data.path = to_absolute_path(typed.data.path)  # the ranks may run elsewhere
    if typed.trainer.resume_from:  # a run's checkpoints/ folder: its last.ckpt (what validation checked)
        typed.trainer.resume_from = str(resume_path(to_absolute_path(typed.trainer.resume_from)))
    if typed.offload.nvme_path:
        typed.offload.nvme_path = to_absolute_path(typed.offload.nvme_path)
    run_dir.mkdir(parents=True, exist_ok=True)
    config_file = run_dir / CONFIG_FILE
    config_file.write_text(to_yaml(typed))
    log.info("%s", describe(typed))
    log.info("run directory: %s", run_dir)
    node = resolve_node(typed.trainer.num_nodes, typed.trainer.node_rank, typed.trainer.rdzv_endpoint)
    if typed.trainer.devices == 1 and node is None:
        from lightning_zero.config.run.build import evaluate, fit
        from lightning_zero.config.run.console import in_process_console

        with in_process_console():
            result = fit(typed, run_dir) if command == FIT else evaluate(typed, run_dir, command)
    else:
        # disk offload: glibc's mmap threshold fixed from each rank's first allocation (Note [freed memory] in
        # core/offload/host_store.py), so that no freed buffer stays in a heap
        nvme = OffloadDevice.nvme in (typed.offload.optimizer_device, typed.offload.param_device)
        env = {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD_BYTES)} if nvme else None
        launch_ranks(config_file, typed.trainer.devices, node, command, env)
        data = json.loads((run_dir / RESULT_FILE).read_text())
        result = FitResult(**data) if command == FIT else EvalResult(**data)
    log.info("%s: %s", typed.name, result.summary())
    return result


def _hydra_task(command: str) -> Callable[[DictConfig], Any]:
    prog = f"lightning-zero {COMMAND_NAMES[command]}"

    def task(cfg: DictConfig) -> Any:
        from hydra.core.hydra_config import HydraConfig

        hydra_cfg = HydraConfig.get()
        run_dir, overrides = Path(hydra_cfg.runtime.output_dir), list(hydra_cfg.overrides.task)
        try:
            result = run_job(cfg, run_dir, overrides) if command == FIT else run_job(cfg, run_dir, overrides, command)
        except RankFailure as err:  # the summary is the last thing printed, without the launcher's own traceback
            print(f"\n{prog}: {err}", file=sys.stderr, flush=True)
            raise SystemExit(err.code) from err
        except UsageError as err:  # one device trains in this process: the same one line as the ranks print
            print(f"{prog}: error: {err}", file=sys.stderr, flush=True)
            raise SystemExit(USAGE_EXIT) from err
        return getattr(result, "val_loss_end", None)  # an EvalResult has none

    return task


def _command_problems(checked: Sequence[TrainConfig], command: str) -> list[str]:
    """``ckpt_path`` belongs to validate / test / predict, and must exist there."""
    out = []
    for cfg in checked:
        if command == FIT and cfg.ckpt_path:
            out.append(f"ckpt_path={cfg.ckpt_path} is read by `lightning-zero validate / test / predict`; train "
                       "resumes from trainer.resume_from. Fix: trainer.resume_from=<run dir>/checkpoints/last.ckpt.")
        elif cfg.ckpt_path:
            try:
                checkpoint_of(cfg.ckpt_path)
            except FileNotFoundError as err:
                out.append(str(err))
    return out


def train_command(argv: Sequence[str], command: str = FIT) -> int:
    """``lightning-zero train [hydra args] [overrides]``: Hydra's command line, e.g. ``-m zero=stage1,stage2``;
    ``command`` ``validate`` / ``test`` / ``predict``: the same groups, the Trainer's method of that name on the
    model (``ckpt_path=``: a checkpoint, or a finished run's directory).

    Returns the exit code: 0 on success, 2 when the configuration is invalid or not implemented
    (nothing was started), 1 when a run failed.
    """
    import hydra
    from hydra._internal.utils import get_args_parser

    prog = f"lightning-zero {COMMAND_NAMES[command]}"
    argv = list(argv)
    try:
        args = get_args_parser().parse_args(argv)
    except SystemExit as done:
        return int(done.code or 0)
    starts_jobs = not (args.help or args.hydra_help or args.cfg or args.info or args.shell_completion
                       or args.experimental_rerun or args.config_path)
    record_project_dir()  # the ranks import the user's `_target_`s from here (Note [project directory])
    if starts_jobs:
        for line in shadowed_options(args.config_dir):
            print(f"{prog}: warning: {line}", file=sys.stderr)
        try:
            jobs = expand_sweep(args.overrides) if args.multirun else [list(args.overrides)]
            checked = check_jobs(jobs, args.config_name or CONFIG_NAME, args.config_dir)
        except NotImplementedError as err:
            print(f"{prog}: {err}", file=sys.stderr)
            return 2
        except Exception as err:  # composition errors: misspelt key, wrong type, unknown option
            print(f"{prog}: error: {explain(err)}", file=sys.stderr)
            return 2
        problems = dict.fromkeys(_command_problems(checked, command))
        if problems:
            print(f"{prog}: error: " + "\n  - ".join(["invalid configuration:", *problems]), file=sys.stderr)
            return 2
        for line in dict.fromkeys(w for cfg in checked for w in config_warnings(cfg)):  # once, not per job
            print(f"{prog}: warning: {line}", file=sys.stderr)
    register_configs()
    register_run_name()  # the output directories' names (conf/config.yaml)
    task = hydra.main(version_base="1.3", config_path=str(conf_dir()), config_name=CONFIG_NAME)(_hydra_task(command))
    saved = sys.argv
    sys.argv = [prog, *argv]  # hydra.main parses sys.argv
    try:
        task()
    except SystemExit as done:  # --help, or Hydra reporting a failed job
        return done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    finally:
        sys.argv = saved
        GlobalHydra.instance().clear()  # so that this process can compose again
    return 0
