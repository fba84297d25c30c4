"""Capture a whole training step (forward, loss, backward) as one aten-level graph, or an
inference step (the forward alone).

AOTAutograd (``aot_export_module`` with ``trace_joint=True``) traces the step with
fake tensors and functionalizes it: no in-place op or mutation is left, buffer
updates (BatchNorm running statistics) become outputs. The step is the user's
(:mod:`magis.frontend.step`: their batch, their loss or training step);
:mod:`magis.frontend.fx_graph` converts the exported graph into :class:`magis.ir.Graph`.
:func:`capture_forward` traces ``model(*batch)`` alone (``trace_joint=False``, no
gradients): the graph of an inference plan, whose outputs are the output's tensors.
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
import sysconfig
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch._functorch.aot_autograd import aot_export_module
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.utils.checkpoint import CheckpointFunction

from magis.frontend.conditions import (
    autocast_as,
    autocast_off,
    autocast_state,
    changed_while_traced,
    initialized_while_traced,
    module_records,
    restore_settings,
)
from magis.frontend.fx_graph import graph_from_fx
from magis.frontend.rnn import ExactRNNs
from magis.frontend.step import (
    BatchSpec,
    CaptureError,
    LossFn,
    StepOutput,
    TrainingStep,
    UserStep,
    as_batch,
    user_model,
)
from magis.frontend.step import default_loss as default_loss  # re-exported: the peers' steps import it from here
from magis.ir.graph import Graph

T = TypeVar("T")


@dataclass(frozen=True)
class Captured:
    """A captured graph and how long capture took; for a forward (:func:`capture_forward`), also
    the structure of its output, whose tensors are the graph's ``signature.results`` in order;
    for a training step, the structure of what it returns (its tensors but the loss: ``results``)."""

    graph: Graph
    seconds: float
    output_spec: pytree.TreeSpec | None = None
    step_output: StepOutput = field(default_factory=StepOutput)
    #: where a forward's output holds ``None`` (positions among ``output_spec``'s leaves)
    output_nones: tuple[int, ...] = ()


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

    Its inputs are the batch's tensors, flattened as ``batch`` records
    (:class:`~magis.frontend.step.BatchSpec`), or the model's positional arguments
    when ``batch`` is None.

    ``autocast`` is the caller's autocast state where the module is made; subclasses run the
    user's step inside it, and the trace runs with autocast off around it (:func:`_tracing`):
    AOTAutograd traces the joint graph it recorded once more, and under the caller's autocast
    that second trace would cast again what the step ran with autocast disabled (an attention's
    softmax in float32 inside ``torch.autocast(..., enabled=False)``).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        loss_fn: LossFn | None = None,
        *,
        training_step: TrainingStep | None = None,
        batch: BatchSpec | None = None,
    ) -> None:
        super().__init__()
        self.model = model
        self.step = UserStep(loss_fn, training_step)
        self.batch = batch
        self.aliases = aliased_slots(model)
        self.autocast = autocast_state()

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Iterator:
        return super().named_parameters(prefix, recurse, remove_duplicate=True)

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Iterator:
        return super().named_buffers(prefix, recurse, remove_duplicate=True)

    def batch_of(self, inputs: tuple) -> Any:
        """The user's batch from the graph's ``inputs``."""
        return inputs if self.batch is None else self.batch.rebuild(inputs)

    def loss(self, *inputs: Any) -> torch.Tensor:
        """The step's scalar loss on the batch ``inputs`` make (:class:`~magis.frontend.step.UserStep`).
        Callers run it inside ``aliases_bound(self.aliases)``."""
        return self.step.loss(self.model, self.batch_of(inputs))


class _TrainingStep(StepModule):
    """Model + loss as the module AOTAutograd exports: forward returns ``(loss, *others)``, the
    other tensors the user's step returns detached (the backward is of the loss alone);
    ``step_output`` is the structure of what the step returned."""

    step_output: StepOutput = StepOutput()

    def forward(self, *inputs: Any) -> tuple[torch.Tensor, ...]:
        with (
            autocast_as(self.autocast),
            aliases_bound(self.aliases),
            _no_backward_in_the_step(),
            _tensor_hooks_warned(),
        ):
            loss, others, self.step_output = self.step.returned(self.model, self.batch_of(inputs))
        return (loss, *(other.detach() for other in others))


@contextlib.contextmanager
def _no_backward_in_the_step() -> Iterator[None]:
    """A ``CaptureError`` where the user's step runs a backward itself (``loss.backward()``,
    ``torch.autograd.grad``): the step a plan takes returns the loss, and the plan runs the
    backward. Only around the user's step: AOTAutograd differentiates the loss after it."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise CaptureError(
            "the step runs a backward itself (loss.backward(), or torch.autograd.grad as a gradient "
            "penalty does): a plan holds one backward, of the loss the step returns. Return the loss; the "
            "plan runs its backward and leaves .grad as loss.backward() would (a backward inside the "
            "loss, double backward, is not supported)"
        )

    backward, grad = torch.autograd.backward, torch.autograd.grad
    torch.autograd.backward, torch.autograd.grad = refuse, refuse
    try:
        yield
    finally:
        torch.autograd.backward, torch.autograd.grad = backward, grad


