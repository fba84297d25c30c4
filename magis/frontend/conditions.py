"""What a captured step was made under beyond its batch: the model's modules as they were, autocast
and torch's default dtype.

A trace records what the model's Python did on that call, not the code: every submodule's
train/eval mode (dropout and batch norm are traced as in training or evaluation), its
class and its settings (a Dropout's ``p``, a layer's ``scale``, a transformers layer's
``config.scale_decoder_outputs``), the hooks that ran around it, which parameters had
gradients, autocast's casts (traced into the graph as ``_to_copy`` ops) and the dtype of
every tensor made without one (``torch.zeros(shape)``: the default dtype). A plan runs
the graph it was made for, so a call after any of them changed (a layer frozen or
replaced, a dropout rate annealed, a hook added) would silently train another step;
:meth:`Conditions.check` refuses it, naming what differs
(docs/design.md, "The user's side of the contract"). A module's *settings* are its public
attributes that a trace may have read as constants (:func:`_recorded`: numbers, strings,
booleans, ``None``, containers of them, numpy scalars, enums, functions by their code and
closure, classes), and those of the objects holding settings that it refers to (a config:
any object with attributes that is neither a module, a tensor nor a function; a class of
the user's), as ``config.name``, each object recorded once, where it is first met (later,
``config`` is ``"(as <path>)"``), and its class's code where the class is the user's;
tensors are bound by name at every call, so new weights need no new plan. A plan checks
them at every call through a :class:`ConditionsWatch`.

A hook on a parameter's gradient (``Tensor.register_hook``, or
``register_post_accumulate_grad_hook``, the way to step an optimizer inside the backward)
is not traced: :func:`refuse_gradient_hooks` refuses a model that has one before
anything runs (an eager check would fire it).

The graph carries autocast's casts itself; it runs with autocast off
(:func:`autocast_off`), or an op the user computed outside autocast inside an autocast
region (a rotary embedding's ``enabled=False`` block) would be cast once more.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import hashlib
import itertools
import operator
import types
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.nn.modules import module as nn_module

#: the device types whose autocast state a step records
AUTOCAST_DEVICES = ("cpu", "cuda")
#: the kinds of hook a module runs around its forward and backward, by the attribute holding them
MODULE_HOOKS = {
    "_forward_pre_hooks": "forward pre-hooks",
    "_forward_hooks": "forward hooks",
    "_backward_pre_hooks": "backward pre-hooks",
    "_backward_hooks": "backward hooks",
}
#: torch.nn's hooks on every module (``register_module_forward_hook``...), by the attribute holding them
GLOBAL_HOOKS = {f"_global{attr}": f"global module {what}" for attr, what in MODULE_HOOKS.items()}
_PLAIN = (bool, int, float, str, type(None))
#: a container with more items is not a setting (data, a vocabulary), not described at every call
CONTAINER_ITEMS = 256
#: the modules of the libraries whose classes are not a user's configs
_LIBRARIES = ("torch", "transformers", "diffusers", "numpy", "typing", "enum", "collections", "abc")
#: callables whose attributes are not settings (they are recorded whole, :func:`_recorded`)
_NOT_CONFIGS = (types.FunctionType, types.MethodType, functools.partial, types.BuiltinFunctionType)
#: what :func:`_recorded` returns for a value that is not a setting
_UNRECORDED = object()
#: how deep a config's configs are read (a transformers config's ``text_config``)
SETTINGS_DEPTH = 2
#: the attributes every module holds for torch (its parameters, buffers, submodules and hooks:
#: recorded by kind, not as settings); a user's class's other private attributes are settings
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))

#: one module as a step was captured with it: (qualified name, class, training, hooks, settings,
#: a digest of its class's code where the class is not a library's)
ModuleRecord = tuple[str, str, bool, tuple[tuple[Any, ...], ...], tuple[tuple[str, Any], ...], str]


def autocast_state() -> tuple[tuple[str, torch.dtype | None], ...]:
    """Per device type, the dtype autocast casts to here, ``None`` where it is off."""
    return tuple(
        (device, torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None)
        for device in AUTOCAST_DEVICES
    )


def _hook_records(hooks: dict) -> tuple[Any, ...]:
    """The hooks as recorded: each function's name, code and state (:func:`_recorded`), a hook
    object's class and settings; the same in another process, unlike their handles."""
    if not hooks:  # nearly every module's
        return ()
    return tuple(_hook_record(hook) for hook in hooks.values())


