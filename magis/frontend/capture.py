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
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch._functorch.aot_autograd import aot_export_module
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
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


Slot = tuple[torch.nn.Module, str, str]  # (module, "_parameters" or "_buffers", attribute)


def aliased_slots(model: torch.nn.Module) -> list[tuple[Slot, Slot]]:
    """(alias slot, first slot) for every module attribute holding a tensor already held elsewhere.

    Tied weights (BERT's word embeddings and MLM decoder; T5's shared embedding, both
    stacks' ``embed_tokens`` and the LM head) are one tensor in several slots. The
    first slot, in ``named_parameters()`` order, names the tensor; a module reached
    twice (T5's ``shared`` is also ``encoder.embed_tokens``) is one slot, not a tie.
    """
    first: dict[int, Slot] = {}
    seen: set[tuple[int, str, str]] = set()
    aliases: list[tuple[Slot, Slot]] = []
    for module in model.modules():
        for kind in ("_parameters", "_buffers"):
            for attr, tensor in getattr(module, kind).items():
                if tensor is None or (id(module), kind, attr) in seen:
                    continue
                seen.add((id(module), kind, attr))
                slot = (module, kind, attr)
                if id(tensor) in first:
                    aliases.append((slot, first[id(tensor)]))
                else:
                    first[id(tensor)] = slot
    return aliases


@contextlib.contextmanager
def aliases_bound(aliases: list[tuple[Slot, Slot]]) -> Iterator[None]:
    """Point every alias slot at what its first slot holds now, and back afterwards.

    AOTAutograd rebinds one slot per tensor to its traced input (the step module lists
    each shared tensor once); the aliases must read that same input so that autograd
    sums the gradient over every use, as eager PyTorch accumulates one ``.grad``.
    """
    saved = [getattr(module, kind)[attr] for (module, kind, attr), _ in aliases]
    for (module, kind, attr), (first_module, first_kind, first_attr) in aliases:
        getattr(module, kind)[attr] = getattr(first_module, first_kind)[first_attr]
    try:
        yield
    finally:
        for ((module, kind, attr), _), tensor in zip(aliases, saved):
            getattr(module, kind)[attr] = tensor


class StepModule(torch.nn.Module):
    """What AOTAutograd exports: ``model`` with one input per distinct tensor.

    ``aot_export_module`` lists parameters and buffers with ``remove_duplicate=False``,
    one input per name of a shared tensor; the rebinding of one name's slot then
    leaves the other names' inputs unused, without gradient (T5's tied embedding lost
    its gradient that way). Here each tensor is listed once, under its first name,
    and subclasses run the model inside :func:`aliases_bound`.
    """

    def __init__(self, model: torch.nn.Module, loss_fn: LossFn | None) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.aliases = aliased_slots(model)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Iterator:
        return super().named_parameters(prefix, recurse, remove_duplicate=True)

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Iterator:
        return super().named_buffers(prefix, recurse, remove_duplicate=True)

    def loss(self, *inputs: Any) -> torch.Tensor:
        """``loss_fn(model(*inputs))`` (or :func:`default_loss`), checked to be a scalar.
        Callers run it inside ``aliases_bound(self.aliases)``."""
        output = self.model(*inputs)
        loss = default_loss(output) if self.loss_fn is None else self.loss_fn(output)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise CaptureError("loss_fn must return a scalar tensor")
        return loss


class _TrainingStep(StepModule):
    """Model + loss as the module AOTAutograd exports: forward returns ``(loss,)``."""

    def forward(self, *inputs: Any) -> tuple[torch.Tensor]:
        with aliases_bound(self.aliases):
            return (self.loss(*inputs),)


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
    try:
        with (
            _without_stack_traces(),
            traced_as_by_compile(),
            FusedAttentionMasks() if _on_cuda(model) else contextlib.nullcontext(),
            planning_mode(model, example_inputs) as inputs,
        ):
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
    fuse_silu_backward(gm)
    propagate_fake_values(gm)
    graph = graph_from_fx(gm, sig)
    return Captured(graph, time.perf_counter() - start)


