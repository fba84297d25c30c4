"""Activation checkpointing as practitioners apply it: every block, or √n segments of blocks.

Both keep only some activations in the forward and recompute the rest in the
backward with ``torch.utils.checkpoint(use_reentrant=False)``:

- **per block** — what ``gradient_checkpointing_enable()`` gives a transformers
  model (each ``GradientCheckpointingLayer`` runs under a checkpoint), and the
  same wrapper around each block of any other model (ResNet bottlenecks, U-Net
  double convolutions).
- **√n segments** — Chen et al. 2016, "Training Deep Nets with Sublinear Memory
  Cost", §4: the sequence of n blocks is cut into about √n segments of consecutive
  blocks and each segment runs under one checkpoint, so the forward keeps one input
  per segment and the backward recomputes one segment at a time
  (``torch.utils.checkpoint.checkpoint_sequential`` does this for ``nn.Sequential``).
  A segment must be a chain: each of its blocks reads the previous block's output,
  with the same other arguments, and nothing is computed in between. Where blocks
  do not chain (U-Net's pooling and skip concatenations sit between them) the
  segments break there, down to single blocks.

The blocks of a model are its transformers ``GradientCheckpointingLayer`` modules
if it has any, else its repeated block: the module class (not a bare container)
whose outermost instances — at least two — hold the most parameters, the finer
one on a tie. Both functions change the model in place: apply them to a copy.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from magis.backend.eager import buffers_snapshot, restore_buffers

# Without transformers no model is a transformers model: isinstance(m, ()) is False.
try:
    from transformers import PreTrainedModel
except ImportError:
    PreTrainedModel = ()  # type: ignore[assignment,misc]
try:
    from transformers.modeling_layers import GradientCheckpointingLayer
except ImportError:  # transformers < 4.52 (or none): no common base class of checkpointable layers
    GradientCheckpointingLayer = ()  # type: ignore[assignment,misc]

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def find_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's blocks with their qualified names, in registration order (see the module docstring)."""
    named = [(n, m) for n, m in model.named_modules() if n]
    layers = _outermost([(n, m) for n, m in named if isinstance(m, GradientCheckpointingLayer)])
    if layers:
        return layers
    by_class: dict[type, list[tuple[str, nn.Module]]] = {}
    for name, module in named:
        if type(module) not in _CONTAINERS and next(module.children(), None) is not None:
            by_class.setdefault(type(module), []).append((name, module))
    best: tuple[tuple[int, int, int], list[tuple[str, nn.Module]]] | None = None
    for instances in by_class.values():
        outer = _outermost(instances)
        if len(outer) < 2:
            continue
        params = sum(p.numel() for _, m in outer for p in m.parameters())
        key = (params, len(outer), min(n.count(".") for n, _ in outer))
        if best is None or key > best[0]:
            best = (key, outer)
    if best is None:
        raise ValueError(f"{type(model).__name__} has no repeated block to checkpoint")
    return best[1]


def _outermost(named: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    names = [n for n, _ in named]
    return [(n, m) for n, m in named if not any(n.startswith(other + ".") for other in names)]


def checkpoint_every_block(model: nn.Module) -> list[list[str]]:
    """Checkpoint each block of ``model`` (in place); returns the blocks, one per segment.

    A transformers model that supports it gets ``activation_checkpointing_enable``
    (``gradient_checkpointing_enable`` before transformers 5) with
    ``use_reentrant=False``. Only its layers are switched: the flag transformers also
    sets on the base model does nothing but turn the KV cache off, which sends the
    causal-mask builder to a data-dependent check that graph capture cannot trace;
    no layer reads the cache under checkpointing anyway (``GradientCheckpointingLayer``
    passes ``past_key_values=None``), so the step computes the same either way.
    """
    blocks = find_blocks(model)
    hf = _transformers_model(model)
    if hf is not None and hf.supports_gradient_checkpointing:
        enable = getattr(hf, "activation_checkpointing_enable", None) or hf.gradient_checkpointing_enable
        enable({"use_reentrant": False})
        for module in hf.modules():
            if not isinstance(module, GradientCheckpointingLayer) and getattr(module, "gradient_checkpointing", False):
                module.gradient_checkpointing = False
    else:
        for _, block in blocks:
            _checkpoint_block(block)
    return [[name] for name, _ in blocks]


def checkpoint_sqrt_segments(model: nn.Module, example_inputs: Sequence[Any]) -> list[list[str]]:
    """Checkpoint √n segments of ``model``'s blocks (in place; Chen et al. 2016); returns the segments.

    One forward pass over ``example_inputs`` (without gradients; buffers restored
    afterwards) finds the order the blocks run in and where they chain.
    """
    calls = _probe(model, find_blocks(model), example_inputs)
    length = math.ceil(len(calls) / max(1, round(math.sqrt(len(calls)))))
    segments: list[list[_Call]] = []
    for chain in _chains(calls):
        pieces = math.ceil(len(chain) / length)
        bounds = [round(i * len(chain) / pieces) for i in range(pieces + 1)]
        segments += [chain[a:b] for a, b in itertools.pairwise(bounds)]
    for segment in segments:
        if len(segment) == 1:
            _checkpoint_block(segment[0].block)
        else:
            _Segment([c.block for c in segment])
    return [[c.name for c in segment] for segment in segments]


def _checkpoint_block(block: nn.Module) -> None:
    block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)