def _hook_record(hook: Any) -> Any:
    """One hook recorded: a function by :func:`_recorded`, a hook object by its class and settings."""
    recorded = _recorded(hook)
    if recorded is not _UNRECORDED:
        return recorded
    settings = tuple(_settings(vars(hook), "", {}, 1)) if hasattr(hook, "__dict__") else ()
    return Described(f"{type(hook).__qualname__}{dict(settings) if settings else ''}")


@dataclass(frozen=True)
class Described:
    """A setting that is not a plain value, as :func:`_recorded` describes it: compared by its
    text, the same in another process, and shown as it is in a message."""

    text: str

    def __repr__(self) -> str:
        return self.text


def _recorded(value: Any) -> Any:
    """``value`` as a setting is recorded, or ``_UNRECORDED``: a plain value or a tuple of them as
    it is; a numpy scalar as its Python number; a list, tuple, set or dict of recorded values
    (at most :data:`CONTAINER_ITEMS`), an enum member, a function (its name, code, defaults and
    closure: a lambda scaling by another factor is another function), a partial, a bound method,
    a builtin or a class of torch's as a :class:`Described`. Tensors, modules and other objects
    are not settings (a config's attributes are, :func:`_settings`)."""
    kind = type(value)
    if kind in _PLAIN or (kind is tuple and all(type(item) in _PLAIN for item in value)):
        return value
    if kind.__module__ == "numpy" and getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        return value.item()
    if kind in (list, tuple, set, frozenset, dict):
        return _container(value)
    if isinstance(value, enum.Enum):
        return Described(f"{kind.__qualname__}.{value.name}")
    if isinstance(value, types.FunctionType):
        return Described(f"function {value.__module__}.{value.__qualname__} {_function_digest(value)}")
    if isinstance(value, functools.partial):
        parts = [_recorded(value.func), *map(_recorded, value.args), *map(_recorded, value.keywords.values())]
        if any(part is _UNRECORDED for part in parts):
            return _UNRECORDED
        return Described(f"partial({', '.join(map(repr, parts))}, {sorted(value.keywords)})")
    if isinstance(value, types.MethodType):
        return Described(f"method {_recorded(value.__func__)!r} of a {type(value.__self__).__qualname__}")
    if isinstance(value, types.BuiltinFunctionType):
        return Described(f"{value.__module__}.{value.__name__}")
    if isinstance(value, type) and not _holds_settings(value):
        return Described(f"{value.__module__}.{value.__qualname__}")
    return _UNRECORDED


def _container(value: list | tuple | set | frozenset | dict) -> Any:
    """A container of recorded values described (:func:`_recorded`), a set's items sorted (their
    order changes between processes), or ``_UNRECORDED``."""
    if len(value) > CONTAINER_ITEMS:
        return _UNRECORDED
    pairs = value.items() if isinstance(value, dict) else ((None, item) for item in value)
    texts = []
    for key, item in pairs:
        parts = (_recorded(item),) if key is None else (_recorded(key), _recorded(item))
        if any(part is _UNRECORDED for part in parts):
            return _UNRECORDED
        texts.append(": ".join(map(repr, parts)))
    if isinstance(value, (set, frozenset)):
        texts.sort()
    return Described(f"{type(value).__name__}[{', '.join(texts)}]")


def _function_digest(function: types.FunctionType) -> str:
    """A digest of what a Python function computes: its code (the bytecode, names and constants
    of it and of the code it defines; not its line numbers), its defaults and its closure."""
    digest = hashlib.blake2b(digest_size=6)

    def code_bytes(code: types.CodeType) -> None:
        digest.update(code.co_code)
        digest.update(repr(code.co_names).encode())
        for constant in code.co_consts:
            if isinstance(constant, types.CodeType):
                code_bytes(constant)
            else:  # a literal; a set literal's frozenset in sorted order (:func:`_recorded`), as the hash seed does not
                recorded = _recorded(constant)
                digest.update(repr(constant if recorded is _UNRECORDED else recorded).encode())

    code_bytes(function.__code__)
    state = [*(function.__defaults__ or ()), *(function.__kwdefaults__ or {}).values()]
    for cell in function.__closure__ or ():
        try:
            state.append(cell.cell_contents)
        except ValueError:  # a cell not filled yet
            state.append(None)
    for value in state:  # a closure over another function: its name, not its code (no cycles)
        if isinstance(value, types.FunctionType):
            recorded = Described(f"function {value.__qualname__}")
        else:
            recorded = _recorded(value)
        digest.update(b"?" if recorded is _UNRECORDED else repr(recorded).encode())
    return digest.hexdigest()


