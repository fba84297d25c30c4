"""What a captured step was made under beyond its batch: every submodule's train/eval mode and autocast.

Both change the graph a trace records without changing the model's code: dropout and
batch norm are traced as in training or evaluation, and autocast's casts are traced
into the graph as ``_to_copy`` ops. A plan runs the graph it was made for, so a call
under other conditions would silently train another step; :meth:`Conditions.check`
refuses it, naming what differs (docs/design.md, "The user's side of the contract").

The graph carries autocast's casts itself; it runs with autocast off
(:func:`autocast_off`), or an op the user computed outside autocast inside an autocast
region (a rotary embedding's ``enabled=False`` block) would be cast once more.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property

import torch

#: the device types whose autocast state a step records
AUTOCAST_DEVICES = ("cpu", "cuda")


def autocast_state() -> tuple[tuple[str, torch.dtype | None], ...]:
    """Per device type, the dtype autocast casts to here, ``None`` where it is off."""
    return tuple(
        (device, torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None)
        for device in AUTOCAST_DEVICES
    )


def module_modes(model: torch.nn.Module) -> tuple[tuple[str, bool], ...]:
    """``(qualified name, training)`` of the model and every submodule, in ``modules()`` order."""
    return tuple((name, module.training) for name, module in model.named_modules())


@dataclass(frozen=True)
class Conditions:
    """The modes and the autocast state a step was captured under."""

    modes: tuple[tuple[str, bool], ...]
    autocast: tuple[tuple[str, torch.dtype | None], ...]

    @staticmethod
    def of(model: torch.nn.Module) -> Conditions:
        """The conditions here and now, for ``model``."""
        return Conditions(module_modes(model), autocast_state())

    @cached_property
    def _flags(self) -> tuple[bool, ...]:
        return tuple(training for _, training in self.modes)

    def check(self, model: torch.nn.Module) -> None:
        """A ``ValueError`` naming the first submodule whose mode differs, or the autocast
        state that differs, from the ones the step was captured under."""
        if tuple(m.training for m in model.modules()) != self._flags:  # names only when something differs
            for (name, training), (recorded_name, recorded) in zip(module_modes(model), self.modes):
                if name != recorded_name:
                    break
                if training != recorded:
                    raise ValueError(
                        f"{_module(name)} is in {_mode(training)} mode; the plan was made with it in "
                        f"{_mode(recorded)} mode (set it back, or optimize again for this mode)"
                    )
            raise ValueError("the model has other submodules than the plan was made for")
        now = autocast_state()
        for (device, dtype), (_, recorded) in zip(now, self.autocast):
            if dtype != recorded:
                raise ValueError(
                    f"the plan was made with {_autocast(device, recorded)} and is called with "
                    f"{_autocast(device, dtype)}: call it under the autocast it was optimized under, "
                    "or optimize again"
                )


def warn_if_evaluating(model: torch.nn.Module) -> None:
    """Optimizing a model in eval mode (what ``from_pretrained`` returns) plans an evaluation-mode step."""
    if not model.training:
        warnings.warn(
            "the model is in eval mode: dropout and batch norm are captured as in evaluation "
            "(call model.train() before magis.optimize to train with them)",
            stacklevel=3,
        )


@contextlib.contextmanager
def autocast_off() -> Iterator[None]:
    """Autocast off on every device where it is on (module docstring)."""
    with contextlib.ExitStack() as stack:
        for device, dtype in autocast_state():
            if dtype is not None:
                stack.enter_context(torch.autocast(device, enabled=False))
        yield


def _module(name: str) -> str:
    return f"submodule {name!r}" if name else "the model"


def _mode(training: bool) -> str:
    return "training" if training else "eval"


def _autocast(device: str, dtype: torch.dtype | None) -> str:
    return f"autocast off on {device}" if dtype is None else f"torch.autocast({device!r}, dtype={dtype})"
