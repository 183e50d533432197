"""DeepSpeed's ``tensor_parallel`` section (AutoTP training): ``autotp_size`` drives ``tensor_parallel=N``.

DeepSpeed's keys of the section (its ``TPTrainingConfig``) each are mapped or refused by name:

==============================  ===========================================================================
``autotp_size``                 ``ZeroStrategy(tensor_parallel=N)`` / ``tensor_parallel.size=N`` (0, 1: off)
``tp_overlap_comm``             refused when ``true`` (TP all-reduces overlapped with compute: not built)
``keep_module_on_host``         refused when ``true`` (the module is sliced where it was built, then moved)
``replace_with_kernel_inject``  refused when ``true`` (DeepSpeed's inference kernels)
``injection_policy_tuple``      refused unless ``null`` (give a plan: ``TensorParallelConfig(plan=...)``)
``tensor_parallel.tp_size``     refused unless 1 or equal to ``autotp_size`` (``autotp_size`` sets the size)
``tensor_parallel.tp_grain_size``  refused unless 1 (uneven slices are not built)
``dtype``                       refused unless absent (the precision is the ``fp16`` / ``bf16`` sections')
==============================  ===========================================================================

Any other key of the section is named in the unsupported-keys warning (strict: an error), as elsewhere.
"""

from __future__ import annotations

from typing import Any

SECTION = "tensor_parallel"
_WHY = {
    "tp_overlap_comm": "TP all-reduces overlapped with compute are not built",
    "keep_module_on_host": "the module is sliced where it was built, then moved to the device; keeping it on the "
                           "host is not built",
    "replace_with_kernel_inject": "DeepSpeed's inference kernels are not built",
    "injection_policy_tuple": "an injection policy is DeepSpeed's plan: give lightning_zero's plan instead "
                              "(TensorParallelConfig(plan=...) or the model's tensor_parallel_plan)",
    "dtype": "the precision is the fp16 / bf16 sections'",
}
_DEFAULTS: dict[str, Any] = {"tp_overlap_comm": False, "keep_module_on_host": False,
                             "replace_with_kernel_inject": False, "injection_policy_tuple": None}


def parse_tensor_parallel(section: Any, used: set[str], unsupported: list[str]) -> int:
    """The TP size the ``tensor_parallel`` section asks for (1: off); ``used`` gets the keys read, ``unsupported``
    the unknown ones (dotted).

    Raises:
        ValueError: a bad ``autotp_size``, or a key whose value asks for something not built (named, with why).
    """
    if section is None:
        return 1
    if not isinstance(section, dict):
        raise ValueError(f"DeepSpeed config: `{SECTION}` must be a JSON object, got {section!r}.")
    size = section.get("autotp_size", 0)
    if size in (None, "auto"):
        size = 0
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise ValueError(f"DeepSpeed config: `{SECTION}.autotp_size` must be an integer >= 0, got {size!r}.")
    size = max(size, 1)
    refused = [(k, section[k]) for k in _WHY if k in section and section[k] != _DEFAULTS.get(k, object())]
    inner = section.get("tensor_parallel")
    if inner is not None:
        if not isinstance(inner, dict):
            raise ValueError(f"DeepSpeed config: `{SECTION}.tensor_parallel` must be a JSON object, got {inner!r}.")
        if inner.get("tp_size", 1) not in (1, size):
            refused.append(("tensor_parallel.tp_size", inner["tp_size"]))
        if inner.get("tp_grain_size", 1) != 1:
            refused.append(("tensor_parallel.tp_grain_size", inner["tp_grain_size"]))
        unsupported.extend(f"{SECTION}.tensor_parallel.{k}" for k in inner if k not in ("tp_size", "tp_grain_size"))
    if refused:
        why = {"tensor_parallel.tp_size": "autotp_size sets the TP size",
               "tensor_parallel.tp_grain_size": "uneven slices are not built", **_WHY}
        raise ValueError("DeepSpeed config: " + "; ".join(
            f"`{SECTION}.{k}`={v!r} is not built ({why[k]})" for k, v in refused) +
            ". Fix: remove the key(s) (or set DeepSpeed's default); `autotp_size` alone sets tensor parallelism.")
    known = {"autotp_size", "tensor_parallel", *_WHY}
    unsupported.extend(f"{SECTION}.{k}" for k in section if k not in known)
    used.add(SECTION)
    return size