@contextlib.contextmanager
def planning_mode(model: torch.nn.Module, example_inputs: Sequence[Any]) -> Iterator[tuple[Any, ...]]:
    """The example inputs, ready to trace with a model that holds no real weights.

    A model built on the meta device (``with torch.device("meta")``, accelerate's
    ``init_empty_weights``) or under a ``FakeTensorMode`` is planned, not run. Its
    forward may still make real tensors along the way (a rotary embedding's positions,
    an empty KV cache), which a strict fake mode refuses; so tracing runs in the
    model's own fake mode (or a new one) told to accept them as constants, with the
    inputs turned into that mode's fake tensors. Meta weights and inputs are stood in
    for, while tracing, by fake CPU tensors of their shapes (meta tensors carry no
    device a kernel could be picked for). A model with real weights is traced as it is.
    """
    inputs = tuple(example_inputs)
    state = [*model.parameters(), *model.buffers()]
    tensors = [t for t in (*state, *inputs) if isinstance(t, torch.Tensor)]
    modes = {id(t.fake_mode): t.fake_mode for t in tensors if isinstance(t, FakeTensor)}
    on_meta = any(t.device.type == "meta" for t in tensors)
    if len(modes) > 1:
        raise CaptureError("the model and its inputs hold fake tensors of different FakeTensorModes: build them in one")
    if not modes and not on_meta:
        yield inputs
        return
    mode = next(iter(modes.values())) if modes else FakeTensorMode(allow_non_fake_inputs=True)
    strict = mode.allow_non_fake_inputs
    mode.allow_non_fake_inputs = True
    try:
        with _meta_state_faked(model, mode):
            yield tuple(_as_fake(x, mode) for x in inputs)
    finally:
        mode.allow_non_fake_inputs = strict


def _as_fake(value: Any, mode: FakeTensorMode) -> Any:
    """A fake tensor of ``mode`` for ``value`` (a meta tensor becomes a fake CPU one)."""
    if not isinstance(value, torch.Tensor) or isinstance(value, FakeTensor):
        return value
    if value.device.type != "meta":
        return mode.from_tensor(value)
    with mode:
        fake = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="cpu")
    if isinstance(value, torch.nn.Parameter):
        return torch.nn.Parameter(fake, requires_grad=value.requires_grad)
    return fake.requires_grad_(value.requires_grad)


@contextlib.contextmanager
def _meta_state_faked(model: torch.nn.Module, mode: FakeTensorMode) -> Iterator[None]:
    """Every meta parameter and buffer of ``model`` replaced by a fake twin (shared
    tensors by one twin), and put back afterwards."""
    twins: dict[int, torch.Tensor] = {}
    swapped: list[tuple[dict, str, torch.Tensor]] = []
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for attr, tensor in table.items():
                if tensor is None or tensor.device.type != "meta" or isinstance(tensor, FakeTensor):
                    continue
                if id(tensor) not in twins:
                    twins[id(tensor)] = _as_fake(tensor, mode)
                swapped.append((table, attr, tensor))
                table[attr] = twins[id(tensor)]
    try:
        yield
    finally:
        for table, attr, tensor in swapped:
            table[attr] = tensor


@contextlib.contextmanager
def traced_as_by_compile() -> Iterator[None]:
    """``torch.compiler.is_compiling()`` is True while the step is traced, as under torch.compile.

    Libraries guard checks on tensor values that only pick a fast path or warn (e.g.
    transformers' "padding without an attention mask" warning reads ``input_ids``)
    with it, and take the traceable path when compiled; a graph capture is a trace
    too. The eager reference keeps the flag as it was (False).
    """
    before = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = True
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag = before


class FusedAttentionMasks(torch.overrides.TorchFunctionMode):
    """While tracing, a CUDA attention mask broadcast along the keys is made contiguous.

    Traced as under torch.compile (:func:`traced_as_by_compile`), transformers cannot
    check that every token attends (a data-dependent ``.all()``) and passes an explicit
    boolean mask, expanded with stride 0 along the keys, where eager passes none. CUDA's
    fused kernels (memory-efficient, cuDNN) refuse a mask whose last stride is not 1,
    so ``scaled_dot_product_attention`` took the math path: the score and probability
    matrices materialized (BERT small on an H100: the captured step peaked at 1.57x
    eager's) and dropout drawn by ``native_dropout`` instead of the kernel's own
    generator (gradients unlike eager's). A contiguous copy of the mask (the size of one
    score matrix per batch and head group, in the mask's dtype) lets the fused kernel
    run, as in eager. Entered for a model on CUDA only: on CPU dropout sends attention to
    the math path in eager as well.
    """

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.nn.functional.scaled_dot_product_attention:
            args, kwargs = _with_contiguous_mask(args, kwargs)
        return func(*args, **kwargs)


def _on_cuda(model: torch.nn.Module) -> bool:
    return any(p.device.type == "cuda" for p in model.parameters())


