"""The user's training step, as they write it: a batch as their DataLoader yields it, and a loss.

A batch is a tuple or list (the model's positional arguments), a mapping (keyword
arguments: what a transformers collator yields) or one tensor. The step is
``model(*batch)`` / ``model(**batch)`` / ``model(batch)``, its loss ``loss_fn(output)``,
else the output when it is a scalar, else ``output.loss`` / ``output["loss"]``; or the
user's own ``training_step(model, *batch)`` (``training_step(model, batch)`` for a
mapping), so that labels reach the loss (docs/design.md, "The user's side of the
contract"). A training step may return more than its loss, as users log metrics: a tuple
or list whose first element is the loss (``loss, logits``), or a mapping with a
``"loss"`` key (``{"loss": loss, "accuracy": acc}``); :class:`StepOutput` records that
structure, and the plan returns it with the other tensors' values, detached.

The captured graph takes the batch's tensors, flattened (``torch.utils._pytree``) into
positional inputs; every other leaf (an int, a bool, ``None``) is a constant of the
capture. :class:`BatchSpec` records that structure, the constants and each tensor's
shape and dtype, so a plan can be called with the batch as it was given and refuse
one of another structure, shape or dtype, naming the user's argument, before anything
runs.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

LossFn = Callable[[Any], torch.Tensor]
TrainingStep = Callable[..., Any]


class CaptureError(RuntimeError):
    """The model, its inputs or its loss cannot be captured; the message names the cause."""


def user_model(model: Any) -> torch.nn.Module:
    """The module the user trains: a model wrapped by ``torch.compile`` is the module it wraps.

    ``torch.compile(model)`` wraps the module (``OptimizedModule``) and shares its
    parameters, so the plan of the original trains the same weights; capturing the
    wrapper would trace dynamo's frame hooks, which AOTAutograd cannot follow.
    """
    model = getattr(model, "_orig_mod", model) if type(model).__name__ == "OptimizedModule" else model
    if not isinstance(model, torch.nn.Module):
        raise CaptureError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    parallel = next((c.__name__ for c in type(model).__mro__ if c.__module__.startswith(_PARALLEL_WRAPPERS)), None)
    if parallel is not None:
        raise CaptureError(
            f"the model is wrapped in {parallel}, which shares the step across devices or processes inside "
            "its forward and backward (gradients averaged as the backward runs), where a plan does not "
            "reach: plan the module it wraps (model.module) and average .grad across processes after each "
            "call (torch.distributed.all_reduce), or train in one process"
        )
    return model


#: the modules of torch's data-parallel wrappers (DataParallel, DistributedDataParallel, FSDP)
_PARALLEL_WRAPPERS = ("torch.nn.parallel", "torch.distributed.fsdp")


def default_loss(output: Any) -> torch.Tensor:
    """The transformers convention: a scalar output is the loss, else ``output.loss`` (or ``output["loss"]``)."""
    if isinstance(output, torch.Tensor):
        if output.dim() != 0:
            raise CaptureError(
                f"the model returned a tensor of shape {tuple(output.shape)}, not a scalar loss: "
                "pass loss_fn(output) or training_step(model, *batch)"
            )
        return output
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    if not isinstance(loss, torch.Tensor):
        raise CaptureError(
            f"the model returned {type(output).__name__} without a .loss tensor: "
            "pass loss_fn(output) -> scalar or training_step(model, *batch) -> scalar"
        )
    return loss


def as_batch(batch: Any) -> tuple | dict | torch.Tensor:
    """The batch as magis keeps it: a tuple of positional arguments, a dict of keyword
    arguments (any mapping, e.g. transformers' ``BatchEncoding``) or one tensor."""
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, Mapping):
        return dict(batch)
    if isinstance(batch, (tuple, list)):
        return tuple(batch)
    raise ValueError(
        f"the batch must be a tuple or list (positional arguments), a mapping (keyword arguments) "
        f"or one tensor, not {type(batch).__name__}"
    )


