"""Pipeline parallelism beside ZeRO (2D: pipeline stages x sharded data parallel), on
``torch.distributed.pipelining``'s schedules. See docs/pipeline.md.

Files, one job each: ``config`` (the policy), ``partition`` (splitting layers into chunks), ``mesh``
(the 2D rank layout and its groups), ``model`` (the module protocol and the local split), ``runner``
(the schedules), ``lightning`` (what ``ZeroStrategy`` calls).
"""

from lightning_zero.pipeline.config import PipelineConfig

__all__ = ["PipelineConfig"]
