"""1-bit Adam (Tang et al., 2021): Adam whose momentum is communicated as 1-bit signs after a warm-up.

Algorithm, per optimizer step t (1-based), on N data-parallel ranks:

* **Warm-up** (t <= ``freeze_step``): exactly AdamW (decoupled weight decay, bias correction),
  on gradients averaged over the ranks by the ZeRO engine's ordinary all-reduce.
* **Compression stage** (t > ``freeze_step``): the variance ``v`` is frozen at its value after
  step ``freeze_step``. Gradients stay local (the engine does not all-reduce them: see
  :meth:`OneBitAdam.reduces_gradients_itself`); each rank updates its momentum with its own
  gradient, then the momenta are averaged by the 1-bit compressed all-reduce with error feedback
  on workers and servers (``compressed_allreduce.py``), and the averaged momentum replaces every
  rank's. The update is ``m_hat / (sqrt(v_hat_frozen) + eps)`` as in the warm-up, so the
  parameters stay identical on every rank.

Works at ZeRO stage 0 only: the compressed all-reduce averages every rank's whole momentum,
built from its whole local gradient; stages 1-3 keep a shard of the optimizer state (and stages
2-3 a shard of the gradients) per rank, so no rank has the whole local momentum to compress.
(Stage 1 could compress a reduce-scatter to the shard owners and all-gather the parameters; it is
not built.) The engine refuses other stages with this reason.

Checkpoints: the per-parameter state is torch's AdamW layout (``step``, ``exp_avg``,
``exp_avg_sq``); the error-feedback residuals differ per rank, so :meth:`state_dict` gathers them
from every rank (a collective: every rank calls it, as Lightning does when saving) and
:meth:`load_state_dict` gives each rank its own back. Resumed at another world size, the residuals
restart from zero (a warning says so): they are a correction carried between steps, not state
the model depends on.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim import Optimizer

from lightning_zero.core.comm.compressed_allreduce import CompressedAllReduce, padded_numel
from lightning_zero.core.comm.data_parallel import DataParallelComm

_KEY = "onebit"  # the optimizer-state entry of the compression state (not a parameter)


class OneBitAdam(Optimizer):
    """1-bit Adam (see the module doc). Use it with ``ZeroStrategy(stage=0)``.

    Args:
        params: parameters or param-group dicts, as for ``torch.optim.AdamW``.
        lr: learning rate.
        freeze_step: warm-up steps of full-precision AdamW before the variance is frozen and
            the momentum is compressed (DeepSpeed's name; the paper suggests ~15-25% of training).
        betas: Adam's (beta1, beta2).
        eps: added to the denominator.
        weight_decay: decoupled weight decay (AdamW's).
        error_feedback: keep the compression residuals (turning it off is the paper's ablation).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        freeze_step: int = 100_000,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        error_feedback: bool = True,
    ) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"OneBitAdam needs lr, eps and weight_decay >= 0, got {lr}, {eps}, {weight_decay}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"OneBitAdam's betas must lie in [0, 1), got {betas}")
        if int(freeze_step) != freeze_step or freeze_step < 1:
            raise ValueError(
                f"freeze_step must be a whole number >= 1 (the variance is frozen after that many AdamW steps), "
                f"got {freeze_step}"
            )
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})
        self.freeze_step = int(freeze_step)
        self.error_feedback = error_feedback
        self.comm: DataParallelComm | None = None  # the data-parallel group (bind_comm; default group otherwise)
        self._reducer: CompressedAllReduce | None = None  # built on the first compressed step
        self._pending_residuals: dict[str, Any] | None = None  # loaded before the reducer existed
        self.last_step_bytes: int = 0  # bytes the last step's compressed all-reduce sent (0 in warm-up)
        self.last_compression_ratio: float | None = None  # fp32 all-reduce bytes / bytes sent, last compressed step

    # ----------------------------------------------------------------------------- engine protocol
    def bind_comm(self, comm: DataParallelComm) -> None:
        """The data-parallel group to average momenta over (the ZeRO engine calls this)."""
        self.comm = comm

    @property
    def steps_done(self) -> int:
        """Optimizer steps taken so far (the same on every rank)."""
        return int(self.state.get(_KEY, {}).get("steps", 0))

    def reduces_gradients_itself(self) -> bool:
        """Whether the next step communicates itself (compression stage): then the engine leaves
        the gradients local instead of all-reducing them."""
        return self.steps_done >= self.freeze_step

    # ----------------------------------------------------------------------------- step
    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        compressing = self.reduces_gradients_itself()
        t = self.steps_done + 1
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                grad = p.grad if p.grad is not None else torch.zeros_like(p)
                state["step"].fill_(t)
                state["exp_avg"].lerp_(grad, 1 - beta1)
                if not compressing:
                    state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        if compressing:
            self._average_momenta()
        else:
            self.last_step_bytes, self.last_compression_ratio = 0, None
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            bias1 = 1 - beta1**t
            bias2 = 1 - beta2 ** min(t, self.freeze_step)  # the variance stops at step freeze_step
            for p in group["params"]:
                state = self.state[p]
                if wd:
                    p.mul_(1 - lr * wd)
                denom = (state["exp_avg_sq"].sqrt() / bias2**0.5).add_(eps)  # torch AdamW's arithmetic
                p.addcdiv_(state["exp_avg"], denom, value=-lr / bias1)
        self.state.setdefault(_KEY, {})["steps"] = t
        return loss

    def _average_momenta(self) -> None:
        comm = self.comm if self.comm is not None else DataParallelComm()
        momenta = [self.state[p]["exp_avg"] for p in self._params()]
        numel = sum(m.numel() for m in momenta)
        padded = padded_numel(numel, comm.world_size)
        if self._reducer is None:
            self._reducer = CompressedAllReduce(padded, comm, self.error_feedback)
            if self._pending_residuals is not None:
                self._restore_residuals(self._pending_residuals)
                self._pending_residuals = None
        flat = torch.zeros(padded, dtype=torch.float32, device=momenta[0].device if momenta else "cpu")
        offset = 0
        for m in momenta:
            flat[offset : offset + m.numel()].copy_(m.reshape(-1))
            offset += m.numel()
        mean = self._reducer(flat)
        offset = 0
        for m in momenta:
            m.copy_(mean[offset : offset + m.numel()].view_as(m))
            offset += m.numel()
        self.last_step_bytes = self._reducer.last_bytes_sent
        n = comm.world_size
        fp32_bytes = 2 * (n - 1) * numel * 4 // max(n, 1)
        self.last_compression_ratio = fp32_bytes / self.last_step_bytes if self.last_step_bytes else None

    # ----------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """torch's layout plus every rank's residuals (a collective once compression has started)."""
        out = super().state_dict()
        extra = dict(out["state"].get(_KEY, {}))
        if self._reducer is not None:
            comm = self._reducer.comm
            worker, server = self._reducer.residuals()
            all_worker = torch.empty(comm.world_size * worker.numel(), dtype=worker.dtype, device=worker.device)
            all_server = torch.empty(comm.world_size * server.numel(), dtype=server.dtype, device=server.device)
            comm.all_gather(all_worker, worker)
            comm.all_gather(all_server, server)
            extra.update(world_size=comm.world_size, worker_residuals=all_worker.view(comm.world_size, -1).cpu(),
                         server_residuals=all_server.view(comm.world_size, -1).cpu())
        out["state"] = {**out["state"], _KEY: extra}
        return out

    def warmup_outlasts(self, max_steps: int) -> str | None:
        """Why a run of ``max_steps`` optimizer steps (-1: no limit) would never compress, or None."""
        if max_steps is None or max_steps < 1 or max_steps > self.freeze_step:
            return None
        return (f"OneBitAdam(freeze_step={self.freeze_step}) with max_steps={max_steps}: the AdamW warm-up lasts the "
                f"whole run, so nothing is ever compressed. Fix: freeze_step={max(1, max_steps // 2)} (DeepSpeed "
                "JSON: optimizer.params.freeze_step; Hydra: model.freeze_step), or train longer.")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = dict(state_dict["state"])
        extra = dict(state.pop(_KEY, {}))
        super().load_state_dict({**state_dict, "state": state})
        self.state[_KEY] = {"steps": int(extra.get("steps", 0))}
        self._reducer = None
        self._pending_residuals = extra if "worker_residuals" in extra else None

    def _restore_residuals(self, saved: dict[str, Any]) -> None:
        assert self._reducer is not None
        comm = self._reducer.comm
        worker, server = saved["worker_residuals"], saved["server_residuals"]
        if saved.get("world_size") != comm.world_size or worker.shape[1] != self._reducer.chunk * comm.world_size:
            warnings.warn(
                f"OneBitAdam: the checkpoint's error-feedback residuals are from {saved.get('world_size')} ranks, "
                f"this run has {comm.world_size}; they restart from zero (only the next steps' compression "
                "error is affected).",
                stacklevel=2,
            )
            return
        self._reducer.load_residuals(worker[comm.rank].to(comm.device), server[comm.rank].to(comm.device))