@dataclass(frozen=True)
class UserStep:
    """How the loss is made from the model and a batch (module docstring)."""

    loss_fn: LossFn | None = None
    training_step: TrainingStep | None = None

    def __post_init__(self) -> None:
        if self.loss_fn is not None and self.training_step is not None:
            raise ValueError(
                "pass loss_fn or training_step, not both: training_step(model, *batch) returns the loss itself"
            )
        for name in ("loss_fn", "training_step"):
            if getattr(self, name) is not None and not callable(getattr(self, name)):
                raise ValueError(f"{name} must be callable, got {type(getattr(self, name)).__name__}")
        required = _required_positionals(self.loss_fn) if self.loss_fn is not None else 0
        if required > 1:
            raise ValueError(
                f"loss_fn takes {required} arguments, but it is called as loss_fn(output) with the model's "
                "output alone: a step of the model and the batch is training_step=, "
                "as in magis.planned(model, training_step=step)"
            )

    @staticmethod
    def output(model: torch.nn.Module, batch: Any) -> Any:
        """The model's output on ``batch`` (as :func:`as_batch` keeps it): its forward alone."""
        return model(**batch) if isinstance(batch, dict) else model(*_args(batch))

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        """The scalar loss of one step on ``batch`` (as :func:`as_batch` keeps it)."""
        return self.returned(model, batch)[0]

    def returned(self, model: torch.nn.Module, batch: Any) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], StepOutput]:
        """One step on ``batch``: its scalar loss, the other tensors ``training_step`` returned
        (:func:`torch.utils._pytree.tree_flatten` order) and the structure that rebuilds what it returned."""
        if self.training_step is not None:
            returned = (
                self.training_step(model, batch)
                if isinstance(batch, dict)
                else self.training_step(model, *_args(batch))
            )
            output = StepOutput.of(returned)
            loss, others = output.split(returned)
            what = "training_step"
        else:
            model_output = self.output(model, batch)
            loss = default_loss(model_output) if self.loss_fn is None else self.loss_fn(model_output)
            output, others = StepOutput(), ()
            what = "the model" if self.loss_fn is None else "loss_fn"
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise CaptureError(f"{what} must return a scalar loss tensor, got {got}")
        return loss, others, output


@dataclass(frozen=True)
class StepOutput:
    """The structure of what a training step returns (module docstring): ``spec`` of its
    flattened leaves, every one a tensor, the loss at ``loss_leaf``; ``spec`` is None for
    the loss alone."""

    spec: pytree.TreeSpec | None = None
    loss_leaf: int = 0

    @staticmethod
    def of(returned: Any) -> StepOutput:
        """The structure of ``returned``; a ``CaptureError`` where no loss is found or a leaf is not a tensor."""
        if isinstance(returned, torch.Tensor):
            return StepOutput()
        if isinstance(returned, (tuple, list)) and returned:
            key: Any = 0
        elif isinstance(returned, Mapping) and "loss" in returned:
            key = "loss"
        else:
            raise CaptureError(
                f"training_step returned {type(returned).__name__}: return the scalar loss, a tuple or list "
                "whose first element is the loss, or a mapping with a 'loss' key"
            )
        loss = returned[key]
        if not isinstance(loss, torch.Tensor):
            raise CaptureError(f"training_step returned a {type(loss).__name__} as its loss, not a tensor")
        leaves, spec = pytree.tree_flatten(returned)
        other = next((leaf for leaf in leaves if not isinstance(leaf, torch.Tensor)), None)
        if other is not None:
            raise CaptureError(
                f"training_step returned a {type(other).__name__} beside its loss: a plan returns the tensors "
                "its graph computes (return a tensor, or compute the value after the call)"
            )
        return StepOutput(spec, next(i for i, leaf in enumerate(leaves) if leaf is loss))

    def split(self, returned: Any) -> tuple[Any, tuple[torch.Tensor, ...]]:
        """The loss of ``returned`` and its other tensors, in leaf order."""
        if self.spec is None:
            return returned, ()
        leaves = pytree.tree_leaves(returned)
        return leaves[self.loss_leaf], tuple(leaves[: self.loss_leaf] + leaves[self.loss_leaf + 1 :])

    def rebuild(self, loss: torch.Tensor, others: tuple[torch.Tensor, ...]) -> Any:
        """What the step returned, from its loss and other tensors."""
        if self.spec is None:
            return loss
        leaves = [*others[: self.loss_leaf], loss, *others[self.loss_leaf :]]
        return pytree.tree_unflatten(leaves, self.spec)


