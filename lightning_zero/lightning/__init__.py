"""The Lightning strategy: ``ZeroStrategy`` and the parts it is made of.

Public pieces: ``ZeroStrategy`` (``strategy``), ``ZeroPrecision`` (``precision``). Its parts: how each Lightning
step runs (``steps``: ``StepDispatch``), state dicts and checkpoint files (``state``: ``StrategyCheckpointing``;
``state_files``), the mesh and what each setup parallelizes on it (``run``: ``ParallelRun``; the composition itself
is ``lightning_zero/parallel``), the constructor's
arguments as the settings tree (``arguments``: ``strategy_arguments``), the registered names (``registry``), models
built in ``configure_model`` (``sharded_build``) and uneven batches (``uneven``). The names are imported on first use
(Note [lazy package names] in ``core/lazy.py``): ``registry`` is read without importing Lightning.
"""

from lightning_zero.core.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        "lightning_zero.lightning.arguments": ("StrategyArguments", "strategy_arguments"),
        "lightning_zero.lightning.run": ("ParallelRun",),
        "lightning_zero.lightning.precision": ("ZeroPrecision",),
        "lightning_zero.lightning.state": ("StrategyCheckpointing",),
        "lightning_zero.lightning.steps": ("StepDispatch",),
        "lightning_zero.lightning.strategy": ("ZeroStrategy",),
    },
)
