"""``lightning-zero train``: compose ``conf/`` with Hydra, validate, and launch the ranks of each run.

The flow of one run (each job of a ``-m`` multirun does the same in its own output directory):

1. Before Hydra starts any job, every job of the command line (a sweep expanded like Hydra's basic
   sweeper) is composed, its ``deepspeed_config`` JSON (if any) merged in
   (:func:`~lightning_zero.config.deepspeed.apply_deepspeed_config`), and validated
   (:func:`~lightning_zero.config.validate.validate_config`), so an invalid or unbuilt combination
   stops the command before any run or process starts.
2. ``hydra.main`` runs the job: it writes ``.hydra/`` (composed config, overrides) into the job's
   output directory, and :func:`run_job` writes the resolved, typed config to ``config.yaml`` there.
3. With ``trainer.devices=1`` the run trains in this process. Otherwise :func:`launch_ranks` starts
   ``python -m torch.distributed.run --standalone --nproc_per_node=N -m lightning_zero.config.worker
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
from collections.abc import Sequence
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf

import lightning_zero
from lightning_zero.config.deepspeed import apply_deepspeed_config
from lightning_zero.config.multinode import NodeLaunch, resolve_node
from lightning_zero.config.paths import (
    CONFIG_NAME,
    RESULT_FILE,
    SCHEMAS,
    FitResult,
    conf_dir,
    register_configs,
    register_run_name,
)
from lightning_zero.config.schema import TextDataSchema, TrainConfig, to_train_config, to_yaml
from lightning_zero.config.validate import config_warnings, describe, validate_config

CONFIG_FILE = "config.yaml"  # the resolved config the ranks read, in the job's output directory
log = logging.getLogger("lightning_zero.train")


class RankFailure(RuntimeError):
    """The rank processes of a run exited with an error."""


def group_options(group: str) -> list[str]:
    """The options of a config group: its YAML files under ``conf/`` (the typed ``*_schema`` entries of
    Hydra's ConfigStore are not options)."""
    return sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))


def _refuse_schema_choices(overrides: Sequence[str]) -> None:
    """``zero=zero_schema`` would compose the bare schema (its defaults) as if it were an option: refuse it."""
    schemas = {(group, name) for group, name in SCHEMAS if group is not None}
    for override in overrides:
        key, _, value = override.partition("=")
        group = key.lstrip("+~").lstrip("/")
        for name in value.split(","):
            if (group, name.strip()) in schemas:
                raise ValueError(f"{group}={name.strip()}: `{name.strip()}` is the typed schema behind conf/{group}/, "
                                 f"not an option. Options: {', '.join(group_options(group))}.")


def compose_config(overrides: Sequence[str] = (), config_name: str = CONFIG_NAME) -> DictConfig:
    """Compose ``conf/`` with Hydra's compose API (what ``train`` runs, without starting anything).

    Raises:
        ValueError: a group choice names a schema (``zero=zero_schema``) instead of an option.
    """
    _refuse_schema_choices(overrides)
    register_configs()
    with initialize_config_dir(str(conf_dir()), version_base="1.3", job_name="train"):
        return compose(config_name, overrides=list(overrides))


def expand_sweep(overrides: Sequence[str]) -> list[list[str]]:
    """The overrides of every job of a multirun, as Hydra's basic sweeper expands them."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(list(overrides))
    return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


def check_jobs(jobs: Sequence[Sequence[str]], config_name: str = CONFIG_NAME) -> list[TrainConfig]:
    """Compose and validate every job; errors name the job's overrides when there are several jobs."""
    out = []
    for job in jobs:
        try:
            out.append(validate_config(apply_deepspeed_config(compose_config(job, config_name), job)))
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


def torchrun_command(config_file: Path, devices: int, node: NodeLaunch | None = None) -> list[str]:
    """The command that starts this node's ``devices`` ranks of the worker on ``config_file``."""
    where = node.torchrun_args() if node is not None else ["--standalone"]
    return [sys.executable, "-m", "torch.distributed.run", *where, f"--nproc_per_node={devices}",
            "-m", "lightning_zero.config.worker", str(config_file)]


def launch_ranks(config_file: Path, devices: int, node: NodeLaunch | None = None) -> None:
    """Run ``devices`` ranks of the worker on ``config_file`` with ``torch.distributed.run`` (free port), or
    this node's ranks of a multi-node job (``node``: Note [multi-node] in config/multinode.py).

    The ranks' stderr goes through :class:`~lightning_zero.config.console.RankConsole`: all of it into
    the run's ``train.log``, the console without the known noise (their stdout is left alone).

    Raises:
        RankFailure: torchrun exited non-zero; the message says which rank failed and how (a rank killed
            by a signal has no traceback: the likely cause and a configuration that fits instead).
    """
    from lightning_zero.config.console import RankConsole, failure_summary, host_memory_note, oom_advice

    cmd = torchrun_command(config_file, devices, node)
    env = dict(os.environ)
    root = str(Path(lightning_zero.__file__).resolve().parents[1])  # the ranks import this checkout
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default, without its banner
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
        advice = None
        if failed is not None and failed.signal_name == "SIGKILL":
            cfg = to_train_config(OmegaConf.to_container(OmegaConf.load(config_file)))  # type: ignore[arg-type]
            advice = "\n".join(filter(None, [host_memory_note(cfg), oom_advice(cfg)]))
        raise RankFailure(failure_summary(failed, devices, run_dir, advice))