@contextlib.contextmanager
def _tensor_hooks_warned() -> Iterator[None]:
    """A warning where the user's step hooks a tensor it computes (``h.register_hook(fn)``,
    ``h.retain_grad()``), as :func:`~magis.frontend.conditions.warn_of_hooks` warns of a module's
    hooks: the trace runs the hook once, so what it computes on the gradient a plan computes at
    every call, and anything else it does (appending the gradient to a list, a ``.grad`` kept on
    the activation) happens in that trace only. Only around the user's step; torch's own hooks
    (a module's backward hooks) are not the user's."""
    register_hook, retain_grad = torch.Tensor.register_hook, torch.Tensor.retain_grad

    def warned(method: Callable[..., Any], name: str) -> Callable[..., Any]:
        def hooked(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1).f_code.co_filename
            if _model_facing(caller) and not _under(os.path.abspath(caller), os.path.join(_TORCH, "nn")):
                warnings.warn(
                    f"the step calls {name} on a tensor it computes ({caller}:{sys._getframe(1).f_lineno}): a "
                    "plan runs what the hook computes on the gradient, traced once; anything else (recording the "
                    "gradient, a .grad retained on the activation) happens in that trace only, not at each call",
                    stacklevel=2,
                )
            return method(tensor, *args, **kwargs)

        return hooked

    torch.Tensor.register_hook = warned(register_hook, "register_hook")  # type: ignore[method-assign]
    torch.Tensor.retain_grad = warned(retain_grad, "retain_grad")  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.register_hook, torch.Tensor.retain_grad = register_hook, retain_grad  # type: ignore[method-assign]


class _ForwardStep(StepModule):
    """The model's forward as the module AOTAutograd exports: returns the output's tensors,
    flattened (:mod:`torch.utils._pytree`); ``output_spec`` is the output's structure, and
    ``output_nones`` where its leaves are ``None`` (``(logits, None)``: no tensor to compute)."""

    output_spec: pytree.TreeSpec | None = None
    output_nones: tuple[int, ...] = ()

    def forward(self, *inputs: Any) -> tuple[torch.Tensor, ...]:
        with autocast_as(self.autocast), aliases_bound(self.aliases):
            output = UserStep.output(self.model, self.batch_of(inputs))
        leaves, self.output_spec = pytree.tree_flatten(output)
        self.output_nones = tuple(i for i, leaf in enumerate(leaves) if leaf is None)
        leaves = [leaf for leaf in leaves if leaf is not None]
        others = [type(leaf).__name__ for leaf in leaves if not isinstance(leaf, torch.Tensor)]
        if others or not leaves:
            raise CaptureError(
                "an inference plan returns the model's output tensors: the output holds "
                + (f"a {others[0]}, which is not a tensor" if others else "no tensor")
                + (
                    " (a transformers model returns its key/value cache: set model.config.use_cache = False)"
                    if any("Cache" in kind for kind in others)
                    else ""
                )
            )
        return tuple(leaves)


