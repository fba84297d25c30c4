"""Plan files: a plan written to disk, read back and run without searching again.

A plan file holds what running a plan needs and what it was made for: the graph that
runs and its order, the simulated figures, the objective, the device, whatever else the
:class:`~magis.plan.Plan` records about its step (:meth:`Plan.save <magis.plan.Plan.save>`
hands over every field but the model and the cost model), the names, shapes, dtypes
and ``requires_grad`` of the model's parameters and buffers, and the magis and torch
versions. Not the model's weights: the plan runs on the model it is loaded for
(:func:`magis.load_plan`), which must have those parameters and buffers.

The body is a pickle of plain data: the IR's dataclasses (nodes, graphs, fissioned
regions) go as their constructor's fields, so the analyses cached on them are not
written, and aten operators by their qualified names (an ``OpOverload`` does not
pickle). A file is written to a temporary name and renamed over ``path``, so a
failure never leaves a half-written plan. As with any pickle, reading a plan file
runs code: load only files you trust.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import io
import os
import pickle
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree

from magis.frontend.capture import named_generators, same_generator_named

#: the first line of every plan file; the number changes when the layout does
HEADER = b"magis plan file 2\n"

#: (shape, dtype, requires_grad) by kind ("parameter", "buffer") and name
TensorSpecs = dict[tuple[str, str], tuple[tuple[int, ...], str, bool]]


def versions() -> dict[str, str]:
    """The magis and torch versions a plan is made with (a plan file records them)."""
    try:
        magis_version = importlib.metadata.version("magis")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        magis_version = "unknown"
    return {"magis": magis_version, "torch": torch.__version__}


def tensor_specs(model: torch.nn.Module) -> TensorSpecs:
    """Every parameter and buffer of ``model`` (tied ones under each name): shape, dtype, requires_grad."""
    named = [("parameter", model.named_parameters(remove_duplicate=False))]
    named.append(("buffer", model.named_buffers(remove_duplicate=False)))
    return {
        (kind, name): (tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."), tensor.requires_grad)
        for kind, items in named
        for name, tensor in items
    }


def write_plan_file(path: str | Path, fields: dict[str, Any], model: torch.nn.Module) -> Path:
    """Write a plan's ``fields`` made for ``model`` to ``path``, atomically; returns the path."""
    payload = {"versions": versions(), "tensors": tensor_specs(model), "plan": fields}
    buffer = io.BytesIO()
    buffer.write(HEADER)
    try:
        _Pickler(buffer, model, protocol=pickle.HIGHEST_PROTOCOL).dump(payload)
    except (pickle.PicklingError, TypeError, AttributeError) as err:
        raise ValueError(f"this plan cannot be written to a file: {err}") from err
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(descriptor, "wb") as file:
            file.write(buffer.getbuffer())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    return path


def read_plan_file(path: str | Path, model: torch.nn.Module) -> dict[str, Any]:
    """The plan fields :func:`write_plan_file` wrote to ``path``, once the file is found to be
    made with this magis and torch, for a model with ``model``'s parameters and buffers.

    A missing file is a ``FileNotFoundError``; a damaged one, a file made by other
    versions or for another model a ``ValueError`` that names the first difference.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"no plan file at {path}") from None
    if not data.startswith(HEADER):
        raise ValueError(f"{path} is not a magis plan file (or one of another format)")
    try:
        payload = _Unpickler(io.BytesIO(data[len(HEADER) :]), model).load()
        saved_versions, tensors, fields = payload["versions"], payload["tensors"], payload["plan"]
    except _GeneratorMissing as err:
        raise ValueError(f"{path} was made for another model: {err}") from None
    except Exception as err:  # a truncated or damaged pickle fails in many ways
        raise ValueError(f"{path} is damaged: {type(err).__name__}: {err}") from err
    for package, version in versions().items():
        if saved_versions.get(package) != version:
            raise ValueError(
                f"{path} was made with {package} {saved_versions.get(package)}, this is {package} {version}: "
                "optimize the model again"
            )
    difference = first_difference(tensors, tensor_specs(model))
    if difference:
        raise ValueError(f"{path} was made for another model: {difference}")
    return fields


def first_difference(planned: TensorSpecs, model: TensorSpecs) -> str | None:
    """The first parameter or buffer that the plan's model and ``model`` do not share as it is."""
    for (kind, name), spec in planned.items():
        ours = model.get((kind, name))
        if ours is None:
            return f"the plan's {kind} {name!r} is not in this model"
        if ours != spec:
            return f"{kind} {name!r} is {_spec(ours)} in this model, {_spec(spec)} in the plan"
    extra = next((key for key in model if key not in planned), None)
    return None if extra is None else f"this model's {extra[0]} {extra[1]!r} is not in the plan"


