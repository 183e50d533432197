"""The Lightning strategy: ``ZeroStrategy`` and the parts it is made of.

Public pieces: ``ZeroStrategy`` (``strategy``), ``ZeroPrecision`` (``precision``). Its parts: the
composition order of every parallelism (``compose``: ``apply_parallelisms``), how each Lightning step
runs (``steps``: ``StepDispatch``), state dicts and checkpoint files (``state``: ``StrategyCheckpointing``,
``state_files``, ``own_bytes``), models built in ``configure_model`` (``sharded_build``) and uneven
batches (``uneven``).
"""
