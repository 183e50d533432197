"""One rank of a run: ``python -m lightning_zero.config.worker <run_dir>/config.yaml``.

Started by :func:`lightning_zero.config.launch.launch_ranks` under ``torch.distributed.run`` (which
sets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT``, so Lightning joins that
group instead of re-launching ``sys.argv``). It never touches Hydra: the composed, resolved config
is read from the YAML file, and everything is written next to it. It also works under any other
``torchrun`` / ``srun`` launch of the same command, e.g. on several nodes.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from omegaconf import OmegaConf
from torch.distributed.elastic.multiprocessing.errors import record

from lightning_zero.config.build import fit
from lightning_zero.config.schema import to_train_config
from lightning_zero.config.validate import validate_config
from lightning_zero.core.comm.process_groups import close_all


@record  # torchrun's failure summary then shows this rank's traceback
def main(argv: Sequence[str] | None = None) -> int:
    """Run the rank; the run directory is the config file's folder. Returns the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m lightning_zero.config.worker <run_dir>/config.yaml", file=sys.stderr)
        return 2
    path = Path(args[0]).resolve()
    cfg = validate_config(to_train_config(OmegaConf.to_container(OmegaConf.load(path))))  # type: ignore[arg-type]
    try:
        fit(cfg, path.parent)
    finally:
        # the process groups (the strategy's too) die now, not during interpreter finalization:
        # Note [clean exit] in lightning_zero/core/comm/process_groups.py
        close_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
