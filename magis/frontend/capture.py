"""Capture a whole training step (forward, loss, backward) as one aten-level graph.

AOTAutograd (``aot_export_module`` with ``trace_joint=True``) traces the step with
fake tensors and functionalizes it: no in-place op or mutation is left, buffer
updates (BatchNorm running statistics) become outputs. This module converts that
fx graph into :class:`magis.ir.Graph`, reading storage aliasing (views, getitem)
off the fake tensors so the simulator counts memory exactly as the allocator does.
"""

from __future__ import annotations

import contextlib
import itertools
import operator
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.fx
from torch._functorch.aot_autograd import aot_export_module
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.multiprocessing.reductions import StorageWeakRef

from magis.ir.graph import Graph, Node, Ref, Role, Signature, TensorMeta

LossFn = Callable[[Any], torch.Tensor]


class CaptureError(RuntimeError):
    """The model, its inputs or its loss cannot be captured; the message names the cause."""


@dataclass(frozen=True)
class Captured:
    """A captured graph and how long capture took."""

    graph: Graph
    seconds: float


def default_loss(output: Any) -> torch.Tensor:
    """The transformers convention: a scalar output is the loss, else ``output.loss``."""
    if isinstance(output, torch.Tensor):
        if output.dim() != 0:
            raise CaptureError(
                f"the model returned a tensor of shape {tuple(output.shape)}, not a scalar loss: pass loss_fn"
            )
        return output
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if not isinstance(loss, torch.Tensor):
        raise CaptureError(
            f"the model returned {type(output).__name__} without a .loss tensor: pass loss_fn(output) -> scalar"
        )
    return loss


@dataclass(frozen=True, eq=False)
class Constant:
    """A tensor baked into the traced program (made inside ``forward``, e.g. ``torch.tensor(-inf)``)."""

    value: torch.Tensor
    __name__ = "constant"

    def __call__(self) -> torch.Tensor:
        return self.value


class _TrainingStep(torch.nn.Module):
    """Wraps model + loss as the module AOTAutograd exports: forward returns ``(loss,)``."""

    def __init__(self, model: torch.nn.Module, loss_fn: LossFn | None) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, *inputs: Any) -> tuple[torch.Tensor]:
        output = self.model(*inputs)
        loss = default_loss(output) if self.loss_fn is None else self.loss_fn(output)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise CaptureError("loss_fn must return a scalar tensor")
        return (loss,)


def capture(model: torch.nn.Module, example_inputs: Sequence[Any], loss_fn: LossFn | None = None) -> Graph:
    """Trace ``loss_fn(model(*example_inputs))`` and its backward into one :class:`Graph`.

    The model may hold real or fake tensors (a model built under ``FakeTensorMode``
    traces without allocating its weights). Returns the functional joint graph whose
    outputs are the loss, every parameter gradient and every buffer update.
    """
    return capture_timed(model, example_inputs, loss_fn).graph


def capture_timed(model: torch.nn.Module, example_inputs: Sequence[Any], loss_fn: LossFn | None = None) -> Captured:
    """:func:`capture`, also reporting the seconds it took."""
    if not isinstance(model, torch.nn.Module):
        raise CaptureError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(example_inputs, (tuple, list)):
        raise CaptureError("example_inputs must be a tuple of positional arguments")
    if not any(p.requires_grad for p in model.parameters()):
        raise CaptureError("the model has no parameter that requires grad: there is no training step to capture")
    start = time.perf_counter()
    step = _TrainingStep(model, loss_fn)
    inputs = tuple(example_inputs)
    try:
        with _without_stack_traces():
            try:
                gm, sig = aot_export_module(step, inputs, trace_joint=True, output_loss_index=0)
            except AssertionError as err:
                if "did not receive a gradient" not in str(err):
                    raise
                with _frozen(_parameters_without_gradient(step, inputs)):
                    gm, sig = aot_export_module(step, inputs, trace_joint=True, output_loss_index=0)
    except CaptureError:
        raise
    except Exception as err:
        raise CaptureError(explain_capture_failure(err)) from err
    propagate_fake_values(gm)
    graph = merge_tied_parameters(graph_from_fx(gm, sig), tied_parameters(model))
    return Captured(graph, time.perf_counter() - start)