def _holds_settings(value: Any) -> bool:
    """An object whose attributes may be settings: a config (module docstring), a hook object, or
    a class of the user's (its class attributes and methods)."""
    if isinstance(value, type):
        return not value.__module__.startswith(_LIBRARIES) and value.__module__ != "builtins"
    return (
        hasattr(value, "__dict__")
        and not isinstance(value, _NOT_CONFIGS)
        and not isinstance(value, (torch.nn.Module, torch.Tensor, types.ModuleType))
    )


def _settings(
    attributes: Mapping[str, Any],
    path: str,
    seen: dict[int, str],
    depth: int = 0,
    private: bool = False,
    names: frozenset[str] | None = None,
) -> Iterator[tuple[str, Any]]:
    """The public attributes of ``attributes`` recorded (:func:`_recorded`) and those of the
    configs they refer to (dotted names, at most :data:`SETTINGS_DEPTH` deep), each config once
    (``seen``: where each was first met, by identity); ``private`` names too; of a config, only
    the attributes in ``names`` where given."""
    for key, value in attributes.items():
        if (key[0] == "_" and not private) or key == "training" or key[:2] == "__" or key in _MODULE_INTERNALS:
            continue
        if depth > 0 and names is not None and key not in names:
            continue
        recorded = _recorded(value)
        if recorded is not _UNRECORDED:
            yield key, recorded
        elif depth < SETTINGS_DEPTH and _holds_settings(value):
            here = f"{path}.{key}" if path else key
            first = seen.setdefault(id(value), here)
            if first != here:
                yield key, f"(as {first})"
                continue
            for inner, setting in _settings(vars(value), here, seen, depth + 1, names=names):
                yield f"{key}.{inner}", setting


def step_values(functions: Sequence[Callable | None]) -> tuple[tuple[str, Any], ...]:
    """The values (:func:`_settings`: plain values, containers, functions, configs' and classes'
    attributes) that ``functions`` (the user's ``training_step`` or ``loss_fn``, and the functions
    and lambdas they define) read from their module's globals or their closures, as
    ``("<function>: <name>", value)``: a trace holds them as constants (a label smoothing kept in
    a global, a dict or an argparse namespace), as torch.compile's guards know. Of a namespace,
    a config or a class, only the attributes the code names (``args.lr``: not ``args.epoch``,
    which a loop may count); what the functions they call read is not read."""
    values: list[tuple[str, Any]] = []
    for function in functions:
        while isinstance(function, functools.partial):
            function = function.func
        code = getattr(function, "__code__", None)
        if code is None:
            continue  # not a Python function (a callable object, a builtin)
        name = getattr(function, "__qualname__", code.co_name)
        namespace = getattr(function, "__globals__", {})
        names = frozenset(_names_read(code))
        read = {n: namespace[n] for n in sorted(names) if n in namespace}
        for variable, cell in zip(code.co_freevars, getattr(function, "__closure__", None) or ()):
            try:
                read[variable] = cell.cell_contents
            except ValueError:  # a cell not filled yet
                continue
        read = {n: value for n, value in read.items() if value is not function}
        values += [(f"{name}: {n}", value) for n, value in _settings(read, "", {}, private=True, names=names)]
    return tuple(values)


def _names_read(code: types.CodeType) -> Iterator[str]:
    """The global and attribute names ``code`` and the code objects it defines refer to, and
    their string constants (``getattr(args, "lr")``)."""
    yield from code.co_names
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            yield from _names_read(constant)
        elif isinstance(constant, str):
            yield constant


