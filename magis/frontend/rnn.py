"""Recurrent layers (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``) captured as the step eager PyTorch runs.

``nn.RNNBase`` calls one fused op per module (``torch._VF.lstm``, ``gru``, ``rnn_tanh``,
``rnn_relu``). Traced by AOTAutograd, that op goes through torch's Python decomposition
(``torch/_decomp/decompositions.py``), which is not what eager runs:

- ``_rnn_helper`` sets ``dropout = dropout if (train and num_layers < i - 1) else 0.0``,
  never true for a layer ``i < num_layers``: a stacked RNN was captured, and trained by
  its plan, without its inter-layer dropout;
- ``lstm_impl`` sends a float32 CPU input that needs no gradient (features, not an
  embedding's output) to oneDNN's ``mkldnn_rnn_layer`` with ``train=False``, whose
  backward yields one node for both biases' gradients; AOTAutograd's signature cannot
  map one node to two parameters and the capture failed.

While the step is traced, :class:`ExactRNNs` runs those ops as eager's CPU kernel does
(``aten/src/ATen/native/RNN.cpp``: ``FullLayer``, ``FullBidirectionalLayer``, the cells,
``apply_layer_stack``), op for op (out of place where the kernel works in place: the
graph is functional), so the captured step is eager's (docs/design.md: a capture that
differs from eager is refused). Dropout
between layers is ``at::dropout(x, p, train=True)`` on each layer's output but the
last's, after both directions, as there: the same generator draws, in the same order,
of the same shape, so the masks are eager's under the same seed. The oneDNN path eager
takes for a float32 LSTM on CPU draws its dropout the same way and differs only in
rounding. A call whose masks a graph cannot reproduce is refused with the reason.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from magis.frontend.step import CaptureError

Tensor = torch.Tensor
State = Any  # a Tensor h, or (h, c) for an LSTM
Cell = Callable[[Tensor, State, Tensor, Tensor | None, Tensor | None], State]


def lstm_cell(x_w: Tensor, state: State, w_hh: Tensor, b_hh: Tensor | None, w_hr: Tensor | None) -> State:
    """``LSTMCell`` with the input projection precomputed: ``linear_hh(h).add_(x_w)``, chunked."""
    h, c = state
    gates = F.linear(h, w_hh, b_hh) + x_w
    in_gate, forget_gate, cell_gate, out_gate = gates.chunk(4, 1)
    c = forget_gate.sigmoid() * c + in_gate.sigmoid() * cell_gate.tanh()
    h = out_gate.sigmoid() * c.tanh()
    return (h if w_hr is None else torch.matmul(h, w_hr.t())), c


def gru_cell(x_w: Tensor, h: Tensor, w_hh: Tensor, b_hh: Tensor | None, w_hr: Tensor | None) -> Tensor:
    """``GRUCell`` with the input projection precomputed."""
    x_r, x_z, x_n = x_w.chunk(3, 1)
    h_r, h_z, h_n = F.linear(h, w_hh, b_hh).chunk(3, 1)
    reset = (h_r + x_r).sigmoid()
    update = (h_z + x_z).sigmoid()
    new = (x_n + h_n * reset).tanh()
    return (h - new) * update + new


def simple_cell(nonlinearity: Callable[[Tensor], Tensor]) -> Cell:
    """``SimpleCell``: ``nonlinearity(linear_hh(h).add_(x_w))``."""

    def cell(x_w: Tensor, h: Tensor, w_hh: Tensor, b_hh: Tensor | None, w_hr: Tensor | None) -> Tensor:
        return nonlinearity(F.linear(h, w_hh, b_hh) + x_w)

    return cell


CELLS: dict[Callable, tuple[str, Cell]] = {
    torch._VF.lstm: ("LSTM", lstm_cell),
    torch._VF.gru: ("GRU", gru_cell),
    torch._VF.rnn_tanh: ("RNN", simple_cell(torch.tanh)),
    torch._VF.rnn_relu: ("RNN", simple_cell(torch.relu)),
}
INPUT_ARGS = ("input", "hx", "params", "has_biases", "num_layers", "dropout", "train", "bidirectional", "batch_first")


def unrolled(
    cell: Cell,
    input: Tensor,
    hx: Tensor | Sequence[Tensor],
    params: Sequence[Tensor],
    has_biases: bool,
    num_layers: int,
    dropout: float,
    train: bool,
    bidirectional: bool,
    batch_first: bool,
) -> tuple[Tensor, ...]:
    """What ``torch._VF.<op>(input, hx, params, ...)`` returns, computed as the CPU kernel does.

    ``hx`` is ``(h0, c0)`` for an LSTM, ``h0`` otherwise, stacked over (layer, direction);
    ``params`` per layer and direction: ``w_ih, w_hh[, b_ih, b_hh][, w_hr]``.
    """
    directions = 2 if bidirectional else 1
    lstm = isinstance(hx, (tuple, list))
    states = list(zip(hx[0].unbind(0), hx[1].unbind(0))) if lstm else list(hx.unbind(0))
    per_direction = len(params) // (num_layers * directions)
    x = input.transpose(0, 1) if batch_first else input
    finals = []
    for layer in range(num_layers):
        outputs = []
        for direction in range(directions):
            k = layer * directions + direction
            weights = params[k * per_direction : (k + 1) * per_direction]
            output, final = _direction(cell, x, states[k], weights, has_biases, reverse=direction == 1)
            outputs.append(output)
            finals.append(final)
        x = torch.cat(outputs, outputs[0].dim() - 1) if bidirectional else outputs[0]
        if dropout != 0 and train and layer < num_layers - 1:
            x = torch.dropout(x, dropout, True)  # apply_layer_stack's at::dropout(x, p, train=true)
    output = x.transpose(0, 1) if batch_first else x
    if lstm:
        return output, torch.stack([h for h, _ in finals], 0), torch.stack([c for _, c in finals], 0)
    return output, torch.stack(finals, 0)


def _direction(
    cell: Cell, x: Tensor, state: State, weights: Sequence[Tensor], has_biases: bool, reverse: bool
) -> tuple[Tensor, State]:
    """One layer in one direction (``FullLayer`` on CPU): every step's input projection in one
    ``linear``, then the cell over the steps (in reverse for the backward direction)."""
    w_ih, w_hh, *rest = weights
    b_ih, b_hh = (rest[0], rest[1]) if has_biases else (None, None)
    w_hr = rest[-1] if len(rest) % 2 else None  # the LSTM's projection, when proj_size > 0
    steps = F.linear(x, w_ih, b_ih).unbind(0)
    outputs = []
    for x_w in reversed(steps) if reverse else steps:
        state = cell(x_w, state, w_hh, b_hh, w_hr)
        outputs.append(state[0] if isinstance(state, tuple) else state)
    if reverse:
        outputs.reverse()
    return torch.stack(outputs, 0), state


PACKED = (
    "a PackedSequence's shapes depend on the values of its lengths, which a graph of fixed shapes cannot hold; "
    "pass the padded tensor (and mask the loss)"
)


class ExactRNNs(torch.overrides.TorchFunctionMode):
    """While tracing, each fused recurrent op runs :func:`unrolled`, or is refused with the reason.

    ``model`` names the modules in messages (each ``nn.RNNBase`` passes its own
    ``_flat_weights`` list to the op); a packed sequence is refused where it is made
    or where a module receives it, before its lengths are read.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.modules = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.RNNBase)]
        self.hooks: list[Any] = []

    def __enter__(self) -> ExactRNNs:
        self.hooks = [module.register_forward_pre_hook(self._refuse_packed) for _, module in self.modules]
        for _, module in self.modules:
            # On CUDA a module whose weights were swapped for traced ones lays them out again
            # in cuDNN's flat buffer by their data pointers, which traced tensors have none of
            # (the capture failed there); the unrolled graph reads the weights themselves.
            module.flatten_parameters = _keep_weights_as_they_are
        return super().__enter__()

    def __exit__(self, *exc_info: Any) -> None:
        for hook in self.hooks:
            hook.remove()
        for _, module in self.modules:
            if vars(module).get("flatten_parameters") is _keep_weights_as_they_are:
                del module.flatten_parameters
        super().__exit__(*exc_info)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch._VF._pack_padded_sequence:
            raise CaptureError(f"torch.nn.utils.rnn.pack_padded_sequence cannot be captured: {PACKED}")
        if func not in CELLS:
            return func(*args, **kwargs)
        kind, cell = CELLS[func]
        if "batch_sizes" in kwargs or (len(args) > 3 and not isinstance(args[3], bool)):  # the data overload
            raise self._refused(kind, args[3], PACKED)
        call = dict(zip(INPUT_ARGS, args)) | kwargs
        reason = refusal(kind, call["input"], call["dropout"] != 0 and call["train"] and call["num_layers"] > 1)
        if reason:
            raise self._refused(kind, call["params"], reason)
        return unrolled(cell, **call)

    def _refuse_packed(self, module: torch.nn.RNNBase, args: tuple) -> None:
        if args and isinstance(args[0], torch.nn.utils.rnn.PackedSequence):
            raise self._refused(module.mode.split("_")[0], module._flat_weights, PACKED)

    def _refused(self, kind: str, params: Any, reason: str) -> CaptureError:
        name = next((name for name, m in self.modules if m._flat_weights is params), None)
        where = "" if name is None else f" {name!r}" if name else " (the model)"
        return CaptureError(f"nn.{kind}{where} cannot be captured as eager PyTorch runs it: {reason}")