def _spec(spec: tuple[tuple[int, ...], str, bool]) -> str:
    shape, dtype, requires_grad = spec
    return f"{list(shape)} {dtype}" + (", trainable" if requires_grad else ", frozen")


class _Pickler(pickle.Pickler):
    """Writes magis' dataclasses by their constructor's fields, aten operators by name, a
    batch's pytree structure in pytree's own serialized form (its pickle is deprecated) and a
    ``torch.Generator`` the graph draws from by its name in the model (``""``: torch's default
    of its device): a copy of its state would be a stream apart from the model's, and the
    loaded plan would draw other numbers than eager does (:class:`_Unpickler`)."""

    def __init__(self, file: io.BytesIO, model: torch.nn.Module, protocol: int) -> None:
        super().__init__(file, protocol=protocol)
        self.model = model

    def persistent_id(self, obj: Any) -> Any:
        if not isinstance(obj, torch.Generator):
            return None
        name = same_generator_named(obj, self.model)
        if name is None:
            raise ValueError("the plan draws from a torch.Generator the model does not hold")
        return ("generator", name, str(obj.device))

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, pytree.TreeSpec):
            with contextlib.suppress(NotImplementedError, TypeError, ValueError):  # a type pytree cannot name
                return pytree.treespec_loads, (pytree.treespec_dumps(obj),)
        if isinstance(obj, torch._ops.OpOverload):
            return operator_named, (f"{obj._schema.name}.{obj._overloadname}",)
        if isinstance(obj, torch._ops.OpOverloadPacket):
            return operator_named, (obj._qualified_op_name,)
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type) and type(obj).__module__.startswith("magis."):
            values = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.init}
            return _dataclass, (type(obj), values)
        return NotImplemented


class _Unpickler(pickle.Unpickler):
    """Reads what :class:`_Pickler` wrote, each generator the model's of that name."""

    def __init__(self, file: io.BytesIO, model: torch.nn.Module) -> None:
        super().__init__(file)
        self.model = model

    def persistent_load(self, pid: Any) -> torch.Generator:
        _, name, device = pid
        if not name:
            device = torch.device(device)
            return torch.default_generator if device.type == "cpu" else torch.cuda.default_generators[device.index or 0]
        generator = dict(named_generators(self.model)).get(name)
        if generator is None:
            raise _GeneratorMissing(f"the plan draws from the generator {name!r}, which this model does not hold")
        return generator


class _GeneratorMissing(ValueError):
    """The loaded model holds no generator of the name a plan file draws from."""


def operator_named(name: str) -> torch._ops.OpOverload | torch._ops.OpOverloadPacket:
    """``"aten::add.Tensor"`` -> ``torch.ops.aten.add.Tensor`` (``"aten::add"``: the packet)."""
    namespace, _, qualified = name.partition("::")
    op_name, _, overload = qualified.partition(".")
    try:
        packet = getattr(getattr(torch.ops, namespace), op_name)
        return getattr(packet, overload) if overload else packet
    except (AttributeError, RuntimeError):
        raise ValueError(f"the plan uses the operator {name}, which is not registered in this process") from None


def _dataclass(cls: type, values: dict[str, Any]) -> Any:
    return cls(**values)