def module_records(model: torch.nn.Module) -> tuple[ModuleRecord, ...]:
    """Every submodule of ``model`` as a step sees it, in ``named_modules()`` order (module docstring)."""
    records = []
    seen: dict[int, str] = {}
    codes: dict[type, str] = {}
    for name, module in model.named_modules():
        attributes = vars(module)
        hooks = tuple(_hook_records(attributes[attr]) for attr in MODULE_HOOKS)
        kind = type(module)
        # a user's forward reads its private attributes as it reads its public ones (a
        # ``self._temperature``); torch's own keep there what their public ones derive
        settings = tuple(_settings(attributes, name, seen, private=_holds_settings(kind)))
        code = codes[kind] if kind in codes else codes.setdefault(kind, _class_code(kind))
        records.append((name, kind.__qualname__, module.training, hooks, settings, code))
    return tuple(records)


def _class_code(kind: type) -> str:
    """A digest of the methods of ``kind`` and of its bases that are not a library's
    (:func:`_function_digest`); empty for a library's class (torch's code is checked by version).
    A plan read from a file (:func:`magis.load_plan`) runs the graph its code was traced into:
    edited code is another step."""
    digests = [
        f"{key}:{_function_digest(value)}"
        for cls in kind.__mro__
        if not cls.__module__.startswith(_LIBRARIES) and cls.__module__ != "builtins"
        for key, value in vars(cls).items()
        if isinstance(value, types.FunctionType)
    ]
    return hashlib.blake2b(" ".join(digests).encode(), digest_size=6).hexdigest() if digests else ""


@dataclass(frozen=True)
class Conditions:
    """The modules, the parameters' trainability and autocast a step was captured under."""

    modules: tuple[ModuleRecord, ...]
    #: (name, requires_grad, hooked on its gradient) of every parameter; () for an inference
    trainable: tuple[tuple[str, bool, bool], ...]
    global_hooks: tuple[tuple[str, ...], ...]
    autocast: tuple[tuple[str, torch.dtype | None], ...]
    #: the values the user's step functions read from their globals and closures (:func:`step_values`)
    step: tuple[tuple[str, Any], ...] = ()
    #: ``torch.get_default_dtype()``: a tensor the step makes without a dtype (``torch.zeros(shape)``)
    #: is traced in it
    default_dtype: torch.dtype = torch.float32

    @staticmethod
    def of(model: torch.nn.Module, gradients: bool = True, step: Sequence[Callable | None] = ()) -> Conditions:
        """The conditions here and now, for ``model`` (``gradients=False``: an inference, which
        does not depend on which parameters are trainable) and the user's step functions ``step``."""
        trainable = tuple((n, p.requires_grad, _hooked(p)) for n, p in model.named_parameters()) if gradients else ()
        global_hooks = tuple(_hook_records(getattr(nn_module, attr, {})) for attr in GLOBAL_HOOKS)
        return Conditions(
            module_records(model),
            trainable,
            global_hooks,
            autocast_state(),
            step_values(step),
            torch.get_default_dtype(),
        )

    def check(
        self, model: torch.nn.Module, step: Sequence[Callable | None] = (), watch: ConditionsWatch | None = None
    ) -> None:
        """A ``ValueError`` naming the first thing that differs from what the step was captured
        under: a submodule's mode, class, settings or hooks, a parameter's trainability,
        torch.nn's global hooks, the autocast state, the default dtype, or a value the step functions ``step``
        read (not checked without them: a plan read from a file does not know them). A caller
        that checks at every call passes its ``watch`` (:class:`ConditionsWatch`)."""
        gradients = bool(self.trainable)
        now = Conditions.of(model, gradients, step) if watch is None else watch.of(model, gradients, step, like=self)
        if now is self:
            return
        if not any(step):
            now = replace(now, step=self.step)
        if now != self:
            refuse_gradient_hooks(model)
            raise ValueError(self._difference(now))

    def _difference(self, now: Conditions) -> str:
        for then, ours in zip(self.modules, now.modules):
            difference = _module_difference(then, ours)
            if difference:
                return difference
        if len(self.modules) != len(now.modules):
            return "the model has other submodules than the plan was made for (optimize again)"
        if self.trainable != now.trainable:
            return _trainable_difference(self.trainable, now.trainable)
        for what, then, ours in zip(GLOBAL_HOOKS.values(), self.global_hooks, now.global_hooks):
            if then != ours:
                return f"torch.nn's {what} are {list(ours)}; the plan was made with {list(then)} (optimize again)"
        if self.step != now.step:
            return _step_difference(self.step, now.step)
        if self.default_dtype != now.default_dtype:
            return (
                f"torch's default dtype is {now.default_dtype}; the plan was made under {self.default_dtype}, "
                "which the tensors the step makes without a dtype were traced in: call it under that default "
                "(torch.set_default_dtype), or optimize again"
            )
        for (device, dtype), (_, recorded) in zip(now.autocast, self.autocast):
            if dtype != recorded:
                return (
                    f"the plan was made with {_autocast(device, recorded)} and is called with "
                    f"{_autocast(device, dtype)}: call it under the autocast it was optimized under, "
                    "or optimize again"
                )
        raise AssertionError("conditions differ in nothing they record")


