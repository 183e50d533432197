"""``ExpertParallelConfig``: how many ranks split each MoE layer's experts; checked when built."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExpertParallelConfig:
    """Expert parallelism (docs/expert_parallel.md): each MoE layer's experts split over ``size`` ranks of the
    data dimension, tokens sent to their experts' ranks.

    Args:
        size: ranks per expert-parallel group (E / size experts each); 1: off. The data ranks are
            ``expert_data x size`` (Note [expert axes] in core/mesh/dims.py).
    """

    size: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or isinstance(self.size, bool) or self.size < 1:
            raise ValueError(f"expert_parallel size must be a positive integer, got {self.size!r}")

    @property
    def enabled(self) -> bool:
        return self.size > 1

    @classmethod
    def coerce(cls, value: int | ExpertParallelConfig | None) -> ExpertParallelConfig | None:
        """``ZeroStrategy(expert_parallel=...)``: an int size, a config, or ``None`` (the MoE layers' own
        ``ep_size``, else off)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return cls(size=value)
        raise TypeError(f"expert_parallel must be an int or an ExpertParallelConfig, got {value!r}")


# DeepSpeed's ``expert_parallel`` section (AutoEP): the keys it reads, each mapped or refused by name
DEEPSPEED_SECTION = "expert_parallel"
DEEPSPEED_PRESETS = ("mixtral", "qwen3_moe", "deepseek_v2", "deepseek_v3", "llama4")
_REFUSED = {
    "layer_specs": "manual MoE layer specs are not built: the layers are found from the model (lightning_zero.moe "
                   "layers, the GPT's model.moe, a Hugging Face MoE's base_model_ep_plan)",
    "load_balance_coeff": "the load-balancing loss is the model's own (its router_aux_loss_coef, the GPT's "
                          "model.moe.aux_loss_coef, MoE's l_aux)",
    "use_grouped_mm": "the experts always run as grouped products",
    "combine_impl": "the combine is the reverse all-to-all",
}
_DEFAULTS = {"layer_specs": [], "load_balance_coeff": None, "use_grouped_mm": True}


def expert_parallel_from_deepspeed(section: object, used: set[str], unsupported: list[str]) -> int:
    """The expert-parallel size a DeepSpeed ``expert_parallel`` section asks for (1: off or absent): ``enabled`` and
    ``autoep_size`` set it, ``preset_model`` is checked against DeepSpeed's preset names (the layers are found
    from the model either way); the other keys DeepSpeed reads are refused by name when they ask for something
    not built, unknown ones reported in ``unsupported``; ``used`` gets the section's name.

    Raises:
        ValueError: a bad ``autoep_size`` / ``preset_model``, or a refused key (named, with why).
    """
    if section is None:
        return 1
    if not isinstance(section, dict):
        raise ValueError(f"DeepSpeed config: `{DEEPSPEED_SECTION}` must be a JSON object, got {section!r}.")
    used.add(DEEPSPEED_SECTION)
    size = section.get("autoep_size", 1)
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"DeepSpeed config: `{DEEPSPEED_SECTION}.autoep_size` must be an integer >= 1, got {size!r}.")
    preset = section.get("preset_model")
    if preset is not None and preset not in DEEPSPEED_PRESETS:
        raise ValueError(f"DeepSpeed config: `{DEEPSPEED_SECTION}.preset_model`={preset!r} is not one of DeepSpeed's "
                         f"presets {list(DEEPSPEED_PRESETS)}.")
    refused = [(k, v) for k, v in section.items() if k in _REFUSED and v != _DEFAULTS.get(k, object())]
    if refused:
        named = "; ".join(f"`{DEEPSPEED_SECTION}.{k}`={v!r} is not built ({_REFUSED[k]})" for k, v in refused)
        raise ValueError(f"DeepSpeed config: {named}. Fix: remove the key(s); `enabled` and `autoep_size` set "
                         "expert parallelism.")
    known = {"enabled", "autoep_size", "preset_model", *_REFUSED}
    unsupported.extend(f"{DEEPSPEED_SECTION}.{k}" for k in section if k not in known)
    return size if section.get("enabled", False) else 1