def _keep_weights_as_they_are() -> None:
    """``nn.RNNBase.flatten_parameters`` while a step is traced (:class:`ExactRNNs`)."""


def refusal(kind: str, input: Tensor, live_dropout: bool) -> str | None:
    """Why a call's step cannot be the one eager runs, or None."""
    device = input.device.type
    if kind == "LSTM" and torch.is_autocast_enabled(device):
        return (
            "under autocast eager runs a fused LSTM kernel in reduced precision (oneDNN on CPU, cuDNN on CUDA) "
            "that the unrolled graph would not reproduce; run the LSTM outside autocast"
        )
    if not live_dropout or device == "cpu" or (device == "cuda" and not _uses_cudnn(input)):
        return None
    kernel = "cuDNN" if device == "cuda" else f"the {device} kernel"
    return (
        f"eager draws its inter-layer dropout masks inside {kernel}, which a graph cannot reproduce; "
        "set dropout=0, or on CUDA torch.backends.cudnn.enabled = False (the native kernel draws them as the graph)"
    )


def _uses_cudnn(input: Tensor) -> bool:
    """``at::cudnn_is_acceptable``: whether eager hands this CUDA input to cuDNN."""
    return (
        torch.backends.cudnn.enabled
        and input.dtype in (torch.float16, torch.float32, torch.float64)
        and torch.backends.cudnn.is_available()
    )