def _with_contiguous_mask(args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """``scaled_dot_product_attention``'s arguments, its mask made contiguous along the keys."""
    mask_in_args = len(args) > 3
    mask = args[3] if mask_in_args else kwargs.get("attn_mask")
    if not isinstance(mask, torch.Tensor) or mask.dim() == 0 or mask.stride(-1) == 1:
        return args, kwargs
    if mask_in_args:
        return (*args[:3], mask.contiguous(), *args[4:]), kwargs
    return args, {**kwargs, "attn_mask": mask.contiguous()}


@contextlib.contextmanager
def _without_stack_traces() -> Iterator[None]:
    """Tracing records a Python stack trace per node unless told not to: ~10% of capture time.
    (The switch is newer than torch 2.4; without it the traces are recorded.)"""
    if not hasattr(torch.fx.config, "do_not_emit_stack_traces"):
        yield
        return
    before = torch.fx.config.do_not_emit_stack_traces
    torch.fx.config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        torch.fx.config.do_not_emit_stack_traces = before


def _parameters_without_gradient(step: _TrainingStep, inputs: tuple) -> list[torch.nn.Parameter]:
    """Trainable parameters the loss has no gradient path to: unread (BERT's pooler under an
    MLM loss) or read only where no gradient flows (an index or a comparison: MRA, Canine).

    AOTAutograd refuses to export a joint graph where a parameter gets no gradient, so
    the loss is computed once on fake tensors and its autograd graph walked back to
    the leaves it reaches; the others are frozen for the capture.
    """
    params = dict(step.named_parameters())
    faked = [t for t in (*params.values(), *inputs) if isinstance(t, FakeTensor)]
    mode = faked[0].fake_mode if faked else FakeTensorMode(allow_non_fake_inputs=True)
    fakes = {name: _fake_leaf(p, mode) for name, p in params.items()}
    with mode, torch.enable_grad():
        args = tuple(_fake_leaf(x, mode) if isinstance(x, torch.Tensor) else x for x in inputs)
        (loss,) = torch.func.functional_call(step, fakes, args)
    reached: set[int] = set()
    seen: set[Any] = set()
    stack = [loss.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if hasattr(fn, "variable"):  # AccumulateGrad: a leaf the gradient reaches
            reached.add(id(fn.variable))
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return [params[name] for name, fake in fakes.items() if fake.requires_grad and id(fake) not in reached]


def _fake_leaf(tensor: torch.Tensor, mode: FakeTensorMode) -> torch.Tensor:
    """``tensor`` as a fake tensor of ``mode`` (itself if it is one), a leaf that requires
    grad as the original does."""
    if isinstance(tensor, FakeTensor):
        return tensor
    fake = mode.from_tensor(tensor.detach())
    return fake.requires_grad_(tensor.requires_grad)


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


def _silu_backward_decomposed(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """SiLU's gradient as the joint trace writes it (autograd's twice-differentiable form)."""
    aten = torch.ops.aten
    sigmoid = aten.sigmoid.default(x)
    ones = aten.fill.Scalar(aten.empty_like.default(sigmoid, memory_format=torch.preserve_format), 1)
    factor = aten.add.Scalar(aten.mul.Tensor(x, aten.sub.Tensor(ones, sigmoid)), 1)
    return aten.mul.Tensor(grad, aten.mul.Tensor(sigmoid, factor))


def _silu_backward_fused(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.silu_backward.default(grad, x)


def fuse_silu_backward(gm: torch.fx.GraphModule) -> int:
    """Put back the one ``silu_backward`` kernel an eager backward runs; returns how many.

    Autograd's formula for SiLU (and so SwiGLU's gradient) takes a twice-differentiable
    form of seven kernels (sigmoid, fill, sub, add, three muls) when grad mode is on, as
    it is in AOTAutograd's joint trace; a plain ``loss.backward()`` runs with grad mode
    off and calls the fused kernel. The
    captured step must be the step eager PyTorch runs, in time and in memory (the
    decomposed form holds three temporaries of the activation's size). Call before
    :func:`propagate_fake_values`, which gives the new nodes their values.
    """
    from torch.fx.subgraph_rewriter import replace_pattern

    for node in list(gm.graph.nodes):  # the trace's unused detaches would hold the sigmoid in place
        if node.target is torch.ops.aten.detach.default and not node.users:
            gm.graph.erase_node(node)
    return len(replace_pattern(gm, _silu_backward_decomposed, _silu_backward_fused))


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