def run_job(cfg: DictConfig | TrainConfig, run_dir: Path, overrides: Sequence[str] = ()) -> FitResult:
    """Validate ``cfg`` (its ``deepspeed_config`` merged in, ``overrides`` being the explicit command line),
    write ``run_dir/config.yaml`` and train: in process for one device, else via torchrun."""
    from hydra.utils import to_absolute_path

    typed = copy.deepcopy(validate_config(apply_deepspeed_config(cfg, overrides)))
    if typed.deepspeed_config:
        typed.deepspeed_config = to_absolute_path(typed.deepspeed_config)
    if isinstance(typed.data, TextDataSchema) and typed.data.path:
        typed.data.path = to_absolute_path(typed.data.path)  # the ranks may run elsewhere
    if typed.trainer.resume_from:
        typed.trainer.resume_from = to_absolute_path(typed.trainer.resume_from)
    if typed.offload.nvme_path:
        typed.offload.nvme_path = to_absolute_path(typed.offload.nvme_path)
    run_dir.mkdir(parents=True, exist_ok=True)
    config_file = run_dir / CONFIG_FILE
    config_file.write_text(to_yaml(typed))
    log.info("%s", describe(typed))
    log.info("run directory: %s", run_dir)
    node = resolve_node(typed.trainer.num_nodes, typed.trainer.node_rank, typed.trainer.rdzv_endpoint)
    if typed.trainer.devices == 1 and node is None:
        from lightning_zero.config.build import fit

        result = fit(typed, run_dir)
    else:
        launch_ranks(config_file, typed.trainer.devices, node)
        result = FitResult(**json.loads((run_dir / RESULT_FILE).read_text()))
    log.info("%s: %s", typed.name, result.summary())
    return result


def _hydra_task(cfg: DictConfig) -> float | None:
    from hydra.core.hydra_config import HydraConfig

    hydra_cfg = HydraConfig.get()
    try:
        return run_job(cfg, Path(hydra_cfg.runtime.output_dir), list(hydra_cfg.overrides.task)).val_loss_end
    except RankFailure as err:  # the summary is the last thing printed, without the launcher's own traceback
        print(f"\nlightning-zero train: {err}", file=sys.stderr, flush=True)
        raise SystemExit(1) from err


def train_command(argv: Sequence[str]) -> int:
    """``lightning-zero train [hydra args] [overrides]``: Hydra's command line, e.g. ``-m zero=stage1,stage2``.

    Returns the exit code: 0 on success, 2 when the configuration is invalid or not implemented
    (nothing was started), 1 when a run failed.
    """
    import hydra
    from hydra._internal.utils import get_args_parser

    argv = list(argv)
    try:
        args = get_args_parser().parse_args(argv)
    except SystemExit as done:
        return int(done.code or 0)
    starts_jobs = not (args.help or args.hydra_help or args.cfg or args.info or args.shell_completion
                       or args.experimental_rerun or args.config_dir or args.config_path)
    if starts_jobs:
        try:
            jobs = expand_sweep(args.overrides) if args.multirun else [list(args.overrides)]
            checked = check_jobs(jobs, args.config_name or CONFIG_NAME)
        except NotImplementedError as err:
            print(f"lightning-zero train: {err}", file=sys.stderr)
            return 2
        except Exception as err:  # composition errors: misspelt key, wrong type, unknown option
            print(f"lightning-zero train: error: {explain(err)}", file=sys.stderr)
            return 2
        for line in dict.fromkeys(w for cfg in checked for w in config_warnings(cfg)):  # once, not per job
            print(f"lightning-zero train: warning: {line}", file=sys.stderr)
    register_configs()
    register_run_name()  # the output directories' names (conf/config.yaml)
    task = hydra.main(version_base="1.3", config_path=str(conf_dir()), config_name=CONFIG_NAME)(_hydra_task)
    saved = sys.argv
    sys.argv = ["lightning-zero train", *argv]  # hydra.main parses sys.argv
    try:
        task()
    except SystemExit as done:  # --help, or Hydra reporting a failed job
        return done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    finally:
        sys.argv = saved
        GlobalHydra.instance().clear()  # so that this process can compose again
    return 0
