"""``checkpoint-block`` and ``checkpoint-sqrt``: activation checkpointing as practitioners apply it.

``checkpoint-block`` checkpoints every block (transformers' ``gradient_checkpointing_enable()``,
or ``torch.utils.checkpoint`` around each block of other models); ``checkpoint-sqrt`` √n segments
of blocks (Chen et al. 2016). Both change a rebuild of the model
(:mod:`yardstick.peers.checkpointing`) and are simulated as eager autograd runs them
(:mod:`yardstick.peers.checkpointed_capture`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from magis.models import Built
from yardstick.methods.method_registry import PEER, Method, Runnable, Simulated, register
from yardstick.methods.steps import eager_runnable, traced
from yardstick.methods.subject import Subject
from yardstick.peers.checkpointed_capture import capture_checkpointed
from yardstick.peers.checkpointing import checkpoint_every_block, checkpoint_sqrt_segments

Steps = tuple[Callable[[Subject, float | None], Runnable], Callable[[Subject, float | None], Simulated]]


def checkpointing(apply: Callable[[torch.nn.Module, tuple], Any]) -> Steps:
    """``real`` and ``simulate`` of a checkpointing peer: ``apply(model, inputs)`` changes a rebuild."""

    def checkpointed(subject: Subject) -> Built:
        built = subject.rebuild()
        apply(built.model, tuple(built.example_inputs))
        return built

    def real(subject: Subject, _budget: float | None) -> Runnable:
        return eager_runnable(checkpointed(subject), subject)

    def simulate(subject: Subject, _budget: float | None) -> Simulated:
        return traced(subject, checkpointed(subject), capture_checkpointed)

    return real, simulate


#: every block checkpointed, alone or over micro-batches (``accumulate@k+checkpoint-block``)
CHECKPOINT_BLOCK = checkpointing(lambda model, _inputs: checkpoint_every_block(model))

register(
    Method(
        "checkpoint-block",
        "activation checkpointing of every block (transformers gradient_checkpointing_enable, torch.utils.checkpoint)",
        PEER,
        *CHECKPOINT_BLOCK,
    )
)
register(
    Method(
        "checkpoint-sqrt",
        "checkpointing of sqrt(n) segments of blocks (Chen et al. 2016)",
        PEER,
        *checkpointing(checkpoint_sqrt_segments),
    )
)
