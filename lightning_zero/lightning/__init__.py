"""The Lightning strategy: ``ZeroStrategy`` and the parts it is made of.

Public pieces: ``ZeroStrategy`` (``strategy``), ``ZeroPrecision`` (``precision``), the composition order of every
parallelism (``compose``: ``apply_parallelisms``, ``release_parallelisms``). Its parts: how each Lightning step
runs (``steps``: ``StepDispatch``), state dicts and checkpoint files (``state``: ``StrategyCheckpointing``;
``state_files``), the mesh (``mesh_setup``), the registered names (``registry``), models built in
``configure_model`` (``sharded_build``) and uneven batches (``uneven``). ``own_bytes`` is a former path
(now ``lightning_zero.checkpoint.tensor_file``).
"""

from lightning_zero.lightning.compose import apply_parallelisms, release_parallelisms
from lightning_zero.lightning.precision import ZeroPrecision
from lightning_zero.lightning.state import StrategyCheckpointing
from lightning_zero.lightning.steps import StepDispatch
from lightning_zero.lightning.strategy import ZeroStrategy

__all__ = ["StepDispatch", "StrategyCheckpointing", "ZeroPrecision", "ZeroStrategy", "apply_parallelisms",
           "release_parallelisms"]
