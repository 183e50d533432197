"""DeepSpeed's ``expert_parallel`` JSON section (AutoEP) read into the expert-parallel size, the settings tree's
``parallel.expert`` node (``ExpertParallelConfig``, core/settings/expert.py)."""

from __future__ import annotations

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