def capture(
    model: torch.nn.Module, batch: Any, loss_fn: LossFn | None = None, *, training_step: TrainingStep | None = None
) -> Graph:
    """Trace one training step on ``batch`` and its backward into one :class:`Graph`.

    ``batch``, ``loss_fn`` and ``training_step`` are the user's step
    (:mod:`magis.frontend.step`): ``loss_fn(model(*batch))`` or ``training_step(model,
    *batch)``, a mapping passed as keyword arguments. The graph's user inputs are the
    batch's tensors in :class:`~magis.frontend.step.BatchSpec`'s order, made contiguous.
    The model may hold real or fake tensors (a model built under ``FakeTensorMode``
    traces without allocating its weights). Returns the functional joint graph whose
    outputs are the loss, every parameter gradient and every buffer update.
    """
    return capture_timed(model, batch, loss_fn, training_step=training_step).graph


def capture_timed(
    model: torch.nn.Module, batch: Any, loss_fn: LossFn | None = None, *, training_step: TrainingStep | None = None
) -> Captured:
    """:func:`capture`, also reporting the seconds it took."""
    model = user_model(model)
    spec = BatchSpec.of(batch)
    step = _TrainingStep(model, loss_fn, training_step=training_step, batch=spec)
    if not any(p.requires_grad for p in model.parameters()):
        raise CaptureError("the model has no parameter that requires grad: there is no training step to capture")
    start = time.perf_counter()
    example_inputs = spec.tensors(as_batch(batch))

    def joint(inputs: tuple[Any, ...]) -> tuple[torch.fx.GraphModule, Any]:
        try:
            try:
                return aot_export_module(step, inputs, trace_joint=True, output_loss_index=0)
            except AssertionError as err:
                if "did not receive a gradient" not in str(err):
                    raise
                with _frozen(_parameters_without_gradient(step, inputs)):
                    return aot_export_module(step, inputs, trace_joint=True, output_loss_index=0)
        except CaptureError:
            raise
        except Exception as err:  # AOTAutograd refuses a joint graph that changes a parameter, naming none
            changed = _changed_by_the_forward(step, inputs)
            if changed:
                raise ParameterChanged(changed) from err
            raise

    try:
        gm, sig = _traced(model, example_inputs, joint)
    except CaptureError:
        raise
    except Exception as err:
        raise CaptureError(explain_capture_failure(err)) from err
    refuse_changed_batch(sig, spec)
    refuse_foreign_generators(gm, model)
    refuse_sparse_gradients(gm, sig)
    fuse_silu_backward(gm)
    gradients_laid_out_as_parameters(gm, sig)
    propagate_fake_values(gm)
    graph = graph_from_fx(gm, sig)
    return Captured(graph, time.perf_counter() - start, step_output=step.step_output)


def capture_forward(model: torch.nn.Module, batch: Any) -> Captured:
    """Trace ``model(*batch)`` (``model(**batch)`` for a mapping) alone, without gradients, into
    one :class:`Graph`: the step of an inference plan (MAGIS plans it as Serenity does, with no
    backward). The graph's outputs are the output's tensors (``signature.results``, in
    :func:`torch.utils._pytree.tree_flatten` order; ``output_spec`` rebuilds the output) and the
    buffers the forward mutates (a batch norm in train mode). Submodules keep their modes."""
    model = user_model(model)
    spec = BatchSpec.of(batch)
    step = _ForwardStep(model, batch=spec)
    start = time.perf_counter()
    example_inputs = spec.tensors(as_batch(batch))

    def forward(inputs: tuple[Any, ...]) -> tuple[torch.fx.GraphModule, Any]:
        with torch.no_grad():
            return aot_export_module(step, inputs, trace_joint=False)

    try:
        gm, sig = _traced(model, example_inputs, forward)
    except CaptureError:
        raise
    except Exception as err:
        raise CaptureError(explain_capture_failure(err)) from err
    refuse_changed_parameters(sig)
    refuse_changed_batch(sig, spec)
    refuse_foreign_generators(gm, model)
    propagate_fake_values(gm)
    graph = graph_from_fx(gm, sig)
    return Captured(graph, time.perf_counter() - start, step.output_spec, output_nones=step.output_nones)


