"""DeepSpeed keys that ask for a feature lightning_zero does not build and that would change what is
computed or stored: refused before anything runs, in one line naming each key.

Note [refused, warned, accepted]: every DeepSpeed key falls in one of four classes (the tables are
in docs/deepspeed_config.md). *Supported* keys are mapped onto lightning_zero's settings;
*accepted* keys carry the value lightning_zero has anyway (``contiguous_gradients: true``);
*performance hints and monitors* (``aio``, ``allgather_bucket_size``, ``tensorboard``, ...) are
named in one warning (strict: an error), because training without them computes the same model;
*refused* keys (this table) ask for another computation or another stored state -- quantized
collectives, compressed or pruned weights, other batches, other
checkpoint contents -- so a run without them would silently be a different experiment. A refused
section is one present and not switched off with ``"enabled": false``; a refused scalar is one
whose value differs from DeepSpeed's default (the default itself is accepted).

(``sparse_attention`` is not in this table: it is handled on its own.)
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


def _section_on(value: Any) -> bool:
    """A section asks for its feature unless it is empty, ``false``, or says ``"enabled": false``."""
    if isinstance(value, Mapping):
        return bool(value) and value.get("enabled", True) is not False
    return value not in (None, False, "auto")


def _any_technique_on(value: Any) -> bool:
    """``compression_training`` has no switch of its own: each technique's ``shared_parameters.enabled``
    (DeepSpeed's default ``false``) turns that technique on, so the section asks for something only when
    one of them says ``"enabled": true``."""
    if isinstance(value, Mapping):
        return value.get("enabled") is True or any(_any_technique_on(v) for v in value.values())
    return False


def _true(value: Any) -> bool:
    return value is True


def _above_one(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 1


@dataclass(frozen=True)
class Refusal:
    """One refused key: where it is, when its value asks for the feature, and what the feature does."""

    path: tuple[str, ...]
    asks: Callable[[Any], bool]
    feature: str


REFUSED: tuple[Refusal, ...] = (
    Refusal(("compression_training",), _any_technique_on, "compression-aware training: quantized or pruned weights and "
                                                    "activations, layer reduction"),
    Refusal(("data_efficiency",), _section_on, "data sampling and routing: curriculum learning, random-LTD token "
                                               "dropping"),
    Refusal(("curriculum_learning",), _section_on, "curriculum learning: other sequence lengths per step"),
    Refusal(("progressive_layer_drop",), _section_on, "progressive layer dropping"),
    Refusal(("quantize_training",), _section_on, "MoQ quantized training"),
    Refusal(("eigenvalue",), _section_on, "eigenvalue-driven quantization schedules"),
    Refusal(("elasticity",), _section_on, "elastic training: the batch size chosen by the world size"),
    Refusal(("hybrid_engine",), _section_on, "the hybrid (RLHF) engine: inference kernels in training"),
    Refusal(("nebula",), _section_on, "Nebula checkpointing: checkpoints stored by another service"),
    Refusal(("weight_quantization",), _section_on, "quantized weights"),
    Refusal(("torch_autocast",), _section_on, "DeepSpeed's torch.autocast mode (use fp16 / bf16)"),
    Refusal(("amp", "enabled"), _true, "NVIDIA apex AMP (use fp16 / bf16)"),
    Refusal(("checkpoint", "load_universal"), _true, "loading a universal checkpoint"),
    Refusal(("fp16", "fp16_master_weights_and_grads"), _true, "fp16 master weights and gradients (no fp32 copy)"),
    Refusal(("zero_optimization", "zero_quantized_weights"), _true, "ZeRO++ quantized weight all-gathers (qwZ)"),
    Refusal(("zero_optimization", "zero_quantized_nontrainable_weights"), _true,
            "ZeRO++ quantized frozen weights"),
    Refusal(("zero_optimization", "zero_quantized_gradients"), _true, "ZeRO++ quantized gradient reduction (qgZ)"),
    Refusal(("zero_optimization", "zero_hpz_partition_size"), _above_one,
            "ZeRO++ hierarchical partitioning (hpZ): a second weight partition per node group"),
    Refusal(("zero_optimization", "zeropp_loco_param"), _section_on, "ZeRO++ LoCo error-compensated gradients"),
    Refusal(("zero_optimization", "mics_shard_size"), lambda v: _above_one(v) or v == 1,  # DeepSpeed's default: -1
            "MiCS: states sharded within sub-groups of ranks"),
    Refusal(("zero_optimization", "mics_hierarchical_params_gather"), _true, "MiCS hierarchical gathers"),
    Refusal(("zero_optimization", "load_from_fp32_weights"), lambda v: v is False,
            "masters restored from the 16-bit weights at load"),
    Refusal(("zero_optimization", "stage3_gather_16bit_weights_on_model_save"), _true,
            "a consolidated 16-bit state dict saved with the model (lightning_zero saves sharded checkpoints: "
            "see docs/checkpoints.md to consolidate)"),
    Refusal(("zero_optimization", "stage3_gather_fp16_weights_on_model_save"), _true,
            "a consolidated 16-bit state dict saved with the model (see docs/checkpoints.md to consolidate)"),
)


def _lookup(data: Mapping[str, Any], path: tuple[str, ...]) -> tuple[bool, Any]:
    node: Any = data
    for part in path:
        if not isinstance(node, Mapping) or part not in node:
            return False, None
        node = node[part]
    return True, node


def refused_keys(data: Mapping[str, Any]) -> list[tuple[str, Any, str]]:
    """``(dotted key, value, feature)`` for every key of the raw JSON ``data`` that asks for a refused feature."""
    out = []
    for refusal in REFUSED:
        found, value = _lookup(data, refusal.path)
        if found and refusal.asks(value):
            out.append((".".join(refusal.path), value, refusal.feature))
    return out


def refusal_message(source: str, refused: list[tuple[str, Any, str]]) -> str:
    """The one line that refuses ``refused`` (see :func:`refused_keys`)."""
    keys = "; ".join(f"`{key}`={json.dumps(value)} ({feature})" for key, value, feature in refused)
    return (f"DeepSpeed config {source}: not built in lightning_zero, and training without it would compute or store "
            f"something else: {keys}. Fix: remove the key(s) (or set DeepSpeed's default); see "
            "docs/deepspeed_config.md.")


_UNBUILT_WHY = {"buffer_count": "parameter shards are read straight into the gather buffers, with no pool of "
                                "parameter swap buffers to count (zero_optimization.stage3_prefetch_bucket_size "
                                "bounds how much is read ahead)",
                "buffer_size": "parameter shards are read straight into the gather buffers, with no pool of "
                               "parameter swap buffers to size",
                "max_in_cpu": "every parameter shard offloaded to nvme is on disk"}


def refuse_unbuilt(key: str, value: int | None, default: int) -> None:
    """An ``offload_param`` I/O knob (``buffer_count``, ``buffer_size``, ``max_in_cpu``) at DeepSpeed's default is
    accepted (there is nothing to size); another value is refused, naming ``key`` (its dotted JSON path)."""
    if value is not None and value != default:
        why = _UNBUILT_WHY[key.rsplit(".", 1)[-1]]
        raise ValueError(f"DeepSpeed config: `{key}`={value} is not built: {why}. Fix: remove the key (or give "
                         f"DeepSpeed's default {default:g}).")
