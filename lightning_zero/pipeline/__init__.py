"""Pipeline parallelism beside ZeRO and tensor parallelism (pipeline stages x sharded data x tensor), on
``torch.distributed.pipelining``'s schedules. See docs/pipeline.md.

Files, one job each: ``config`` (the policy), ``partition`` (splitting layers into chunks), ``mesh``
(the pipeline's view of the process mesh: its stage and tie groups), ``model`` (the module protocol and the
local split), ``build`` (only the local stage materialised), ``runner`` (the schedules), ``checkpoint`` (a
stage's part of a checkpoint), ``lightning`` (what ``ZeroStrategy`` calls). Only ``PipelineConfig`` is named
here: it is what users and the configs import; the other pieces import the strategy's layers and are reached
through ``lightning``.
"""

from lightning_zero.core.settings.pipeline import PipelineConfig

__all__ = ["PipelineConfig"]