class ParameterChanged(CaptureError):
    """The forward changes parameters in place; the message names them and the likely causes."""

    def __init__(self, names: Sequence[str]) -> None:
        quoted = ", ".join(repr(name) for name in names)
        super().__init__(
            f"the forward changes the parameter{'s' if len(names) > 1 else ''} {quoted} in place, as "
            "nn.Embedding(max_norm=...) does when it renormalises the rows it looks up, or a weight clipped "
            "inside forward (with torch.no_grad(): self.weight.clamp_(...), as in a WGAN critic): a plan "
            "changes parameters only through the gradients and the optimizer, and would leave that change "
            "out. Renormalise or clip the weights outside the forward (e.g. after optimizer.step()), or use "
            "nn.Embedding without max_norm"
        )


def refuse_changed_parameters(sig: Any) -> None:
    """A :class:`ParameterChanged` where the exported step changes a parameter in place.

    AOTAutograd functionalizes the change into an output (``sig.parameters_to_mutate``) that
    no plan writes back: its outputs would be eager's and the model's weights not (eager
    writes the change into the parameter at every call). Buffers are written back (a batch
    norm's running statistics); a plan changes parameters through gradients and the
    optimizer only. The trace ran on fake tensors: the model is left as it was.
    """
    changed = _changed_parameters(sig)
    if changed:
        raise ParameterChanged(changed)


def refuse_changed_batch(sig: Any, spec: BatchSpec) -> None:
    """A :class:`CaptureError` naming the first batch tensor the exported step changes in place
    (``x.mul_(2)`` on the batch, a collate's mask filled in place).

    AOTAutograd functionalizes the change into an output (``sig.user_inputs_to_mutate``) that
    no plan writes back: a plan reads its own contiguous copy of the batch, so the user's tensor
    would stay as it was where eager changes it (a loop that reads the batch again, or calls the
    step twice on it, would see another value). The trace ran on fake tensors: the batch is left
    as it was.
    """
    names = [leaf.name for leaf in spec.leaves if leaf.shape is not None]
    position = {node: i for i, node in enumerate(sig.user_inputs)}
    changed = sorted(position[node] for node in sig.user_inputs_to_mutate.values())
    if changed:
        raise CaptureError(
            f"the step changes {names[changed[0]]} of the batch in place (an in-place op such as x.mul_(2), "
            "x += 1 or x[mask] = 0 on it): a plan does not write changes back into the batch, so the tensor "
            "would stay as it was where eager PyTorch changes it. Compute on a new tensor instead "
            "(x = x * 2, x = x.masked_fill(mask, 0))"
        )


def model_generators(model: torch.nn.Module) -> list[torch.Generator]:
    """The ``torch.Generator`` objects the model's modules hold as attributes, each once: a
    layer's own random stream (``torch.randn(..., generator=self.generator)``), which the graph
    draws from as eager does, and which tracing, the check and the search draw from too."""
    return list(dict(named_generators(model)).values())


@contextlib.contextmanager
def forked_generators(generators: Sequence[torch.Generator], cuda_devices: Sequence[int] = ()) -> Iterator[None]:
    """torch's CPU generator, those of ``cuda_devices`` and each of ``generators`` restored afterwards."""
    states = [generator.get_state() for generator in generators]
    try:
        with torch.random.fork_rng(devices=cuda_devices):
            yield
    finally:
        for generator, state in zip(generators, states):
            generator.set_state(state)


def named_generators(model: torch.nn.Module) -> list[tuple[str, torch.Generator]]:
    """:func:`model_generators` each under its first name (``"encoder.noise.generator"``), as a
    plan file names the generator its graph draws from."""
    found: dict[int, tuple[str, torch.Generator]] = {}
    for prefix, module in model.named_modules():
        for attribute, value in vars(module).items():
            if isinstance(value, torch.Generator):
                found.setdefault(id(value), (f"{prefix}.{attribute}" if prefix else attribute, value))
    return list(found.values())


