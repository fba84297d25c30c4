"""The optimizer inside the step: each parameter's update as a node of the step's graph.

A training step ends with ``optimizer.step()``. Planned with forward and backward
alone, every gradient is held until the step and the update runs after the plan; here
the update becomes part of the graph (issue #29, docs/design.md "The whole step"):

- a :class:`ParameterUpdate` node per parameter group (eager's step: after the whole
  backward, one multi-tensor ``foreach`` update on CUDA, a loop over the parameters on a
  CPU), reading the group's parameters, gradients and optimizer states and writing the
  parameters and states in place. The rule :func:`magis.rules.early_update.early_updates`
  splits it into one node per parameter, which the scheduler places as soon as that
  gradient is final and the last reader of the parameter ran (PyTorch's
  optimizer-in-backward, planned jointly with fission, recomputation and swapping);
- the optimizer's states (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``, ``step``)
  are graph inputs, resident like the weights, bound at each call to the tensors in
  ``optimizer.state`` (created as the optimizer's first step would create them), so
  ``state_dict()``, checkpoints and LR schedulers (which change ``param_groups[i]["lr"]``
  between calls) work unchanged: the hyperparameters are read from the groups at run time;
- clipping (``max_grad_norm``) is a :class:`GradientNorm` node reading every gradient:
  no update can run before it, so every gradient is held until the last is final.

The math is the optimizer's own: each update calls torch's functional ``sgd``/``adam``/
``adamw`` on its parameters, as ``optimizer.step()`` does, so a plan's parameters and
states equal eager's. Any other optimizer is not planned: :func:`unplanned_reason` says why,
and the plan steps it after the backward with the gradients kept, as eager does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.optim.adam import adam
from torch.optim.adamw import adamw
from torch.optim.optimizer import _get_scalar_dtype
from torch.optim.sgd import sgd

from magis.ir.graph import Graph, Node, Ref, Role, TensorMeta

#: the optimizers whose update a plan holds, by exact type (a subclass may change the step)
PLANNED_OPTIMIZERS = {torch.optim.SGD: "sgd", torch.optim.Adam: "adam", torch.optim.AdamW: "adamw"}
#: per kind, the group options that fix the shape of the update (checked at each call);
#: the others (lr, betas, eps, weight_decay, momentum, dampening) are read at each call
_STRUCTURE = {
    "sgd": ("nesterov", "maximize", "foreach", "fused", "differentiable"),
    "adam": ("amsgrad", "maximize", "foreach", "fused", "capturable", "differentiable", "decoupled_weight_decay"),
    "adamw": ("amsgrad", "maximize", "foreach", "fused", "capturable", "differentiable"),
}
#: bytes moved per kernel of one update, in units of the parameter's bytes (for the latency model)
_KERNEL_TRAFFIC = {
    "sgd": (3.0,),  # param.add_(grad)
    "sgd-momentum": (2.0, 3.0, 3.0),  # buf.mul_, buf.add_(grad), param.add_(buf)
    "adam": (3.0, 2.0, 4.0, 2.0, 2.0, 2.0, 4.0),  # lerp_, mul_, addcmul_, sqrt, div, add_, addcdiv_
}


#: an early-updated Adam/AdamW parameter larger than this is updated in slices no larger (its
#: temporaries then hold a slice, not the parameter; slices this large still run at full bandwidth)
PIECE_BYTES = 32 * 2**20


def update_pieces(meta: TensorMeta) -> int:
    """How many slices along its first dimension an update of a parameter of ``meta`` runs in,
    so that each holds at most :data:`PIECE_BYTES` (at most one per row)."""
    if not meta.shape or meta.nbytes <= PIECE_BYTES:
        return 1
    return min(meta.shape[0], -(-meta.nbytes // PIECE_BYTES))


def piece_bytes(meta: TensorMeta, pieces: int) -> int:
    """Bytes of the largest of ``pieces`` slices along the first dimension (``torch.chunk``'s)."""
    if pieces <= 1:
        return meta.nbytes
    rows = meta.shape[0]
    return -(-rows // pieces) * (meta.nbytes // rows)


class OptimizerError(ValueError):
    """The optimizer given to a plan does not match the one it was planned for."""


def unplanned_reason(optimizer: torch.optim.Optimizer) -> str | None:
    """Why ``optimizer``'s update cannot be planned inside the step, or None when it can."""
    kind = PLANNED_OPTIMIZERS.get(type(optimizer))
    if kind is None:
        return (
            f"{type(optimizer).__name__} is not one of the optimizers a plan holds "
            f"({', '.join(t.__name__ for t in PLANNED_OPTIMIZERS)}): it is stepped after the plan, "
            "with every gradient kept until then, as eager does"
        )
    for group in optimizer.param_groups:
        if group.get("differentiable"):
            return "differentiable=True: the update is stepped after the plan, as eager does"
        if any(p.is_sparse for p in group["params"]):
            return "a sparse parameter: the update is stepped after the plan, as eager does"
    return None


#: per param group, its parameters' names and the options that shape its update
GroupLayout = tuple[tuple[tuple[str, ...], tuple[tuple[str, Any], ...]], ...]


def group_layout(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> GroupLayout:
    """What of ``optimizer`` a planned update is made for: per param group, the names of its
    parameters in ``model``, the optimizer's class and the options of :data:`_STRUCTURE` (SGD's
    too: whether it has momentum). Not the learning rate, betas or weight decay, which a
    scheduler may change between calls and the update reads at each call."""
    kind = PLANNED_OPTIMIZERS.get(type(optimizer))
    names = {id(p): name for name, p in model.named_parameters()}
    return tuple(
        (
            tuple(names.get(id(p), "(not the model's)") for p in group["params"]),
            (("optimizer", type(optimizer).__name__),)
            + tuple((option, group.get(option)) for option in _STRUCTURE.get(kind, ()))
            + ((("momentum", group["momentum"] != 0),) if kind == "sgd" else ()),
        )
        for group in optimizer.param_groups
    )


def layout_difference(planned: GroupLayout, now: GroupLayout) -> str | None:
    """What differs between the param groups a plan's update was made for and the optimizer's now, or None."""
    if len(now) != len(planned):
        return f"the optimizer has {len(now)} param groups; the plan was made for {len(planned)}: optimize again"
    for i, ((params, options), (planned_params, planned_options)) in enumerate(zip(now, planned)):
        if params != planned_params:
            added = [name for name in params if name not in planned_params]
            removed = [name for name in planned_params if name not in params]
            return (
                f"param group {i} holds other parameters than the plan was made for (added {added}, "
                f"removed {removed}): optimize again"
            )
        for (option, value), (_, planned_value) in zip(options, planned_options):
            if option == "optimizer" and value != planned_value:
                return f"the optimizer is {value}; the plan was made for {planned_value}: pass that, or optimize again"
            if option == "momentum" and value != planned_value:
                now, then = ("momentum", "none (momentum=0)") if value else ("no momentum (momentum=0)", "momentum")
                return f"param group {i} has {now}; the plan was made with {then}: optimize again"
            if value != planned_value:
                return (
                    f"param group {i}'s {option} is {value!r}; the plan was made for {planned_value!r}: optimize again"
                )
    return None


@dataclass(frozen=True)
class ParameterUpdate:
    """The target of a node that applies one optimizer's update to some parameters of a group.

    Arguments: ``(optimizer, coefficient, *per_parameter)`` where ``optimizer`` is the
    :class:`BoundOptimizer` (None when the step is timed on random tensors: the
    hyperparameters of ``options`` then stand in), ``coefficient`` the clipping
    coefficient (:class:`GradientNorm`) or None, and ``per_parameter`` lists, for each
    parameter of ``params``, the parameter, its gradient and its states in ``states``'
    order. Writes the parameters and states in place; returns the first parameter.
    """

    kind: str  # "sgd", "adam" or "adamw"
    group: int  # index in optimizer.param_groups
    params: tuple[str, ...]  # parameter names (the model's)
    states: tuple[str, ...]  # state keys per parameter, in argument order
    foreach: bool  # one multi-tensor update of all params (eager's CUDA default), else one at a time
    options: tuple[tuple[str, Any], ...]  # the group's options when planned
    pieces: int = 1  # Adam/AdamW of one parameter: updated in this many slices along its first dim
    #: sliced (``pieces`` > 1) only: the one parameter's gradient is the sum of two tensors, the usual
    #: one and the last argument (a tied weight's two uses'), added slice by slice: the sum never exists
    summed: bool = False

    @property
    def __name__(self) -> str:  # read by Node.op_name
        return f"{self.kind}_update"

    def writes(self, node: Node) -> tuple[str, ...]:
        """The inputs of ``node`` written in place: the parameters and their states."""
        per = 2 + len(self.states)  # param, grad, states
        return tuple(ref.name for i, ref in enumerate(self._per_parameter(node)) if i % per != 1)

    def gradients(self, node: Node) -> tuple[str, ...]:
        """The gradient nodes ``node`` reads: one per parameter of ``params``, two where ``summed``."""
        per = 2 + len(self.states)
        return tuple(ref.name for ref in self._per_parameter(node)[1::per]) + (
            (node.args[-1].name,) if self.summed else ()
        )

    def _per_parameter(self, node: Node) -> tuple:
        """The arguments of ``node`` per parameter (parameter, gradient, states), in order."""
        return node.args[2 : len(node.args) - int(self.summed)]

    def kernel_bytes(self, graph: Graph, node: Node) -> tuple[int, ...]:
        """Bytes each kernel of the update moves (the latency model prices them, :mod:`magis.cost.latency`)."""
        options = dict(self.options)
        kind = "sgd-momentum" if self.kind == "sgd" and options.get("momentum") else self.kind.removesuffix("w")
        traffic = _KERNEL_TRAFFIC[kind]
        per = 2 + len(self.states)
        sizes = [graph[ref.name].meta.nbytes for ref in self._per_parameter(node)[0::per]]
        if self.pieces > 1:
            piece = piece_bytes(graph[node.args[2].name].meta, self.pieces)
            traffic = ((3.0,) if self.summed else ()) + traffic  # the two terms' sum, a slice at a time
            return tuple(int(t * piece) for _ in range(self.pieces) for t in traffic)
        if self.foreach:
            return tuple(int(t * sum(sizes)) for t in traffic)
        return tuple(int(t * size) for size in sizes for t in traffic)

    def __call__(self, optimizer: BoundOptimizer | None, coefficient: torch.Tensor | None, *tensors: Any) -> Any:
        per = 2 + len(self.states)
        term = tensors[-1] if self.summed else None
        tensors = tensors[: len(tensors) - int(self.summed)]
        params, grads = list(tensors[0::per]), list(tensors[1::per])
        states = {key: list(tensors[2 + k :: per]) for k, key in enumerate(self.states)}
        group = dict(self.options) if optimizer is None else optimizer.group(self)
        if self.pieces > 1:
            states_of_one = {k: v[0] for k, v in states.items()}
            self._update_in_pieces(group, coefficient, params[0], grads[0], term, states_of_one)
            return params[0]
        if coefficient is not None:  # torch.nn.utils.clip_grad_norm_ multiplies each gradient by it
            grads = [g.mul(coefficient.to(g.device)) for g in grads]
        self._update(optimizer, group, params, grads, states)
        return params[0]

    def _update_in_pieces(
        self,
        group: dict[str, Any],
        coefficient: torch.Tensor | None,
        param: torch.Tensor,
        grad: torch.Tensor,
        term: torch.Tensor | None,
        states: dict[str, torch.Tensor],
    ) -> None:
        """Adam's update of one parameter slice by slice along its first dimension: every operation
        of the update is elementwise, so the slices' results are the whole update's, bit for bit,
        while its temporaries (``sqrt(v) / bc2``, the clipped gradient, the sum ``grad + term``
        where ``summed``) are a slice's size. The step count advances once: each slice but the
        last counts on a copy of it."""

        def sliced(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return torch.chunk(t, self.pieces, dim=0)

        pieces = {"param": sliced(param), "grad": sliced(grad)}
        pieces.update({key: sliced(state) for key, state in states.items() if key != "step"})
        terms = sliced(term) if term is not None else None
        count = len(pieces["param"])
        for i in range(count):
            grad_piece = pieces["grad"][i]
            if terms is not None:
                grad_piece = torch.add(grad_piece, terms[i])
            if coefficient is not None:
                grad_piece = grad_piece.mul(coefficient.to(grad_piece.device))
            piece_states = {key: [pieces[key][i]] for key in states if key != "step"}
            piece_states["step"] = [states["step"] if i == count - 1 else states["step"].clone()]
            self._update(None, group, [pieces["param"][i]], [grad_piece], piece_states)

    def _update(
        self,
        optimizer: BoundOptimizer | None,
        group: dict[str, Any],
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        states: dict[str, list[torch.Tensor]],
    ) -> None:
        """torch's functional ``sgd``/``adam``/``adamw`` on ``params`` with ``group``'s options."""
        flags = {"foreach": self.foreach, "fused": group.get("fused")}
        if self.kind == "sgd":
            buffers = states.get("momentum_buffer", [None] * len(params))
            sgd(
                params,
                grads,
                buffers,
                **flags,
                weight_decay=group["weight_decay"],
                momentum=group["momentum"],
                lr=group["lr"],
                dampening=group["dampening"],
                nesterov=group["nesterov"],
                maximize=group["maximize"],
            )
            if optimizer is not None and group["momentum"] != 0:
                optimizer.keep_momentum_buffers(self.params, buffers)
        else:
            update = adamw if self.kind == "adamw" else adam
            if self.kind == "adam" and group.get("decoupled_weight_decay"):  # Adam as AdamW (torch >= 2.6)
                flags["decoupled_weight_decay"] = True
            update(
                params,
                grads,
                states["exp_avg"],
                states["exp_avg_sq"],
                states.get("max_exp_avg_sq", []),
                states["step"],
                **flags,
                capturable=group.get("capturable", False),
                differentiable=False,
                has_complex=any(torch.is_complex(p) for p in params),
                amsgrad=group["amsgrad"],
                beta1=group["betas"][0],
                beta2=group["betas"][1],
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=group["maximize"],
            )


@dataclass(frozen=True)
class GradientNorm:
    """The target of the clipping node: ``torch.nn.utils.clip_grad_norm_``'s coefficient
    ``min(1, max_norm / (total_norm + 1e-6))`` over the gradients it reads (2-norm)."""

    max_norm: float

    @property
    def __name__(self) -> str:  # read by Node.op_name
        return "clip_grad_norm"

    def kernel_bytes(self, graph: Graph, node: Node) -> tuple[int, ...]:
        return tuple(graph[name].meta.nbytes for name in node.inputs)

    def __call__(self, *grads: torch.Tensor) -> torch.Tensor:
        total = torch.nn.utils.get_total_norm(list(grads), 2.0)
        return torch.clamp(self.max_norm / (total + 1e-6), max=1.0)


class BoundOptimizer:
    """The user's optimizer as a plan's update nodes see it at one call: each group's
    hyperparameters as they are now, and where new states go."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: Mapping[str, torch.nn.Parameter]) -> None:
        self.optimizer = optimizer
        self.params = params

    def group(self, update: ParameterUpdate) -> dict[str, Any]:
        """The options of ``update``'s group now (its layout was checked as the step bound)."""
        return self.optimizer.param_groups[update.group]

    def keep_momentum_buffers(self, names: Sequence[str], buffers: Sequence[torch.Tensor | None]) -> None:
        """SGD's first step makes its momentum buffers: they go into ``optimizer.state`` as eager's do."""
        for name, buffer in zip(names, buffers):
            self.optimizer.state[self.params[name]]["momentum_buffer"] = buffer


def _state_keys(kind: str, group: Mapping[str, Any]) -> tuple[str, ...]:
    if kind == "sgd":
        return ("momentum_buffer",) if group["momentum"] != 0 else ()
    return ("step", "exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ())


def _update_workspace(kind: str, group: Mapping[str, Any], sizes: Sequence[int], foreach: bool, clipped: bool) -> int:
    """Bytes an update of parameters of ``sizes`` allocates while it runs (torch's ``_single_tensor_*``
    and ``_multi_tensor_*`` implementations): copies of the gradients (clipping, maximize, Adam's
    coupled weight decay, SGD's weight decay and Nesterov) and Adam's ``sqrt(v) / bc2`` denominators."""
    copies = int(clipped) + int(bool(group["maximize"]))
    if kind == "sgd":
        copies += int(group["weight_decay"] != 0) + int(bool(group["nesterov"]))
    else:
        coupled = kind == "adam" and not group.get("decoupled_weight_decay")
        copies += int(coupled and group["weight_decay"] != 0) + (1 if foreach else 2)
    return copies * (sum(sizes) if foreach else max(sizes, default=0))


def default_foreach(on_cuda: bool, group: Mapping[str, Any]) -> bool:
    """Whether eager's step updates a group with one multi-tensor kernel per operation (its default
    on CUDA: ``torch.optim.optimizer._default_to_fused_or_foreach``) or loops over the parameters."""
    if group.get("foreach") is not None:
        return bool(group["foreach"])
    return on_cuda and not group.get("fused") and not isinstance(group["lr"], torch.Tensor)


def with_optimizer(
    graph: Graph,
    optimizer: torch.optim.Optimizer,
    model: torch.nn.Module,
    max_grad_norm: float | None = None,
    on_cuda: bool = False,
) -> Graph:
    """``graph`` with ``optimizer``'s update of every parameter it trains after the backward, as eager's step.

    One :class:`ParameterUpdate` per param group (eager's order: the groups in turn, after
    the whole backward), its states as resident inputs, and with ``max_grad_norm`` a
    :class:`GradientNorm` node every update reads. The gradients of parameters the
    optimizer does not train stay outputs (they go to ``.grad``, as eager leaves them).
    ``optimizer`` must be one :func:`unplanned_reason` accepts.
    """
    kind = PLANNED_OPTIMIZERS[type(optimizer)]
    names = {id(p): name for name, p in model.named_parameters()}
    sig = graph.signature
    param_node = {name: node for node, name in sig.parameters.items()}
    trained = [
        (i, group, [names[id(p)] for p in group["params"] if names.get(id(p)) in sig.gradients])
        for i, group in enumerate(optimizer.param_groups)
    ]
    handle = Node(graph.fresh_name("optimizer"), None, role=Role.OPTIMIZER)
    added: list[Node] = [handle]
    updated = {name for _, _, params in trained for name in params}
    norm = None
    if max_grad_norm is not None:
        grads = [Ref(sig.gradients[name]) for name in sorted(updated, key=list(sig.gradients).index)]
        meta = graph[grads[0].name].meta
        norm = Node(
            graph.fresh_name("clip_coefficient"),
            GradientNorm(float(max_grad_norm)),
            tuple(grads),
            outputs=(TensorMeta((), meta.dtype, meta.dtype.itemsize, ()),),
            aliases=(None,),
            role=Role.UPDATE,
        )
        added.append(norm)
    states: dict[str, tuple[str, str]] = {}
    for i, group, params in trained:
        if not params:
            continue
        keys = _state_keys(kind, group)
        args: list[Any] = [Ref(handle.name), None if norm is None else Ref(norm.name)]
        for name in params:
            param = graph[param_node[name]].meta
            args += [Ref(param_node[name]), Ref(sig.gradients[name])]
            for key in keys:
                state = _state_node(graph, f"{name}.{key}", key, param, added)
                states[state.name] = (name, key)
                args.append(Ref(state.name))
        added.append(_update_node(graph, kind, i, group, params, keys, tuple(args), on_cuda, norm is not None))
    kept_gradients = {name: node for name, node in sig.gradients.items() if name not in updated}
    signature = replace(
        sig,
        gradients=kept_gradients,
        optimizer=handle.name,
        optimizer_states=states,
        optimizer_groups=group_layout(optimizer, model),
    )
    outputs = tuple(o for o in graph.outputs if o not in {sig.gradients[name] for name in updated})
    updates = tuple(n.name for n in added if isinstance(n.target, ParameterUpdate))
    extended = graph.replace(add=added)
    return Graph(extended.nodes, outputs + updates, signature, extended.order_edges)


def _state_node(graph: Graph, label: str, key: str, param: TensorMeta, added: list[Node]) -> Node:
    """The resident input holding one optimizer state of a parameter (Adam's ``step`` is a scalar)."""
    if key == "step":
        dtype = _get_scalar_dtype()
        meta = TensorMeta((), dtype, dtype.itemsize, ())
    else:
        meta = TensorMeta(param.shape, param.dtype, param.numel * param.dtype.itemsize, param.strides)
    node = Node(graph.fresh_name(f"state_{len(added)}"), None, outputs=(meta,), aliases=(None,), role=Role.OPTIMIZER)
    added.append(node)
    return node


def _update_node(
    graph: Graph,
    kind: str,
    index: int,
    group: Mapping[str, Any],
    params: Sequence[str],
    keys: tuple[str, ...],
    args: tuple,
    on_cuda: bool,
    clipped: bool,
) -> Node:
    foreach = default_foreach(on_cuda, group)
    per = 2 + len(keys)
    sizes = [graph[ref.name].meta.nbytes for ref in args[2::per]]
    options = tuple(sorted((k, v) for k, v in group.items() if k != "params"))
    target = ParameterUpdate(kind, index, tuple(params), keys, foreach, options)
    return update_node(graph, target, args, _update_workspace(kind, group, sizes, foreach, clipped))


def update_node(graph: Graph, target: ParameterUpdate, args: tuple, workspace: int) -> Node:
    """A node applying ``target`` to ``args``; its value is its first parameter, updated in place."""
    first = args[2].name
    inputs = list(dict.fromkeys(ref.name for ref in args if isinstance(ref, Ref)))
    name = graph.fresh_name(f"update_{target.params[0].replace('.', '_')}")
    return Node(
        name,
        target,
        args,
        outputs=(graph[first].meta,),
        aliases=((inputs.index(first), 0),),
        role=Role.UPDATE,
        workspace=workspace,
    )


def update_workspace(target: ParameterUpdate, sizes: Sequence[int], clipped: bool) -> int:
    """:func:`_update_workspace` of ``target`` over parameters (or, sliced, slices) of ``sizes``,
    and where ``summed`` the slice of the gradient's sum."""
    workspace = _update_workspace(target.kind, dict(target.options), sizes, target.foreach, clipped)
    return workspace + (max(sizes) if target.summed else 0)


def bound_optimizer_inputs(
    graph: Graph, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
) -> dict[str, Any]:
    """The optimizer's input nodes bound for one call: the :class:`BoundOptimizer` and every
    state tensor of ``optimizer.state``, made first as the optimizer's first step makes them
    (:func:`start_states`; SGD's momentum buffers are made by its first update, as in eager)."""
    sig = graph.signature
    if not sig.optimizer:
        return {}
    if optimizer is None:
        raise OptimizerError("this plan holds the optimizer's update: pass the optimizer it was made with")
    difference = layout_difference(sig.optimizer_groups, group_layout(optimizer, model))
    if difference is not None:  # before anything runs: an update refused midway would leave half a step
        raise OptimizerError(difference)
    params = dict(model.named_parameters())
    start_states(optimizer, [params[name] for name, _ in sig.optimizer_states.values()])
    env: dict[str, Any] = {sig.optimizer: BoundOptimizer(optimizer, params)}
    for node, (name, key) in sig.optimizer_states.items():
        env[node] = optimizer.state[params[name]].get(key)
    return env


def start_states(optimizer: torch.optim.Optimizer, params: Sequence[torch.nn.Parameter]) -> list[torch.Tensor]:
    """The states of ``params`` that ``optimizer``'s first step would make, made now, as Adam's and
    AdamW's ``_init_group`` makes them: zero moments and a zero step count (on the parameter's
    device where the group is fused or capturable). SGD makes its momentum buffers in its first
    update: none are made here. Returns the tensors made."""
    if PLANNED_OPTIMIZERS.get(type(optimizer)) not in ("adam", "adamw"):
        return []
    wanted = {id(p) for p in params}
    made: list[torch.Tensor] = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            if id(p) not in wanted or state:
                continue
            dtype = _get_scalar_dtype(is_fused=bool(group.get("fused")))
            if group.get("fused") or group.get("capturable"):
                state["step"] = torch.zeros((), dtype=dtype, device=p.device)
            else:
                state["step"] = torch.tensor(0.0, dtype=dtype)
            for key in ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ()):
                state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
            made += state.values()
    return made
