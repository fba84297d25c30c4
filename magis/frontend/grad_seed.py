"""The backward's seed as a constant a plan fills per call: mixed precision's loss scaling.

AOTAutograd seeds the captured backward with ``ones_like(loss)``. A ``GradScaler`` step,
``scaler.scale(loss).backward()``, seeds it in effect with the scale ``s``: the
backward of ``loss * s`` hands the loss the gradient ``1 * s``, in the loss's dtype, and
every gradient is computed from there (fp16 gradients that would underflow are kept).
:func:`with_grad_seed` puts a :class:`GradSeed` in place of ``ones_like(loss)``: a
constant, a 0-dim tensor of the loss's dtype holding 1, which the rules read like any
other constant (it is one tensor wherever a transformation copies the node).
:func:`seeded` fills it with ``s`` for one call, so the plan's gradients are eager's
scaled ones, computed from the scaled seed, not scaled afterwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from magis.frontend.fx_graph import Constant
from magis.ir.graph import Graph, Node, Ref, Role, TensorMeta


@dataclass(frozen=True, eq=False)
class GradSeed(Constant):
    """The gradient the backward starts from (1, or the loss scale during a scaled call)."""


def with_grad_seed(graph: Graph, device: torch.device) -> tuple[Graph, torch.Tensor | None]:
    """``graph`` with its seed ``ones_like(loss)`` replaced by a :class:`GradSeed` on ``device``,
    and the seed's tensor; ``graph`` and None when no node seeds the backward that way."""
    loss = graph.signature.loss
    ones = next(
        (n for n in graph.nodes if n.target is torch.ops.aten.ones_like.default and n.args[:1] == (Ref(loss),)), None
    )
    if ones is None:
        return graph, None
    value = torch.ones((), dtype=graph[loss].meta.dtype, device=device)
    seed = Node(
        graph.fresh_name("grad_seed"),
        GradSeed(value),
        outputs=(TensorMeta.of(value),),
        aliases=(None,),
        role=Role.CONSTANT,
    )
    return graph.replace(remove=[ones.name], add=[seed], rename={ones.name: seed.name}), value


@contextlib.contextmanager
def seeded(seed: torch.Tensor | None, scale: float | torch.Tensor | torch.amp.GradScaler | None) -> Iterator[None]:
    """The seed holds ``scale`` (a number or a one-element tensor such as ``GradScaler``'s)
    inside the block, and 1 again after it; ``scale=None`` leaves it at 1. A ``GradScaler``
    itself scales the seed as ``scaler.scale(loss)`` scales a loss: that also makes its scale
    tensor, which ``scaler.step`` needs (``scaler.get_scale()``, a number, leaves it unmade,
    and the first ``scaler.step`` fails)."""
    if scale is None:
        yield
        return
    if seed is None:
        raise ValueError("this plan's backward is not seeded by ones_like(loss): it cannot take grad_scale")
    if isinstance(scale, torch.amp.GradScaler):
        scale = scale.scale(torch.ones((), dtype=torch.float32, device=seed.device))
    with torch.no_grad():
        if isinstance(scale, torch.Tensor):
            if scale.numel() != 1:
                raise ValueError(f"grad_scale must be a number or a one-element tensor, got shape {tuple(scale.shape)}")
            seed.copy_(scale.reshape(()))
        else:
            seed.fill_(scale)
    try:
        yield
    finally:
        with torch.no_grad():
            seed.fill_(1)