@contextlib.contextmanager
def _without_stack_traces() -> Iterator[None]:
    """Tracing records a Python stack trace per node unless told not to: ~10% of capture time."""
    before = torch.fx.config.do_not_emit_stack_traces
    torch.fx.config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        torch.fx.config.do_not_emit_stack_traces = before


def _parameters_without_gradient(step: _TrainingStep, inputs: tuple) -> list[torch.nn.Parameter]:
    """Trainable parameters the loss does not depend on (e.g. BERT's pooler under an MLM loss).

    AOTAutograd refuses to export a joint graph where a parameter gets no gradient,
    so these are found from a forward-only export and frozen for the capture.
    """
    gm, sig = aot_export_module(step, inputs, trace_joint=False)
    placeholders = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    params = dict(step.named_parameters(remove_duplicate=False))
    return [
        params[name]
        for node, name in sig.inputs_to_parameters.items()
        if not placeholders[node].users and params[name].requires_grad
    ]


@contextlib.contextmanager
def _frozen(params: list[torch.nn.Parameter]) -> Iterator[None]:
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in params:
            p.requires_grad_(True)


def explain_capture_failure(err: Exception) -> str:
    """A :class:`CaptureError` message naming the cause of a tracing failure."""
    text = f"{type(err).__name__}: {err}".strip()
    first = text.splitlines()[0] if text else type(err).__name__
    kind = type(err).__name__
    if "DataDependent" in kind or "data-dependent" in text or "GuardOnDataDependent" in text:
        return (
            "the model has data-dependent Python control flow (a branch or loop on a tensor's value, "
            f".item() or .tolist()), which a graph cannot capture: {first}"
        )
    if "DynamicOutputShape" in kind or "dynamic output shape" in text.lower():
        return f"an op has a data-dependent output shape (e.g. nonzero, masked_select, unique): {first}"
    return f"could not capture the training step: {first}"


def propagate_fake_values(gm: torch.fx.GraphModule) -> None:
    """Re-run the exported graph on fresh fake tensors so ``meta['val']`` shares storage
    wherever the real run would (the exported metadata loses view relationships)."""
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    with mode:
        inputs = [
            torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
            for v in (n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder")
        ]
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*inputs)


def _unprefix(name: str) -> str:
    return name.removeprefix("model.")


def graph_from_fx(gm: torch.fx.GraphModule, sig: Any) -> Graph:
    """Convert AOTAutograd's joint fx graph and its signature into a :class:`Graph`."""
    signature = Signature(
        parameters={k: _unprefix(v) for k, v in sig.inputs_to_parameters.items()},
        buffers={k: _unprefix(v) for k, v in sig.inputs_to_buffers.items()},
        user_inputs=tuple(sig.user_inputs),
        loss=sig.user_outputs[0],
        gradients={_unprefix(p): name for name, p in sig.backward_signature.gradients_to_parameters.items()},
        buffer_updates={_unprefix(b): name for name, b in sig.buffers_to_mutate.items()},
    )
    return graph_from_step_fx(gm, signature)