def _trainable_difference(then: tuple[tuple[str, bool, bool], ...], now: tuple[tuple[str, bool, bool], ...]) -> str:
    """What differs between the parameters' trainability then and now (:attr:`Conditions.trainable`)."""
    for (name, recorded, _), (our_name, ours, _) in zip(then, now):
        if name != our_name:
            break
        if recorded != ours:
            return (
                f"parameter {name!r} is {_trainable(ours)}; the plan was made with it {_trainable(recorded)} "
                "(set requires_grad back, or optimize again: magis.planned does so by itself)"
            )
    then_names, our_names = [t[0] for t in then], [t[0] for t in now]
    added = [name for name in our_names if name not in then_names]
    removed = [name for name in then_names if name not in our_names]
    return (
        f"the model has other parameters than the plan was made for (new: {added}, gone: {removed}; "
        "a weight tied or untied, or replaced by another module's): optimize again"
    )


def _step_difference(then: tuple[tuple[str, Any], ...], now: tuple[tuple[str, Any], ...]) -> str:
    """What differs between the values the step functions read then and now (:func:`step_values`)."""
    for (name, recorded), (_, ours) in zip(then, now):
        if ours != recorded:
            function, variable = name.split(": ", 1)
            return (
                f"{function}() reads {variable}={ours!r}; the plan was made with {variable}={recorded!r}: a trace "
                "keeps the Python values it read as constants (pass it as a tensor in the batch, or optimize again)"
            )
    return "the step's functions read other values than the plan was made with (optimize again)"


def _module_difference(then: ModuleRecord, now: ModuleRecord) -> str | None:
    """What differs between a submodule as the step was captured with it and as it is now, or None."""
    name, kind, training, hooks, settings, code = now
    if name != then[0]:
        return f"the model has other submodules than the plan was made for: {_module(name)} (optimize again)"
    if kind != then[1]:
        return f"{_module(name)} is a {kind}; the plan was made with a {then[1]} there (optimize again)"
    if code != then[5]:
        return (
            f"the code of {_module(name)}'s class {kind} is not the code the plan was made with (its methods "
            "changed since): a plan runs the graph the old code was traced into (optimize again)"
        )
    if training != then[2]:
        return (
            f"{_module(name)} is in {_mode(training)} mode; the plan was made with it in "
            f"{_mode(then[2])} mode (set it back, or optimize again for this mode)"
        )
    for what, ours, recorded in zip(MODULE_HOOKS.values(), hooks, then[3]):
        if ours != recorded:
            return (
                f"{_module(name)} has {what} {list(ours)}; the plan was made with {list(recorded)}: a plan "
                "runs the hooks it was captured with (remove them, or optimize again)"
            )
    if settings != then[4]:
        key, recorded, ours = _changed_setting(then[4], settings)
        return (
            f"{_module(name)} ({kind}) has {key}={ours!r}; the plan was made with {key}={recorded!r} "
            "(set it back, or optimize again)"
        )
    return None


def _changed_setting(then: tuple[tuple[str, Any], ...], now: tuple[tuple[str, Any], ...]) -> tuple[str, Any, Any]:
    """The first setting that differs between a module's ``then`` and ``now``: its name, value
    then and value now (``'(unset)'`` where it had none)."""
    recorded, ours = dict(then), dict(now)
    key = next(k for k in {**recorded, **ours} if ours.get(k, ...) != recorded.get(k, ...))
    return key, recorded.get(key, "(unset)"), ours.get(key, "(unset)")