def same_generator_named(generator: torch.Generator, model: torch.nn.Module) -> str | None:
    """The name of the stream ``generator`` is in ``model`` (:func:`named_generators`), ``""`` for
    torch's default generator of its device, None for another."""
    named = [*named_generators(model), *(("", g) for g in _default_generators())]
    return next((name for name, held in named if _same_stream(generator, held)), None)


def _default_generators() -> list[torch.Generator]:
    return [torch.default_generator, *(torch.cuda.default_generators if torch.cuda.is_available() else ())]


def refuse_foreign_generators(gm: torch.fx.GraphModule, model: torch.nn.Module) -> None:
    """A :class:`CaptureError` where the step draws from a ``torch.Generator`` that neither torch's
    default nor the model holds (a module-level ``GEN = torch.Generator()``): a plan draws from it
    as eager does, but tracing and the check draw from it too, and only the default generators
    and the model's own (:func:`model_generators`) are put back as they were."""
    for node in gm.graph.nodes:
        generator = node.kwargs.get("generator")
        if isinstance(generator, torch.fx.Node) and generator.op == "get_attr":
            value = getattr(gm, str(generator.target), None)
            if isinstance(value, torch.Generator) and same_generator_named(value, model) is None:
                raise CaptureError(
                    f"the step draws random numbers ({node.target}) from a torch.Generator the model does not "
                    "hold: planning would draw from it too, and leave its stream ahead of eager's. Keep the "
                    "generator as an attribute of the module that draws (self.generator = torch.Generator()), "
                    "or draw from torch's default generator"
                )


def _same_stream(a: torch.Generator, b: torch.Generator) -> bool:
    """Whether two generator objects are one stream: the trace hands a generator back in another
    Python object over the same stream (``is`` cannot tell). Told by reseeding ``b`` for a moment
    and reading ``a``'s seed; ``b`` is put back as it was."""
    if a is b:
        return True
    if a.device != b.device:
        return False
    seed, state = b.initial_seed(), b.get_state()
    probe = (a.initial_seed() + 1) % 2**63
    b.manual_seed(probe)
    try:
        return a.initial_seed() == probe
    finally:
        b.manual_seed(seed)
        b.set_state(state)


def _changed_by_the_forward(step: _TrainingStep, inputs: tuple) -> list[str]:
    """The parameters the step changes in place, as AOTAutograd reports them tracing it without
    gradients: it refuses to export a joint graph that changes a parameter (a trainable one:
    "received a mutation"; a frozen one: an assertion), naming neither the parameter nor the
    change. Empty where that trace fails too (the joint trace's own error then stands). Its
    warnings are not the user's (a checkpoint finding no input that requires grad)."""
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _, sig = aot_export_module(step, inputs, trace_joint=False)
    except Exception:
        return []
    return _changed_parameters(sig)


def _changed_parameters(sig: Any) -> list[str]:
    """The user's names of the parameters the exported step changes in place."""
    return sorted({_user_name(name) for name in sig.parameters_to_mutate.values()})


def _user_name(name: str) -> str:
    """A parameter's name in the user's model (the step module holds it as ``model``)."""
    return name.removeprefix("model.")


class _SettingsInitialized(CaptureError):
    """A trace gave settings that were ``None`` a value (:func:`_traced` traces again)."""


def _traced(model: torch.nn.Module, example_inputs: Sequence[Any], trace: Callable[[tuple[Any, ...]], T]) -> T:
    """``trace(inputs)`` under :func:`_tracing`, once more where the first trace only initialised
    settings (:func:`~magis.frontend.conditions.initialized_while_traced`): the graph is then
    that of a call finding them set, as every later call does."""
    try:
        with _tracing(model, example_inputs) as inputs:
            return trace(inputs)
    except _SettingsInitialized:
        with _tracing(model, example_inputs) as inputs:
            return trace(inputs)