def graph_from_step_fx(gm: torch.fx.GraphModule, signature: Signature) -> Graph:
    """Convert a functional fx graph of a whole training step into a :class:`Graph`.

    ``gm`` holds forward, loss and backward, with fake values in ``meta['val']`` (see
    :func:`propagate_fake_values`); its outputs are the step's outputs. ``signature``
    names its parameter, buffer and user-input placeholders, the loss node, and the
    gradient and buffer-update nodes; node roles are read from it.
    """
    fx_nodes = list(gm.graph.nodes)
    output_node = fx_nodes[-1]
    assert output_node.op == "output"
    out_args = list(output_node.args[0])
    grads = signature.gradients
    updates = signature.buffer_updates
    loss = signature.loss
    loss_ancestors = _fx_ancestors(gm, loss)

    storage_owner: dict[StorageWeakRef, tuple[str, int]] = {}
    elements: dict[str, tuple[tuple[str, int] | None, ...]] = {}  # node -> root storage per element
    nodes: list[Node] = []
    for fn in fx_nodes[:-1]:
        if fn.op == "placeholder":
            target, args, kwargs = None, (), ()
            role = (
                Role.PARAMETER
                if fn.name in signature.parameters
                else Role.BUFFER
                if fn.name in signature.buffers
                else Role.INPUT
            )
        elif fn.op == "get_attr":
            target, args, kwargs, role = Constant(getattr(gm, fn.target)), (), (), Role.CONSTANT
        elif fn.op == "call_function":
            target = fn.target
            _check_supported(fn)
            args = _to_refs(fn.args)
            kwargs = tuple(sorted((k, _to_refs(v)) for k, v in fn.kwargs.items()))
            role = _role(fn.name, loss, loss_ancestors, grads, updates)
        else:
            raise CaptureError(f"unexpected fx node {fn.op} {fn.target} in the captured graph")
        val = fn.meta.get("val")
        tuple_output = isinstance(val, (tuple, list))
        vals = list(val) if tuple_output else [val]
        inputs = [n.name for n in fn.all_input_nodes]
        inputs = list(dict.fromkeys(inputs))
        metas: list[TensorMeta | None] = []
        aliases: list[tuple[int, int] | None] = []
        roots: list[tuple[str, int] | None] = []
        for e, v in enumerate(vals):
            if not isinstance(v, torch.Tensor):
                if v is not None:
                    raise CaptureError(f"op {fn.target} returns a non-tensor value ({type(v).__name__})")
                metas.append(None)
                aliases.append(None)
                roots.append(None)
                continue
            key = StorageWeakRef(v.untyped_storage())
            metas.append(TensorMeta.of(v))
            root = storage_owner.get(key)
            if root is None:
                storage_owner[key] = (fn.name, e)
                aliases.append(None)
                roots.append((fn.name, e))
            else:
                aliases.append(_alias_position(root, inputs, elements, fn))
                roots.append(root)
        elements[fn.name] = tuple(roots)
        random = draws_random_numbers(target, fn.args, fn.kwargs)
        nodes.append(
            Node(
                name=fn.name,
                target=target,
                args=args,
                kwargs=kwargs,
                outputs=tuple(metas),
                aliases=tuple(aliases),
                role=role,
                random=random,
                tuple_output=tuple_output,
            )
        )

    outputs = tuple(a.name for a in out_args if isinstance(a, torch.fx.Node))
    nodes = _drop_dead(nodes, set(outputs))
    randoms = [n.name for n in nodes if n.random]
    order_edges = tuple(itertools.pairwise(randoms))
    return Graph(tuple(nodes), outputs, signature, order_edges)


def draws_random_numbers(target: Any, args: tuple, kwargs: dict[str, Any]) -> bool:
    """Whether the op reads the random stream: it is tagged ``nondeterministic_seeded``,
    unless its randomness is a ``dropout_p`` argument that is zero (fused attention
    without dropout draws nothing, and so may be split or recomputed like any op)."""
    if not isinstance(target, torch._ops.OpOverload) or torch.Tag.nondeterministic_seeded not in target.tags:
        return False
    names = [a.name for a in target._schema.arguments]
    if "dropout_p" not in names:
        return True
    position = names.index("dropout_p")
    dropout_p = args[position] if position < len(args) else kwargs.get("dropout_p", 0.0)
    return dropout_p != 0


def tied_parameters(model: torch.nn.Module) -> dict[str, str]:
    """Each extra name of a shared parameter -> its first name (as ``named_parameters()`` lists it)."""
    first: dict[int, str] = {}
    tied: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            tied[name] = first[id(param)]
        else:
            first[id(param)] = name
    return tied