def _transformers_model(model: nn.Module) -> PreTrainedModel | None:
    return next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)


@dataclass
class _Call:
    """One block call seen by the probe."""

    name: str
    block: nn.Module
    args: tuple
    kwargs: dict[str, Any]
    output: Any = None


def _probe(model: nn.Module, blocks: list[tuple[str, nn.Module]], example_inputs: Sequence[Any]) -> list[_Call]:
    """The blocks' calls in the order they run: each block must run exactly once."""
    calls: list[_Call] = []
    handles = []
    for name, block in blocks:

        def before(module: nn.Module, args: tuple, kwargs: dict, name: str = name) -> None:
            calls.append(_Call(name, module, args, kwargs))

        def after(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            next(c for c in reversed(calls) if c.block is module).output = output

        handles.append(block.register_forward_pre_hook(before, with_kwargs=True))
        handles.append(block.register_forward_hook(after, with_kwargs=True))
    snapshot = buffers_snapshot(model)
    try:
        with torch.no_grad():
            model(*example_inputs)
    finally:
        for handle in handles:
            handle.remove()
        restore_buffers(model, snapshot)
    counts = {name: sum(c.name == name for c in calls) for name, _ in blocks}
    repeated = [name for name, count in counts.items() if count > 1]
    if repeated:
        raise ValueError(f"blocks {repeated[:3]} run more than once per step: they cannot be cut into segments")
    return calls


def _chains(calls: list[_Call]) -> list[list[_Call]]:
    """Maximal runs of calls where each reads the previous one's output, with the same other arguments."""
    chains: list[list[_Call]] = []
    for call in calls:
        if chains and _continues(chains[-1][-1], call):
            chains[-1].append(call)
        else:
            chains.append([call])
    return chains


def _continues(previous: _Call, call: _Call) -> bool:
    return (
        bool(call.args)
        and call.args[0] is _hidden(previous.output)
        and _same(call.args[1:], previous.args[1:])
        and _same(call.kwargs, previous.kwargs)
    )


def _hidden(output: Any) -> Any:
    """The hidden state a block passes on: its output, or the first element of a tuple output."""
    return output[0] if isinstance(output, tuple) else output


def _same(a: Any, b: Any) -> bool:
    """The same arguments: identical tensors, equal plain values, recursively."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a is b or (type(a) is type(b) and a == b)


#: keyword arguments through which a transformers layer writes its KV cache, and their "off" values
_CACHE_ARGUMENTS = {"use_cache": False, "past_key_values": None, "layer_past": None}


def _without_cache(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with the KV cache off, as ``GradientCheckpointingLayer`` does: the replay would write it twice."""
    return {k: _CACHE_ARGUMENTS.get(k, v) for k, v in kwargs.items()}


class _Segment:
    """A chain of blocks run under one checkpoint.

    The first block's call runs the whole chain inside ``checkpoint`` and returns the
    last block's output; the later blocks' calls, which receive that output in turn,
    check they are called as the probe saw and hand it on unchanged.
    """

    def __init__(self, blocks: list[nn.Module]) -> None:
        self.forwards = [block.forward for block in blocks]
        self.pending: tuple[Any, tuple, dict[str, Any]] | None = None
        blocks[0].forward = self.lead
        for position, block in enumerate(blocks[1:], start=1):
            block.forward = functools.partial(self.follow, position)

    def run(self, hidden: Any, *args: Any, **kwargs: Any) -> Any:
        output = None
        for forward in self.forwards:
            output = forward(hidden, *args, **kwargs)
            hidden = _hidden(output)
        return output

    def lead(self, hidden: Any, *args: Any, **kwargs: Any) -> Any:
        output = checkpoint(self.run, hidden, *args, use_reentrant=False, **_without_cache(kwargs))
        self.pending = (output, args, kwargs)
        return output

    def follow(self, position: int, hidden: Any, *args: Any, **kwargs: Any) -> Any:
        if self.pending is None:
            raise RuntimeError("a checkpointed segment's block ran before the segment's first block")
        output, lead_args, lead_kwargs = self.pending
        if hidden is not _hidden(output) or not _same(args, lead_args) or not _same(kwargs, lead_kwargs):
            raise RuntimeError("a checkpointed segment's blocks are no longer called as a chain")
        if position == len(self.forwards) - 1:
            self.pending = None
        return output