@contextlib.contextmanager
def _tracing(model: torch.nn.Module, example_inputs: Sequence[Any]) -> Iterator[tuple[Any, ...]]:
    """What every trace of the user's model runs under; yields the inputs to trace with
    (:func:`planning_mode`). A trace that changed the model's Python state
    (:func:`~magis.frontend.conditions.changed_while_traced`) or drew from Python's or NumPy's
    generator is a ``CaptureError``."""
    before = module_records(model)
    tensors_before = _tensor_attributes(model)
    with (
        autocast_off(),  # the step module enters the caller's autocast itself (StepModule)
        _no_python_random_draws(),
        _without_stack_traces(),
        traced_as_by_compile(),
        _compiled_code_as_written(),
        ExactRNNs(model),  # nn.LSTM/GRU/RNN as eager runs them, inter-layer dropout included
        FusedAttentionMasks() if _on_cuda(model) else contextlib.nullcontext(),
        planning_mode(model, example_inputs) as inputs,
    ):
        yield inputs
    after = module_records(model)
    changed = changed_while_traced(before, after)
    if changed is not None:
        if initialized_while_traced(before, after):
            raise _SettingsInitialized(changed)  # kept: every later call finds them set
        restore_settings(model, before)  # the model as the user gave it
        raise CaptureError(changed)
    _refuse_tensor_attributes_set(model, tensors_before)


def _tensor_attributes(model: torch.nn.Module) -> dict[tuple[str, str], torch.Tensor]:
    """The tensors the model's modules hold as plain attributes (not parameters or buffers), by
    (module name, attribute)."""
    return {
        (name, key): value
        for name, module in model.named_modules()
        for key, value in vars(module).items()
        if isinstance(value, torch.Tensor)
    }


def _refuse_tensor_attributes_set(model: torch.nn.Module, before: dict[tuple[str, str], torch.Tensor]) -> None:
    """A ``CaptureError`` where the trace set a module's plain tensor attribute to another tensor
    (``self.attention_map = weights.detach()``, kept to look at after the step): a plan sets no
    attribute, so eager's would hold each call's tensor and the plan's the one it had. The
    attribute is put back as it was (the trace left a traced tensor in it)."""
    after = _tensor_attributes(model)
    changed = [key for key, value in after.items() if before.get(key) is not value]
    if not changed:
        return
    modules = dict(model.named_modules())
    for name, key in changed:
        if (name, key) in before:
            setattr(modules[name], key, before[name, key])
        else:
            delattr(modules[name], key)
    name, key = changed[0]
    raise CaptureError(
        f"the step sets {f'submodule {name!r}' if name else 'the model'}'s attribute {key!r} to a tensor it "
        "computes while it is traced: a plan sets no attribute, so after each call it would hold what it held "
        "before, where eager's holds that call's tensor. Keep it in a buffer updated in place "
        f"(register_buffer({key!r}, ...), then self.{key}.copy_(...)), which a plan updates as eager does, or "
        "return it from training_step"
    )


@contextlib.contextmanager
def _no_python_random_draws() -> Iterator[None]:
    """A ``CaptureError`` where the traced step drew from Python's or NumPy's global generator.

    A trace runs the step's Python once: a coin flip of ``random.random()`` or
    ``np.random.uniform()`` (an augmentation inside the training step, a layer dropped at
    random) becomes a constant of the graph, and the plan would replay that one draw at
    every call. torch's own draws are traced as random operators, drawn anew each call."""
    before = _python_random_states()
    yield
    after = _python_random_states()
    drawn = next((name for name, state in before.items() if not _same_state(state, after[name])), None)
    if drawn is not None:
        raise CaptureError(
            f"the step draws from {drawn} while it is traced (a coin flip in an augmentation, a layer "
            "skipped at random): the graph would hold that one draw and replay it at every call. Draw "
            "with torch instead (torch.where(torch.rand(()) < p, flipped, x)), which a plan draws anew at "
            "each call as eager does"
        )


def _python_random_states() -> dict[str, Any]:
    """The states of Python's global generator and, where NumPy is imported, NumPy's."""
    states: dict[str, Any] = {"Python's random module": random.getstate()}
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        states["NumPy's global generator (np.random)"] = numpy.random.get_state()
    return states


def _same_state(a: Any, b: Any) -> bool:
    """Two generator states alike (NumPy's holds an array, which ``==`` compares element by element)."""
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b))
    equal = a == b
    return bool(equal.all()) if hasattr(equal, "all") else bool(equal)


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


