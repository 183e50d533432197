"""The MLP classifier's pieces without Lightning: its layers (:func:`mlp_layers`, which the config checks count) and
its synthetic "random teacher" task: the data (:func:`teacher_dataset`) and the arguments of ``TeacherDataModule``
with their defaults (:class:`TeacherTask`), which ``config/schema.py``'s ``data=teacher`` option mirrors (the
launcher imports no Lightning: Note [lazy package names] in ``core/lazy.py``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import TensorDataset


@dataclass(frozen=True)
class TeacherTask:
    """The arguments of :class:`~lightning_zero.models.mlp.TeacherDataModule`, each default written once, here."""

    num_train: int = 4096
    num_val: int = 1024
    input_dim: int = 32
    num_classes: int = 10
    micro_batch_size: int = 64
    num_workers: int = 0
    seed: int = 0
    deterministic_order: bool = False


def teacher_dataset(
    num_samples: int, input_dim: int = 32, num_classes: int = 10, seed: int = 0, teacher_hidden: int = 64
) -> TensorDataset:
    """Gaussian inputs labelled by the argmax of a fixed random 2-layer tanh "teacher" network.

    The teacher is drawn from ``seed`` only, so datasets with different ``num_samples`` share the task.
    """
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(input_dim, teacher_hidden, generator=g) / input_dim**0.5
    w2 = torch.randn(teacher_hidden, num_classes, generator=g) / teacher_hidden**0.5
    x = torch.randn(num_samples, input_dim, generator=torch.Generator().manual_seed(seed + 1))
    y = (torch.tanh(x @ w1) @ w2).argmax(dim=1)
    return TensorDataset(x, y)


def mlp_layers(input_dim: int, hidden_dim: int, num_layers: int, num_classes: int) -> tuple[nn.ModuleList, nn.Linear]:
    """``num_layers`` hidden ``Linear`` layers (``blocks``) and the linear head of
    :class:`~lightning_zero.models.mlp.MLPClassifier`, built on the current default device."""
    dims = [input_dim] + [hidden_dim] * num_layers
    return nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(dims)), nn.Linear(dims[-1], num_classes)
