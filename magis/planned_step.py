"""``magis.planned``: a training step (or a forward) planned once per input signature, as torch.compile recompiles.

A DataLoader's last batch is often smaller, and a collator that pads to the longest
sequence of each batch yields another shape almost every time; a :class:`~magis.plan.Plan`
is made for one shape. ``step = magis.planned(model, ...)`` is a training step that, on
each batch, finds the plan made for that batch's signature (the structure, shapes,
dtypes and devices of its tensors, every submodule's mode, class, settings and hooks,
which parameters are trainable, the autocast state) and runs it; a signature seen for the
first time is planned by :func:`magis.optimize` with the same limits and search
options. A byte limit applies to every shape; a fraction is of each shape's own peak.
With ``inference=True`` it is the model's forward, planned as :func:`magis.optimize`
plans one (an evaluation loop's last batch, a server's batch sizes).

Plans are written to ``cache_dir`` (:mod:`magis.plan_file`) under a hash of what
determines them: the captured step (every operator, shape and parameter name, so a
change of the model, its forward or the loss is another plan), the signature, the
limits and search options, and the magis and torch versions. A process that meets
the same signature again, a restarted run, reads the plan instead of searching (it
captures the step, which takes far less). At most ``max_plans`` plans stay in memory,
the least recently used dropped first.
"""

from __future__ import annotations

import hashlib
import warnings
from collections import OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree

from magis.api import check_inference_options, optimize
from magis.backend.runtime import DivisorError
from magis.backend.verify import forked_rng
from magis.cost.timing_cache import default_cache_path
from magis.frontend.capture import capture, capture_forward
from magis.frontend.conditions import Conditions, ConditionsWatch, refuse_gradients_off
from magis.frontend.optimizer import group_layout
from magis.frontend.step import LossFn, TrainingStep, UserStep, as_batch, user_model
from magis.ir.graph import Graph
from magis.plan import Plan, load_plan
from magis.plan_file import versions

#: plans kept in memory by default
DEFAULT_MAX_PLANS = 8
#: options of :func:`magis.optimize` that do not change the plan it finds
_NOT_IN_KEY = frozenset({"progress", "cuda_graphs"})


def planned(
    model: torch.nn.Module,
    loss_fn: LossFn | None = None,
    *,
    training_step: TrainingStep | None = None,
    memory_limit: int | str | float | None = None,
    latency_limit: float | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    max_grad_norm: float | None = None,
    inference: bool = False,
    cache_dir: str | Path | None = None,
    max_plans: int = DEFAULT_MAX_PLANS,
    **search_options: Any,
) -> PlannedStep:
    """A training step ``step(*batch) -> loss`` (``step(batch)`` for a mapping) that plans each
    new input signature with :func:`magis.optimize` and reuses the plan after (module docstring).

    ``loss_fn``, ``training_step``, the limits, ``optimizer``, ``max_grad_norm`` and
    ``search_options`` (``time_budget``, ``max_states``, ``device``, ``seed``, ``progress``...)
    are :func:`magis.optimize`'s: with ``optimizer``, each call is the whole step, the update
    included (a plan file is keyed by the optimizer's type and the options that shape its
    update, not its learning rate, which a scheduler changes). With ``inference=True``,
    ``step(*batch)`` is the model's forward (no loss, no gradients; the modules in their
    modes), returning its output; it takes no ``loss_fn``, ``training_step``, ``optimizer``
    or ``max_grad_norm``.
    ``cache_dir`` defaults to ``plans/`` in magis' cache directory (``$MAGIS_CACHE_DIR``,
    else ``~/.cache/magis``).
    """
    if not isinstance(inference, bool):
        raise ValueError(f"inference is True or False, got {inference!r}")
    if inference:
        check_inference_options(loss_fn, training_step, optimizer, max_grad_norm)
    step = UserStep(loss_fn, training_step)  # both given: a ValueError
    if isinstance(max_plans, bool) or not isinstance(max_plans, int) or max_plans < 1:
        raise ValueError(f"max_plans must be a positive integer, got {max_plans!r}")
    options = dict(search_options, memory_limit=memory_limit, latency_limit=latency_limit, max_grad_norm=max_grad_norm)
    if inference:  # only then: a training step's plan files keep their names
        options["inference"] = True
    root = Path(cache_dir) if cache_dir is not None else default_cache_path(torch.device("cpu")).parent / "plans"
    return PlannedStep(user_model(model), step, options, root, max_plans, optimizer)


