"""One workload at one preset, as every method of a comparison sees it: :class:`Subject`."""

from __future__ import annotations

import copy
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, TypeVar

import torch

from magis.backend.eager import split_batch
from magis.frontend.capture import LossFn, capture, default_loss
from magis.ir.graph import Graph
from magis.models import Built, build_workload, get_workload

T = TypeVar("T")


@dataclass(eq=False)
class Subject:
    """One workload at one preset: what every method of a comparison works on.

    The model (real tensors, or fake ones for the paper preset) and its captured graph are
    made once and shared by the methods; what a family of methods plans or searches for
    it (per budget or limit) is made once too (:meth:`once`). A method that changes the model
    works on its own :meth:`rebuild` (the same weights and inputs: builds are seeded).
    """

    workload: str
    preset: str
    batch: int | None = None
    seed: int = 0
    built: Built = field(init=False)
    #: the floating-point type the model and its inputs are cast to (``None``: the workload's own);
    #: float64 makes two ways of computing one step comparable to round-off
    dtype: torch.dtype | None = None
    #: set on the subjects of gradient accumulation (:meth:`accumulating`): k micro-batches of batch / k
    micro_batches: int = 1
    #: what :meth:`once` made, by key
    _made: dict[Hashable, Any] = field(init=False, default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.built = self.rebuild()

    @property
    def batch_size(self) -> int:
        """The batch the workload is built at (the preset's unless :attr:`batch` says otherwise)."""
        return self.batch or get_workload(self.workload).presets[self.preset]["batch"]

    def rebuild(self) -> Built:
        """A new build of the workload, identical to :attr:`built`."""
        built = build_workload(self.workload, self.preset, self.batch, self.seed)
        if self.dtype is None:
            return built
        cast = [x.to(self.dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
                for x in built.example_inputs]  # fmt: skip
        return Built(built.model.to(self.dtype), tuple(cast), built.loss_fn)

    @property
    def inputs(self) -> tuple:
        return tuple(self.built.example_inputs)

    @cached_property
    def graph(self) -> Graph:
        """The training step captured by :func:`magis.frontend.capture.capture`."""
        return capture(self.built.model, self.inputs, self.built.loss_fn)

    def once(self, key: Hashable, make: Callable[[], T]) -> T:
        """``make()``, called the first time ``key`` is asked for; its result every time: a plan or
        search shared by a method's real step, simulated step and details."""
        if key not in self._made:
            self._made[key] = make()
        return self._made[key]

    def accumulating(self, micro_batches: int) -> Subject:
        """This subject run as ``micro_batches`` micro-batches (made once per count).

        It shares this subject's build and captured step (which its gradient notes read).
        """
        if micro_batches == self.micro_batches:
            return self
        return self.once(("accumulating", micro_batches), lambda: self._split(micro_batches))

    def own_build(self) -> Subject:
        """This subject on a build of its own (:meth:`rebuild`: the same weights and inputs), sharing
        the captured step: for a method whose step changes the weights (a full step updates them), so
        that every method of a comparison starts from the same weights."""
        _ = self.graph  # capture before sharing
        child = copy.copy(self)
        child.built, child._made = self.rebuild(), {}
        return child

    def _split(self, micro_batches: int) -> Subject:
        if micro_batches < 1 or self.batch_size % micro_batches:
            raise ValueError(f"{micro_batches} micro-batches do not divide the batch of {self.batch_size}")
        _ = self.graph  # capture before sharing
        child = copy.copy(self)
        child.micro_batches, child._made = micro_batches, {}
        return child

    def micro_step(self, built: Built) -> tuple[torch.nn.Module, tuple, LossFn]:
        """What one micro-batch of ``built`` runs: the model, the first micro-batch's inputs
        (views of the batch) and the loss scaled by ``1 / micro_batches``."""
        inputs = split_batch(built.example_inputs, self.micro_batches)[0]
        base = built.loss_fn

        def loss_fn(output: Any) -> torch.Tensor:
            loss = default_loss(output) if base is None else base(output)
            return loss / self.micro_batches

        return built.model, inputs, loss_fn