def changed_while_traced(before: tuple[ModuleRecord, ...], after: tuple[ModuleRecord, ...]) -> str | None:
    """Why a trace cannot hold what the step did to the model's Python state: the first setting
    (:func:`module_records`) that ``after`` holds other than ``before``, or None. A forward that
    counts its calls or anneals a rate in an attribute ran once in the trace; the plan would see
    that call's values at every call."""
    for (name, kind, _, _, then, _), (_, _, _, _, now, _) in zip(before, after):
        if then == now:
            continue
        key, recorded, ours = _changed_setting(then, now)
        return (
            f"the step changed {_module(name)} ({kind})'s attribute {key!r} from {recorded!r} to {ours!r} "
            "while it was traced: a graph holds the Python state of that one "
            "call, so every call of a plan would see the same value. Keep such state in a tensor buffer "
            "(register_buffer), which a plan updates as eager does, or outside the model"
        )
    return None


def initialized_while_traced(before: tuple[ModuleRecord, ...], after: tuple[ModuleRecord, ...]) -> bool:
    """Whether every setting that ``after`` holds other than ``before`` was unset or ``None``
    there: a lazy initialisation (transformers sets ``config.problem_type`` at the first call
    with labels), which every later call finds done."""
    if len(before) != len(after):
        return False
    for (_, _, _, _, then, _), (_, _, _, _, now, _) in zip(before, after):
        if then == now:
            continue
        recorded, ours = dict(then), dict(now)
        changed = [key for key, value in ours.items() if recorded.get(key, ...) != value]
        if recorded.keys() - ours.keys() or any(recorded.get(key) is not None for key in changed):
            return False
    return True


def restore_settings(model: torch.nn.Module, records: tuple[ModuleRecord, ...]) -> None:
    """Put back every setting of ``records`` (:func:`module_records` of ``model``) that differs now
    (a config's where it was first met)."""
    for name, _, _, _, settings, _ in records:
        module = model.get_submodule(name)
        for key, value in settings:
            *path, leaf = key.split(".")
            holder = functools.reduce(getattr, path, module)
            restorable = not isinstance(value, Described) and not (isinstance(value, str) and value.startswith("(as "))
            if restorable and getattr(holder, leaf, ...) != value:
                setattr(holder, leaf, value)


class ConditionsWatch:
    """:meth:`Conditions.of` for a model called again and again, at the cost of a glance.

    :func:`module_records` costs a few microseconds per submodule (RandWire's 503: 3 ms a
    call, 15% of its forward at batch 1). The watch keeps, by identity, every object those
    records and the parameters' trainability read: the keys (by their count) and values of
    the mappings they read (:func:`_watched`: each submodule's attributes, children,
    parameters and hooks, its configs' and hook objects' attributes, torch.nn's global
    hooks) and each parameter's
    ``requires_grad`` and hooks; the settings that can change in place (a list, a function's
    closure) it describes again (:func:`_recorded`); the autocast state and the step
    functions' values it reads again. While none of them changed, the conditions are the
    ones last computed; any change (a setting set again to an equal value included) computes
    them afresh. It holds the objects it saw until a call finds them changed (a replaced
    parameter's old tensor, at most one call longer).
    """

    def __init__(self) -> None:
        self._seen: tuple[Conditions, torch.nn.Module, bool, _Watched, _Glance, tuple] | None = None

    def of(
        self,
        model: torch.nn.Module,
        gradients: bool = True,
        step: Sequence[Callable | None] = (),
        like: Conditions | None = None,
    ) -> Conditions:
        """:meth:`Conditions.of` ``(model, gradients, step)``, the last result while nothing it
        read changed; ``like`` itself where they equal it (its step values aside where ``step``
        names no function): a caller comparing with ``like`` then compares by identity."""
        values = step_values(step)
        if self._seen is not None:
            conditions, seen_model, seen_gradients, watched, glance, seen_values = self._seen
            if (
                seen_model is model
                and seen_gradients == gradients
                and watched.glance() == glance
                and autocast_state() == conditions.autocast
                and torch.get_default_dtype() == conditions.default_dtype
                and values == seen_values
            ):
                return conditions
        conditions = Conditions.of(model, gradients, step)
        if like is not None and (conditions if any(step) else replace(conditions, step=like.step)) == like:
            conditions = like
        watched = _watched(list(model.modules()))
        self._seen = (conditions, model, gradients, watched, watched.glance(), values)
        return conditions