def _required_positionals(fn: Callable[..., Any]) -> int:
    """How many positional arguments ``fn`` needs (0 when its signature cannot be read)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature
        return 0
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(1 for p in parameters if p.kind in positional and p.default is inspect.Parameter.empty)


def _args(batch: tuple | torch.Tensor) -> tuple:
    return (batch,) if isinstance(batch, torch.Tensor) else batch


@dataclass(frozen=True)
class Leaf:
    """One leaf of a batch: a tensor (its shape and dtype) or a constant of the capture (its value)."""

    name: str  # as the user knows it: "argument 1", "batch['input_ids']", "the batch"
    shape: tuple[int, ...] | None = None  # None: not a tensor
    dtype: torch.dtype | None = None
    value: Any = None


@dataclass(frozen=True)
class BatchSpec:
    """The structure of the batch a step was captured with, its constants, its tensors' shapes and dtypes."""

    kind: str  # "args" (tuple or list), "mapping" or "tensor"
    tree: pytree.TreeSpec
    leaves: tuple[Leaf, ...]

    @staticmethod
    def of(batch: Any) -> BatchSpec:
        """The spec of ``batch`` (any form :func:`as_batch` accepts)."""
        batch = as_batch(batch)
        kind = "tensor" if isinstance(batch, torch.Tensor) else "mapping" if isinstance(batch, dict) else "args"
        paths, tree = pytree.tree_flatten_with_path(batch)
        leaves = tuple(
            Leaf(_name(kind, path), tuple(x.shape), x.dtype)
            if isinstance(x, torch.Tensor)
            else Leaf(_name(kind, path), value=x)
            for path, x in paths
        )
        return BatchSpec(kind, tree, leaves)

    def given(self, args: tuple) -> Any:
        """The batch from a plan's positional arguments: ``plan(*batch)``, or ``plan(batch)``
        for a mapping or one tensor."""
        if self.kind == "args":
            return args
        what = "a mapping (keyword arguments)" if self.kind == "mapping" else "one tensor"
        if len(args) != 1:
            raise ValueError(f"the plan was made for a batch of {what}: call plan(batch), not {len(args)} inputs")
        return args[0]

    def tensors(self, batch: Any) -> tuple[torch.Tensor, ...]:
        """The batch's tensors in the graph's input order, contiguous (a view such as
        ``ids[:, :-1]`` is copied as the graph reads it); a batch of another structure,
        constant, shape or dtype is a ``ValueError`` naming the argument."""
        batch = as_batch(batch)
        leaves, tree = pytree.tree_flatten(batch)
        if tree != self.tree:
            raise ValueError(
                f"the batch has another structure than the plan was made for: "
                f"{_describe(tree)}, not {_describe(self.tree)}"
            )
        tensors = []
        for leaf, x in zip(self.leaves, leaves):
            if leaf.shape is None:
                if isinstance(x, torch.Tensor) or not _same(x, leaf.value):
                    raise ValueError(
                        f"{leaf.name} is {x!r}; the plan was made for {leaf.value!r} (a constant of the step)"
                    )
                continue
            if not isinstance(x, torch.Tensor):
                raise ValueError(f"{leaf.name} is a {type(x).__name__}; the plan was made for a tensor")
            if tuple(x.shape) != leaf.shape:
                raise ValueError(f"{leaf.name} has shape {tuple(x.shape)}; the plan was made for shape {leaf.shape}")
            if x.dtype != leaf.dtype:
                raise ValueError(f"{leaf.name} has dtype {x.dtype}; the plan was made for dtype {leaf.dtype}")
            tensors.append(x.contiguous())
        return tuple(tensors)

    def refuse_gradients(self, batch: Any) -> None:
        """A ``ValueError`` naming the first tensor of ``batch`` that requires grad: a training
        plan computes the parameters' gradients, not the batch's (its tensors are detached)."""
        paths, _ = pytree.tree_flatten_with_path(as_batch(batch))
        for path, x in paths:
            if isinstance(x, torch.Tensor) and x.requires_grad:
                raise ValueError(
                    f"{_name(self.kind, path)} requires grad: a plan computes the parameters' gradients, not "
                    "the batch's (detach it, or make what computes it part of the model)"
                )

    def rebuild(self, tensors: tuple) -> Any:
        """The batch from its tensors (the graph's inputs), with the constants put back."""
        values = iter(tensors)
        return pytree.tree_unflatten(
            [next(values) if leaf.shape is not None else leaf.value for leaf in self.leaves], self.tree
        )


def _name(kind: str, path: tuple) -> str:
    if kind == "tensor":
        return "the batch"
    if kind == "mapping":
        return "batch" + pytree.keystr(path)
    return f"argument {path[0].idx}" + pytree.keystr(path[1:])


def _describe(tree: pytree.TreeSpec) -> str:
    if tree.type is dict:
        return f"keys {list(tree.context)}"
    if tree.type is tuple:
        return f"{tree.num_children} positional inputs"
    return f"{tree.num_leaves} leaves"


def _same(a: Any, b: Any) -> bool:
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # an object whose == is not a truth value: the same object only
        return a is b