def _compiled_code_as_written() -> contextlib.AbstractContextManager[None]:
    """Code the user compiled (``torch.compile`` of a submodule, or of the training step) runs
    its Python while the step is traced: the trace records its ops, as it records the whole
    step's, where TorchDynamo inside the trace failed (``BackendCompilerFailed``). A plan
    compiles its own segments (``optimize(compile=True)``). ``torch.compiler.set_stance``
    came with torch 2.6; before it, compiled code inside the step is not captured."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    return contextlib.nullcontext() if set_stance is None else set_stance("force_eager")


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
    """A :class:`CaptureError` message naming the cause of a tracing failure and, where the
    traceback shows it, the line of the model's code (or of ``torch.nn``'s) that made the call."""
    text = f"{type(err).__name__}: {err}".strip()
    first = text.splitlines()[0] if text else type(err).__name__
    kind = type(err).__name__
    origin = failing_line(err)
    at = f" at {origin}" if origin else ""
    if "DataDependent" in kind or "data-dependent" in text or "GuardOnDataDependent" in text:
        return (
            "the model has data-dependent Python control flow (a branch or loop on a tensor's value, "
            f".item() or .tolist()){at}, which a graph cannot capture: {first}"
        )
    if "DynamicOutputShape" in kind or "dynamic output shape" in text.lower():
        return f"an op has a data-dependent output shape (e.g. nonzero, masked_select, unique){at}: {first}"
    if _raised_in(err, CheckpointFunction.backward):
        return (
            "the model runs torch.utils.checkpoint(..., use_reentrant=True): reentrant activation "
            "checkpointing cannot be captured, as its backward runs the recomputed forward's backward in an "
            "autograd call of its own, which the trace of the step's backward (torch.autograd.grad) cannot "
            "follow. Pass use_reentrant=False, which is captured (magis plans what to recompute itself)"
        )
    if "convert all Tensors to FakeTensors" in text:
        return (
            "the step uses a tensor that is neither a parameter, a buffer nor in the batch: a module's "
            "plain tensor attribute (register it with register_buffer), a loss closing over the labels "
            "(pass them in the batch and take them in training_step(model, *batch)), or a module outside "
            "the model that the step calls (a teacher: make it a submodule of the model, frozen with "
            f"requires_grad_(False), or pass its outputs in the batch){at}; {first}"
        )
    return f"could not capture the step{at}: {first}"


_TORCH = os.path.dirname(torch.__file__)
_MAGIS = os.path.dirname(os.path.dirname(__file__))
_PATHS = sysconfig.get_paths()


def failing_line(err: BaseException) -> str | None:
    """``file:line (code)`` of the innermost frame with source, over ``err`` and the exceptions
    it was raised from, in the model's code or ``torch.nn``'s: where the step did what tracing
    could not follow (e.g. ``float(self.num_batches_tracked)`` in a batch norm whose momentum
    is ``None``). ``None`` where no such frame is."""
    found = None
    for chained in _chain(err):
        frames = [f for f in traceback.extract_tb(chained.__traceback__) if f.line and _model_facing(f.filename)]
        found = frames[-1] if frames else found
    return None if found is None else f"{found.filename}:{found.lineno} (`{found.line.strip()}`)"


def _chain(err: BaseException) -> Iterator[BaseException]:
    """``err`` and the exceptions it was raised from (or while handling), innermost last."""
    seen: set[int] = set()
    chained: BaseException | None = err
    while chained is not None and id(chained) not in seen:
        seen.add(id(chained))
        yield chained
        chained = chained.__cause__ or chained.__context__


def _raised_in(err: BaseException, function: Callable) -> bool:
    """Whether ``err``, or an exception it was raised from, was raised while ``function`` ran:
    its code object is on the traceback, whatever the message says."""
    code = function.__code__
    for chained in _chain(err):
        tb = chained.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code is code:
                return True
            tb = tb.tb_next
    return False


def _model_facing(filename: str) -> bool:
    """Whether a frame of ``filename`` is the model's (its own code, a library it is built with,
    ``torch.nn``) rather than the tracing machinery's (torch, magis, Python's own library)."""
    if filename.startswith("<eval_with_key>"):  # code torch.fx generated while tracing
        return False
    path = os.path.abspath(filename)
    if _under(path, os.path.join(_TORCH, "nn")):
        return path != os.path.join(_TORCH, "nn", "modules", "module.py")  # but the call machinery
    if _under(path, _TORCH) or _under(path, _MAGIS):
        return False
    return _under(path, _PATHS["purelib"]) or _under(path, _PATHS["platlib"]) or not _under(path, _PATHS["stdlib"])


def _under(path: str, folder: str) -> bool:
    return path.startswith(os.path.join(folder, ""))


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


def refuse_sparse_gradients(gm: torch.fx.GraphModule, sig: Any) -> None:
    """A ``CaptureError`` where a parameter's gradient is sparse (an embedding with ``sparse=True``).

    A plan's graph holds dense tensors: it sizes, orders, splits and frees each by its shape
    and strides, which a sparse gradient's (indices and values as many as the rows looked up)
    are not; the trace leaves such a gradient without a fake value.
    """
    nodes = {n.name: n for n in gm.graph.nodes}
    for name, param_name in sig.backward_signature.gradients_to_parameters.items():
        value = nodes[name].meta.get("val")
        if not isinstance(value, torch.Tensor) or value.layout != torch.strided:
            raise CaptureError(
                f"the gradient of the parameter {_user_name(param_name)!r} is sparse (nn.Embedding or "
                "nn.EmbeddingBag with sparse=True, or F.embedding(..., sparse=True)): a plan holds dense "
                "gradients only. Use sparse=False (the optimizer then steps a dense .grad; torch.optim.SparseAdam "
                "takes sparse gradients only, use Adam or AdamW)"
            )


def gradients_laid_out_as_parameters(gm: torch.fx.GraphModule, sig: Any) -> int:
    """Copy each gradient that is a view, or laid out unlike its parameter, into the parameter's layout.

    A plan leaves each gradient in ``.grad``, which must be laid out like its parameter, as
    eager's ``AccumulateGrad`` copies a gradient that is not (e.g. the transposed product an
    unrolled recurrent layer's weight gets). Done in the graph, the copy is a node the
    simulator counts and the scheduler places as soon as the gradient is final, freeing the
    product it came from; done after the step, it would cost memory no simulation saw.
    ``sig``'s gradient names are updated to the copies. Returns how many gradients were copied.
    """
    nodes = {n.name: n for n in gm.graph.nodes}
    params = {p: nodes[name] for name, p in sig.inputs_to_parameters.items()}
    renamed: dict[str, str] = {}
    for name, param_name in sig.backward_signature.gradients_to_parameters.items():
        grad, param = nodes[name], params[param_name].meta["val"]
        schema = getattr(grad.target, "_schema", None)
        is_view = schema is not None and any(r.alias_info for r in schema.returns)
        if not (is_view or grad.meta["val"].stride() != param.stride()) or not param.is_contiguous():
            continue
        with gm.graph.inserting_after(grad):
            laid_out = gm.graph.call_function(
                torch.ops.aten.clone.default, (grad,), {"memory_format": torch.contiguous_format}
            )
        grad.replace_all_uses_with(laid_out, delete_user_cb=lambda user: user.op == "output")
        renamed[name] = laid_out.name
    if renamed:
        gradients = sig.backward_signature.gradients_to_parameters
        relabelled = {renamed.get(name, name): p for name, p in gradients.items()}
        gradients.clear()
        gradients.update(relabelled)
        gm.recompile()
    return len(renamed)


def propagate_fake_values(gm: torch.fx.GraphModule) -> None:
    """Re-run the exported graph on fresh fake tensors so ``meta['val']`` shares storage
    wherever the real run would (the exported metadata loses view relationships). The graph
    holds autocast's casts: it runs with autocast off, as a plan runs it."""
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    with mode:
        inputs = [
            torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
            for v in (n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder")
        ]
    with autocast_off():
        FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*inputs)