@dataclass(frozen=True)
class _Glance:
    """What a :class:`_Watched` saw: ``identities``, compared by identity (so that an equal
    list set in place of the one watched is a change), ``sizes`` and ``described`` by value."""

    identities: list[Any]
    sizes: list[int]
    described: list[Any]

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, _Glance)
            and self.sizes == other.sizes
            and len(self.identities) == len(other.identities)
            and all(map(operator.is_, self.identities, other.identities))
            and self.described == other.described
        )


@dataclass(frozen=True)
class _Watched:
    """What :class:`ConditionsWatch` glances at: ``modules``' classes and attribute dicts, the
    size of each of ``mappings`` (a key added or gone), the value of each key each held (by
    ``getters``, one per mapping not empty then: a key gone raises ``KeyError``), the
    trainability and hooks of ``params``, and ``in_place``, the settings that may change
    without being replaced."""

    modules: list[torch.nn.Module]
    mappings: list[Mapping[str, Any]]
    getters: list[tuple[operator.itemgetter, Mapping[str, Any]]]
    params: list[torch.Tensor]
    in_place: list[Any]

    def glance(self) -> _Glance | None:
        """What the records read now, flat (:class:`_Glance`); None where a key is gone. Each
        mapping is read by one getter of its keys, not key by key: RandWire's 503 submodules
        hold 3,500 mappings of 11,000 keys, and a plan glances at every call."""
        getters, mappings = zip(*self.getters) if self.getters else ((), ())
        try:
            values = list(itertools.chain.from_iterable(map(_CALL, getters, mappings)))
        except KeyError:
            return None
        identities = [
            *map(type, self.modules),
            *map(vars, self.modules),
            *values,
            *map(_REQUIRES_GRAD, self.params),
            *map(_hooked, self.params),
        ]
        return _Glance(identities, list(map(len, self.mappings)), [_recorded(value) for value in self.in_place])


_CALL = operator.itemgetter.__call__
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
#: settings that may change in place, without their attribute being set: described at every glance
_IN_PLACE = (list, dict, set, types.FunctionType, functools.partial, types.MethodType)


def _watched(modules: list[torch.nn.Module]) -> _Watched:
    """What :func:`module_records` and :meth:`Conditions.of` read from ``modules`` (a superset,
    :class:`ConditionsWatch`): each module's attributes, children, parameters and hooks, its
    configs' and hook objects' attributes (as :func:`_settings` finds them), torch.nn's global hooks."""
    mappings: list[Mapping[str, Any]] = [getattr(nn_module, attr, {}) for attr in GLOBAL_HOOKS]
    in_place: list[Any] = []
    configs: set[int] = set()

    def settings(found: Mapping[str, Any], depth: int, private: bool = False) -> None:
        mappings.append(found)
        for key, value in found.items():
            if key[0] == "_" and not (private and key not in _MODULE_INTERNALS):
                continue
            if isinstance(value, _IN_PLACE):
                in_place.append(value)
            elif depth < SETTINGS_DEPTH and _holds_settings(value) and id(value) not in configs:
                configs.add(id(value))
                settings(vars(value), depth + 1)

    for hooks in mappings[:]:
        in_place += hooks.values()
    for module in modules:
        found = vars(module)
        settings(found, 0, private=_holds_settings(type(module)))
        for attr in ("_modules", "_parameters", *MODULE_HOOKS):
            mappings.append(found[attr])
        for attr in MODULE_HOOKS:
            for hook in found[attr].values():
                in_place.append(hook)
                if hasattr(hook, "__dict__") and not isinstance(hook, _NOT_CONFIGS):
                    settings(vars(hook), 1)
    # a getter of one key returns the value itself, of two or more a tuple: one key is asked twice
    getters = [(operator.itemgetter(*mapping, *list(mapping)[:1]), mapping) for mapping in mappings if mapping]
    params = [p for module in modules for p in module._parameters.values() if p is not None]
    return _Watched(modules, mappings, getters, params, in_place)