def merge_tied_parameters(graph: Graph, tied: dict[str, str]) -> Graph:
    """One input per shared parameter, and one gradient: the sum over its uses.

    AOTAutograd passes a tied weight (e.g. BERT's word embeddings and MLM decoder)
    once per name and returns a gradient per name; eager PyTorch holds one tensor
    and accumulates one ``.grad``. Counting it twice would also double its memory.
    """
    if not tied:
        return graph
    sig = graph.signature
    node_of = {pname: node for node, pname in sig.parameters.items()}
    rename = {node_of[alias]: node_of[canon] for alias, canon in tied.items()}
    grads = dict(sig.gradients)
    outputs = list(graph.outputs)
    added: list[Node] = []
    for alias, canon in tied.items():
        extra = grads.pop(alias, None)
        if extra is None:
            continue
        if canon not in grads:
            grads[canon] = extra
            continue
        meta = graph[grads[canon]].meta
        total = graph.fresh_name(f"tied_grad_{len(added)}")
        added.append(
            Node(
                name=total,
                target=torch.ops.aten.add.Tensor,
                args=(Ref(grads[canon]), Ref(extra)),
                outputs=(TensorMeta(meta.shape, meta.dtype, meta.numel * meta.dtype.itemsize),),
                aliases=(None,),
                role=Role.GRADIENT,
            )
        )
        outputs = [o for o in outputs if o not in (grads[canon], extra)] + [total]
        grads[canon] = total
    merged = graph.replace(remove=rename, add=added, rename=rename)
    parameters = {node: name for node, name in sig.parameters.items() if node not in rename}
    signature = replace(merged.signature, parameters=parameters, gradients=grads)
    return Graph(merged.nodes, tuple(rename.get(o, o) for o in outputs), signature, merged.order_edges)


def _alias_position(
    root: tuple[str, int],
    inputs: list[str],
    elements: dict[str, tuple[tuple[str, int] | None, ...]],
    fn: torch.fx.Node,
) -> tuple[int, int]:
    """The (input position, element) whose storage this view shares."""
    for pos, name in enumerate(inputs):
        for k, r in enumerate(elements[name]):
            if r == root:
                return (pos, k)
    raise CaptureError(f"{fn.name} ({fn.target}) aliases a tensor that is not one of its inputs")


def _check_supported(fn: torch.fx.Node) -> None:
    target = fn.target
    if target is operator.getitem:
        return
    if not isinstance(target, torch._ops.OpOverload):
        raise CaptureError(f"unsupported operation {target!r} in the captured graph (node {fn.name})")
    if target._schema.is_mutable:
        raise CaptureError(f"in-place op {target} survived functionalization (node {fn.name}); it cannot be reordered")


def _to_refs(value: Any) -> Any:
    if isinstance(value, torch.fx.Node):
        return Ref(value.name)
    if isinstance(value, tuple):
        return tuple(_to_refs(v) for v in value)
    if isinstance(value, list):
        return [_to_refs(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_refs(v) for k, v in value.items()}
    return value


def _fx_ancestors(gm: torch.fx.GraphModule, name: str) -> set[str]:
    by_name = {n.name: n for n in gm.graph.nodes}
    seen: set[str] = set()
    stack = [by_name[name]]
    while stack:
        n = stack.pop()
        if n.name not in seen:
            seen.add(n.name)
            stack.extend(n.all_input_nodes)
    return seen


def _role(name: str, loss: str, forward: set[str], grads: dict[str, str], updates: dict[str, str]) -> Role:
    if name == loss:
        return Role.LOSS
    if name in grads.values():
        return Role.GRADIENT
    if name in updates.values():
        return Role.BUFFER_UPDATE
    return Role.ACTIVATION if name in forward else Role.BACKWARD


def _drop_dead(nodes: list[Node], outputs: set[str]) -> list[Node]:
    """Remove pure nodes whose value nobody reads (AOTAutograd leaves some ``detach``)."""
    used: set[str] = set(outputs)
    keep: list[Node] = []
    for n in reversed(nodes):
        if n.name in used or n.is_input or n.random:
            keep.append(n)
            used.update(n.inputs)
    return keep[::-1]