class PlannedStep:
    """What :func:`planned` returns. ``searches`` counts the searches run (plans made by
    :func:`magis.optimize`), ``loaded`` the plans read from ``cache_dir``."""

    def __init__(
        self,
        model: torch.nn.Module,
        step: UserStep,
        options: dict[str, Any],
        cache_dir: Path,
        max_plans: int,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        self.model, self.step, self.options, self.optimizer = model, step, options, optimizer
        self.cache_dir, self.max_plans = cache_dir, max_plans
        self.plans: OrderedDict[tuple, Plan] = OrderedDict()  # by signature, least recently used first
        self.searches = 0
        self.loaded = 0
        self.watch = ConditionsWatch()  # what each call's signature glances at
        self.inference = bool(options.get("inference"))

    def __call__(self, *batch: Any, grad_scale: float | torch.Tensor | torch.amp.GradScaler | None = None) -> Any:
        """One training step on ``batch``: the loss; gradients accumulated into ``.grad``, or with an
        optimizer, the parameters updated; ``grad_scale`` as :meth:`Plan.__call__ <magis.plan.Plan.__call__>`
        takes it (a ``GradScaler``). With ``inference``: the model's output."""
        args = _batch(batch)
        if not self.inference:
            refuse_gradients_off()  # before a shape not seen yet is captured
        plan = self._plan_of(args)
        try:
            return _run(plan, args, grad_scale)
        except DivisorError as err:  # the weights broke a choice the plan made (raised as it binds: nothing ran)
            warnings.warn(f"magis: planning again, {err}", stacklevel=2)
            key = self._signature(args)
            self.plans[key] = self._searched(args, self._path(args, key))
            return _run(self.plans[key], args, grad_scale)

    def plan_for(self, *batch: Any) -> Plan:
        """The plan that runs ``batch`` (given as to the step), made or read on first sight."""
        return self._plan_of(_batch(batch))

    def _signature(self, args: tuple | Mapping) -> tuple:
        functions = (self.step.loss_fn, self.step.training_step)
        return signature(self.model, args, self.optimizer, functions, self.watch, gradients=not self.inference)

    def _plan_of(self, args: tuple | Mapping) -> Plan:
        key = self._signature(args)
        plan = self.plans.get(key)
        if plan is None:
            plan = self._made_or_read(args, key)
            self.plans[key] = plan
            if len(self.plans) > self.max_plans:
                self.plans.popitem(last=False)
        self.plans.move_to_end(key)
        return plan

    def _made_or_read(self, batch: tuple | Mapping, key: tuple) -> Plan:
        """The plan of a signature not in memory: read from ``cache_dir``, else searched and written there."""
        path = self._path(batch, key)
        if path.exists():
            try:
                plan = load_plan(path, self.model, self.optimizer)
            except ValueError as err:
                warnings.warn(f"magis: planning again, {err}", stacklevel=3)
            else:
                self.loaded += 1  # it runs as this step's options say (those it was saved with, in its file's key)
                plan.runtime = "compiled" if self.options.get("compile") else "generated"
                plan.cuda_graphs = self.options.get("cuda_graphs", True)
                return plan
        return self._searched(batch, path)

    def _path(self, batch: tuple | Mapping, key: tuple) -> Path:
        """Where the plan of ``batch``'s signature ``key`` is kept (:func:`file_key` of its captured step)."""
        with forked_rng(self.model):  # the caller's random stream stays eager's
            graph = (
                capture_forward(self.model, batch).graph
                if self.inference
                else capture(self.model, batch, **self._step())
            )
        return self.cache_dir / f"{file_key(graph, key, self.options)}.plan"

    def _searched(self, batch: tuple | Mapping, path: Path) -> Plan:
        """A plan searched by :func:`magis.optimize`, written to ``path`` (over what was there)."""
        plan = optimize(self.model, batch, **self._step(), **self.options, optimizer=self.optimizer)
        self.searches += 1
        try:
            plan.save(path)
        except (OSError, ValueError) as err:  # the step still runs; only the next process searches again
            warnings.warn(f"magis: could not keep the plan in {path}: {err}", stacklevel=3)
        return plan

    def _step(self) -> dict[str, Any]:
        return {"loss_fn": self.step.loss_fn, "training_step": self.step.training_step}


def _run(plan: Plan, batch: tuple | Mapping, grad_scale: Any = None) -> Any:
    return plan(batch, grad_scale=grad_scale) if isinstance(batch, Mapping) else plan(*batch, grad_scale=grad_scale)


def _batch(batch: tuple) -> tuple | Mapping:
    """A mapping given alone is the batch (keyword arguments); anything else the positional arguments."""
    return batch[0] if len(batch) == 1 and isinstance(batch[0], Mapping) else batch


def signature(
    model: torch.nn.Module,
    batch: tuple | Mapping,
    optimizer: torch.optim.Optimizer | None = None,
    step: tuple[Callable[..., Any] | None, ...] = (),
    watch: ConditionsWatch | None = None,
    gradients: bool = True,
) -> tuple:
    """What a plan is made for beyond the model's code: the batch's structure and its tensors'
    shapes, dtypes and devices (other values as they are), every submodule's mode, class,
    settings and hooks, which parameters are trainable, the autocast state and the default
    dtype (:class:`~magis.frontend.conditions.Conditions`), and the optimizer's type and param
    groups (:func:`~magis.frontend.optimizer.group_layout`: a group added is another plan).
    A caller that asks at every call passes its ``watch``; an inference step's has no
    ``gradients`` (which parameters are trainable does not matter)."""
    leaves, tree = pytree.tree_flatten(as_batch(batch))
    described = tuple(
        (tuple(x.shape), x.dtype, x.device.type) if isinstance(x, torch.Tensor) else (type(x).__name__, repr(x))
        for x in leaves
    )
    stepped = None if optimizer is None else (type(optimizer).__qualname__, group_layout(optimizer, model))
    conditions = Conditions.of(model, gradients, step) if watch is None else watch.of(model, gradients, step)
    return (tree, described, conditions, stepped)


def file_key(graph: Graph, signature: tuple, options: dict[str, Any]) -> str:
    """The name of a plan's file: a hash of the captured step (names included: two parameters
    that swap places make another step), its signature, the options that shape the plan and the versions."""
    nodes = [(n.name, repr(n.target), n.args, n.kwargs, n.outputs, n.role.value, n.random) for n in graph.nodes]
    step = (nodes, graph.outputs, graph.signature, graph.order_edges)
    chosen = sorted((k, repr(v)) for k, v in options.items() if k not in _NOT_IN_KEY)
    text = repr((step, signature, chosen, sorted(versions().items())))
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