def _hooked(param: torch.Tensor) -> bool:
    return bool(param._backward_hooks) or bool(getattr(param, "_post_accumulate_grad_hooks", None))


def refuse_gradient_hooks(model: torch.nn.Module) -> None:
    """A ``ValueError`` naming the first parameter with a hook on its gradient (module docstring)."""
    for name, param in model.named_parameters():
        if param._backward_hooks:
            raise ValueError(
                f"parameter {name!r} has a hook on its gradient (Tensor.register_hook), which a plan does not "
                "run: remove it (a plan leaves the gradient in .grad, where you can change it after the call)"
            )
        if getattr(param, "_post_accumulate_grad_hooks", None):
            raise ValueError(
                f"parameter {name!r} has a post-accumulate-grad hook, which a plan does not run: to step "
                "the optimizer inside the backward, remove the hooks and give it to magis.optimize(..., "
                "optimizer=opt), whose plan applies each update as soon as its gradient is ready"
            )


def refuse_gradients_off() -> None:
    """A ``RuntimeError`` where gradients are off (``torch.no_grad()``, ``torch.inference_mode()``):
    a training step computes them (and a plan with the optimizer inside takes its update), where
    eager's ``loss.backward()`` would refuse to; a plan, which computes them itself, would train
    silently inside a user's evaluation loop."""
    if not torch.is_grad_enabled():
        raise RuntimeError(
            "gradients are off here (torch.no_grad() or torch.inference_mode()), where eager's loss.backward() "
            "refuses to run: a training step computes gradients (and, with the optimizer inside, updates the "
            "weights); call it with gradients on, or, to evaluate, call the model or plan its forward with "
            "inference=True"
        )


def warn_of_hooks(model: torch.nn.Module) -> None:
    """A hook is traced into the step: what it computes on tensors, a plan computes at every
    call; anything else it does (appending an activation to a list, logging, counting calls)
    happened once, in the trace. Warned of for every hook that is not torch's own."""
    for name, module in model.named_modules():
        for attr, what in MODULE_HOOKS.items():
            hooks = [hook for hook in vars(module)[attr].values() if not _is_torchs(hook)]
            if hooks:
                warnings.warn(
                    f"{_module(name)} has {what} {[_hook_record(hook) for hook in hooks]}: a plan runs what they "
                    "computed on tensors, traced once; anything else they do (recording an activation, logging, "
                    "counting calls) happens in that trace only, not at each call",
                    stacklevel=3,
                )


def _is_torchs(hook: Any) -> bool:
    """A hook of torch's own (weight norm, spectral norm), which only computes on tensors."""
    owner = hook if isinstance(hook, (types.FunctionType, functools.partial)) else type(hook)
    return (getattr(owner, "__module__", None) or "").startswith("torch.")


def warn_if_evaluating(model: torch.nn.Module) -> None:
    """Optimizing a model in eval mode (what ``from_pretrained`` returns) plans an evaluation-mode step."""
    if not model.training:
        warnings.warn(
            "the model is in eval mode: dropout and batch norm are captured as in evaluation "
            "(call model.train() before magis.optimize to train with them)",
            stacklevel=3,
        )


@contextlib.contextmanager
def autocast_off() -> Iterator[None]:
    """Autocast off on every device where it is on (module docstring)."""
    with contextlib.ExitStack() as stack:
        for device, dtype in autocast_state():
            if dtype is not None:
                stack.enter_context(torch.autocast(device, enabled=False))
        yield


@contextlib.contextmanager
def autocast_as(state: tuple[tuple[str, torch.dtype | None], ...]) -> Iterator[None]:
    """Autocast as :func:`autocast_state` recorded it: on, with its dtype, on every device where it was."""
    with contextlib.ExitStack() as stack:
        for device, dtype in state:
            if dtype is not None:
                stack.enter_context(torch.autocast(device, dtype=dtype))
        yield


def _trainable(requires_grad: bool) -> str:
    return "trainable" if requires_grad else "frozen (requires_grad=False)"


def _module(name: str) -> str:
    return f"submodule {name!r}" if name else "the model"


def _mode(training: bool) -> str:
    return "training" if training else "eval"


def _autocast(device: str, dtype: torch.dtype | None) -> str:
    return f"autocast off on {device}" if dtype is None else f"torch.autocast({device!r}, dtype={dtype})"
