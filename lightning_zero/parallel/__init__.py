"""Every parallelism applied to a module, and undone: one :func:`parallelize` returning one :class:`Parallelized`,
one :func:`release` taking it back (``parallelize``), on the strategy's one mesh (``mesh``: ``StrategyMesh``,
``open_mesh``, ``parallel_dims``).

Each parallelism is an ``apply_*`` of its module (as torchtitan's ``apply_tp`` / ``apply_fsdp``): ``pipeline``
(``apply_pipeline``, ``StrategyPipeline``: the split into this rank's stage, which applies tensor parallelism to the
stage), ``tensor`` (``apply_tensor_parallel``, ``StrategyTensorParallel``, ``refuse_pipeline_checkpoint``),
``sequence`` (``apply_sequence_parallel``, ``StrategySequenceParallel``), ``expert`` (``apply_expert_parallel``,
``StrategyExpertParallel``, ``expert_settings``, ``expert_size``, ``moe_layers``: each MoE layer keeps this rank's
experts, which ZeRO then partitions over the expert-data group), ``zero`` (``apply_zero``: the engine over what the
rank holds, ``model_parallel_coupling``, ``PrecisionPlugin``). The names are imported on first use (Note [lazy package
names] in ``core/lazy.py``): the pipeline and the composition import Lightning.
"""

from lightning_zero.core.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        "lightning_zero.parallel.expert": ("StrategyExpertParallel", "apply_expert_parallel", "expert_settings",
                                           "expert_size", "moe_layers"),
        "lightning_zero.parallel.mesh": ("StrategyMesh", "open_mesh", "parallel_dims"),
        "lightning_zero.parallel.parallelize": ("Parallelized", "Released", "parallelize", "release"),
        "lightning_zero.parallel.pipeline": ("StrategyPipeline", "apply_pipeline"),
        "lightning_zero.parallel.sequence": ("StrategySequenceParallel", "apply_sequence_parallel"),
        "lightning_zero.parallel.tensor": ("StrategyTensorParallel", "apply_tensor_parallel",
                                           "refuse_pipeline_checkpoint"),
        "lightning_zero.parallel.zero": ("PrecisionPlugin", "apply_zero", "model_parallel_coupling"),
    },
)
