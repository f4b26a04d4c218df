"""Mixed precision: the policy a pipeline applies, the autocast state a recomputed forward runs
in again, and fp16 loss scaling decided by every rank together.

Autocast is thread-local state that a ``with torch.autocast(...)`` block sets around the
forward. A re-materialized partition runs its forward a second time during backward, outside
that block; run there as it is, it would compute in float32 what the first forward computed in
bfloat16, and its gradient would belong to another function (or a matrix product would see a
bf16 input beside an fp32 weight and fail). So every forward that will be recomputed records
the autocast state it ran in (:class:`AutocastState`, per micro-batch), and the recomputation
runs in exactly that state again::

    forward  (user's autocast, or the pipeline's policy)  ->  AutocastState.current()  saved
    backward (no autocast in force)                       ->  with saved.applied(): forward again

The policy (``precision="bf16"`` or ``"fp16"``) lets the pipeline apply autocast itself, on
each stage's device, so a user need not know where it must go; ``"fp32"`` leaves whatever the
caller set. With ``"fp16"``, gradients are scaled (:class:`LossScaler`): the last stage
backpropagates ``loss * scale``, every rank unscales its own gradients, and one all-reduce over
the pipeline group decides whether any of them is not finite; then every rank skips the step
(its gradients are dropped, so ``optimizer.step()`` does nothing) and backs the scale off, or
none does. Replicas of a stage agree too: their gradients were averaged before the check, so an
inf on one replica is an inf on all of them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .failure import collectives

__all__ = ["PRECISIONS", "AutocastState", "LossScaler", "check_precision"]

PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16")
_COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def check_precision(precision: str) -> None:
    """``precision`` is one of :data:`PRECISIONS`, or ValueError naming the choices."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not one of {list(PRECISIONS)} "
                         "('fp32' leaves autocast to the caller)")


@dataclass(frozen=True)
class AutocastState:
    """The autocast settings in force: ``(device_type, enabled, dtype)`` for the CPU and the
    stage's device type, and whether autocast caches its weight casts."""

    devices: tuple[tuple[str, bool, torch.dtype], ...]
    cache_enabled: bool

    @classmethod
    def current(cls, device: torch.device, precision: str = "fp32") -> AutocastState:
        """The state in force now on this thread, with ``precision``'s autocast switched on for
        ``device`` (unless ``"fp32"``, which keeps the caller's)."""
        types = ("cpu",) if device.type == "cpu" else ("cpu", device.type)
        devices = []
        for device_type in types:
            enabled = torch.is_autocast_enabled(device_type)
            dtype = torch.get_autocast_dtype(device_type)
            if device_type == device.type and precision != "fp32":
                enabled, dtype = True, _COMPUTE_DTYPES[precision]
            devices.append((device_type, enabled, dtype))
        return cls(tuple(devices), torch.is_autocast_cache_enabled())

    @property
    def enabled(self) -> bool:
        """Autocast is on for some device type."""
        return any(enabled for _, enabled, _ in self.devices)

    def applied(self, device: torch.device) -> AbstractContextManager[None]:
        """A context that runs its body in this state (nothing to do if it already holds)."""
        if self == AutocastState.current(device):
            return nullcontext()
        return self._entered()

    @contextmanager
    def _entered(self) -> Iterator[None]:
        with ExitStack() as stack:
            for device_type, enabled, dtype in self.devices:
                stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled,
                                                   cache_enabled=self.cache_enabled))
            yield


class LossScaler:
    """Dynamic loss scaling for float16, as ``torch.amp.GradScaler`` does it, with the
    skip-or-step decision taken by every rank of a pipeline at once.

    Each step: the loss is backpropagated times :attr:`scale`; :meth:`unscale_` multiplies the
    gradients by ``1 / scale`` (in float32, as GradScaler) and returns whether all ranks' are
    finite (one all-reduce over ``group``); :meth:`update` halves the scale after a non-finite
    step and doubles it after ``growth_interval`` finite ones in a row.
    """

    def __init__(self, init_scale: float = 2.0**16, *, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000) -> None:
        if not init_scale > 0 or not growth_factor > 1 or not 0 < backoff_factor < 1 or (
                growth_interval < 1):
            raise ValueError(
                f"LossScaler(init_scale={init_scale}, growth_factor={growth_factor}, "
                f"backoff_factor={backoff_factor}, growth_interval={growth_interval}): needs "
                "init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1, growth_interval >= 1")
        self.scale = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.finite_in_a_row = 0  # GradScaler's "growth tracker"
        self.steps_skipped = 0

    def unscale_(self, params: Sequence[Tensor], *, group: Any, device: torch.device) -> bool:
        """Unscale the gradients of ``params`` in place; True when every rank of ``group`` has
        only finite gradients (collective over ``group`` when torch.distributed is up)."""
        inv_scale = torch.full((), self.scale, dtype=torch.float64).reciprocal().float()
        found_inf = torch.zeros((), dtype=torch.float32, device=device)
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            # the kernel GradScaler uses: multiply by inv_scale, flag any non-finite value
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf,
                                                            inv_scale.to(device))
        if dist.is_initialized():
            with collectives("the fp16 loss scaler's inf/NaN check"):
                dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=group)
        return not bool(found_inf.item())

    def update(self, finite: bool) -> None:
        """The next step's scale, after a step whose gradients were (not) all finite."""
        if not finite:
            self.scale *= self.backoff_factor
            self.finite_in_a_row = 0
            self.steps_skipped += 1
            return
        self.finite_in_a_row += 1
        if self.finite_in_a_row == self.growth_interval:
            self.scale *= self.growth_factor
            self.finite_in_a_row = 0

    def state_dict(self) -> dict[str, Any]:
        """What resumes the scaler exactly (save it beside the optimizer's)."""
        return {"scale": self.scale, "growth_factor": self.growth_factor,
                "backoff_factor": self.backoff_factor, "growth_interval": self.growth_interval,
                "finite_in_a_row": self.finite_in_a_row, "steps_skipped": self.steps_skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("scale", "growth_factor", "backoff_factor", "growth_interval",
                    "finite_in_a_row", "steps_skipped"):
            setattr(self, key, type(getattr(self, key))(state[key]))
