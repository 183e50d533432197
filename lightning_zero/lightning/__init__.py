"""The Lightning strategy: ``ZeroStrategy`` and the parts it is made of.

Public pieces: ``ZeroStrategy`` (``strategy``), ``ZeroPrecision`` (``precision``), the composition order of every
parallelism (``compose``: ``apply_parallelisms``, ``release_parallelisms``). Its parts: how each Lightning step
runs (``steps``: ``StepDispatch``), state dicts and checkpoint files (``state``: ``StrategyCheckpointing``;
``state_files``), the mesh and what setup composes on it (``mesh_setup``: ``ParallelRun``), the constructor's
arguments checked (``compose``: ``StrategyOptions``), the registered names (``registry``), models built in
``configure_model`` (``sharded_build``) and uneven batches (``uneven``). ``own_bytes`` is a former path
(now ``lightning_zero.checkpoint.tensor_file``).
"""

from lightning_zero.lightning.compose import StrategyOptions, apply_parallelisms, release_parallelisms
from lightning_zero.lightning.mesh_setup import ParallelRun
from lightning_zero.lightning.precision import ZeroPrecision
from lightning_zero.lightning.state import StrategyCheckpointing
from lightning_zero.lightning.steps import StepDispatch
from lightning_zero.lightning.strategy import ZeroStrategy

__all__ = ["ParallelRun", "StepDispatch", "StrategyCheckpointing", "StrategyOptions", "ZeroPrecision", "ZeroStrategy",
           "apply_parallelisms", "release_parallelisms"]
