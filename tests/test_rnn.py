"""nn.LSTM, nn.GRU and nn.RNN train like eager PyTorch, inter-layer dropout masks included
(magis.frontend.rnn), or are refused with the reason."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import ten_steps_beside_eager
from torch import nn

import magis
from magis.backend.meter import peak_meter
from magis.frontend.rnn import ExactRNNs, refusal
from magis.ir.graph import Role

aten = torch.ops.aten


class LanguageModel(nn.Module):
    """Embedding -> 2-layer LSTM with dropout -> linear -> next-token cross entropy."""

    def __init__(self, vocab: int = 13, width: int = 6) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.lstm = nn.LSTM(width, width, num_layers=2, dropout=0.2)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.lstm(self.embed(ids[:-1]))
        return F.cross_entropy(self.head(hidden).flatten(0, 1), ids[1:].flatten())


class Recurrent(nn.Module):
    """A recurrent layer on float features (no embedding: the input needs no gradient), its
    output and final states all in the loss; with ``hx_batch``, learned initial states
    for batches of that size are passed as ``hx``."""

    def __init__(self, rnn: nn.RNNBase, hx_batch: int = 0) -> None:
        super().__init__()
        self.rnn = rnn
        layers = rnn.num_layers * (2 if rnn.bidirectional else 1)
        widths = [rnn.proj_size or rnn.hidden_size, rnn.hidden_size] if isinstance(rnn, nn.LSTM) else [rnn.hidden_size]
        self.initial = nn.ParameterList(
            nn.Parameter(0.1 * torch.randn(layers, hx_batch, w)) for w in widths if hx_batch
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hx = None
        if len(self.initial):
            hx = tuple(self.initial) if isinstance(self.rnn, nn.LSTM) else self.initial[0]
        output, final = self.rnn(x, hx)
        finals = final if isinstance(final, tuple) else (final,)
        return output.sin().mean() + sum(f.square().mean() for f in finals)


def lstm_lm() -> tuple[nn.Module, torch.Tensor]:
    return LanguageModel().double(), torch.randint(0, 13, (4, 2))


def float_lstm() -> tuple[nn.Module, torch.Tensor]:
    """float32 on CPU: torch's decomposition sent this to oneDNN's layer and the capture failed."""
    rnn = nn.LSTM(4, 5, num_layers=2, dropout=0.3, batch_first=True)
    return Recurrent(rnn), torch.randn(3, 3, 4)


def projected_lstm() -> tuple[nn.Module, torch.Tensor]:
    rnn = nn.LSTM(4, 5, num_layers=2, dropout=0.4, proj_size=3, bias=False)
    return Recurrent(rnn, hx_batch=3).double(), torch.randn(3, 3, 4, dtype=torch.float64)


def gru() -> tuple[nn.Module, torch.Tensor]:
    rnn = nn.GRU(4, 5, num_layers=2, dropout=0.5, bidirectional=True, batch_first=True)
    return Recurrent(rnn).double(), torch.randn(3, 2, 4, dtype=torch.float64)


def relu_rnn() -> tuple[nn.Module, torch.Tensor]:
    rnn = nn.RNN(4, 5, num_layers=2, dropout=0.3, nonlinearity="relu", bias=False)
    return Recurrent(rnn, hx_batch=3).double(), torch.randn(3, 3, 4, dtype=torch.float64)


MODELS = {"lstm_lm": lstm_lm, "float_lstm": float_lstm, "projected_lstm": projected_lstm, "gru": gru, "rnn": relu_rnn}


def built(name: str) -> tuple[nn.Module, torch.Tensor, float]:
    """The model (seeded), its batch and the tolerance for its dtype."""
    torch.manual_seed(0)
    model, x = MODELS[name]()
    return model, x, 1e-9 if next(model.parameters()).dtype == torch.float64 else 2e-5


@pytest.mark.parametrize(
    ("kind", "options"),
    [
        (nn.LSTM, dict(num_layers=3, bidirectional=True, batch_first=True)),
        (nn.LSTM, dict(num_layers=2, proj_size=2, bias=False)),
        (nn.GRU, dict(num_layers=3, bidirectional=True)),
        (nn.RNN, dict(num_layers=3, nonlinearity="tanh", batch_first=True)),
    ],
    ids=["lstm", "lstm_proj", "gru", "rnn"],
)
def test_unrolled_forward_draws_eagers_dropout_masks(kind: type[nn.RNNBase], options: dict):
    """Eager's kernel and the unrolled ops, same seed: same outputs and gradients in float64."""
    torch.manual_seed(0)
    rnn = kind(4, 5, dropout=0.3, **options).double()
    x = torch.randn(6, 5, 4, dtype=torch.float64, requires_grad=True)
    results = []
    for mode in (contextlib.nullcontext(), ExactRNNs(rnn)):
        rnn.zero_grad()
        x.grad = None
        torch.manual_seed(7)
        with mode:
            output, final = rnn(x)
        finals = final if isinstance(final, tuple) else (final,)
        (output.sin().sum() + sum(f.cos().sum() for f in finals)).backward()
        results.append([output, *finals, x.grad, *(p.grad for p in rnn.parameters())])
    for eager, unrolled in zip(*results):
        torch.testing.assert_close(unrolled, eager, rtol=1e-13, atol=1e-15)


def test_inter_layer_dropout_is_captured_between_layers_only_in_training():
    model = Recurrent(nn.LSTM(2, 2, num_layers=3, dropout=0.2))
    x = torch.randn(2, 1, 2)
    dropouts = lambda graph: sum(n.target is aten.native_dropout.default for n in graph.nodes)  # noqa: E731
    assert dropouts(magis.capture(model, (x,))) == 2  # on the first two layers' outputs
    assert dropouts(magis.capture(model.eval(), (x,))) == 0


@pytest.mark.parametrize("name", list(MODELS))
def test_the_captured_step_has_eagers_gradients(name: str):
    model, x, tolerance = built(name)
    report = magis.profile(model, (x,), run=True, device="h200", seed=3)
    assert report.missing_gradients == report.extra_gradients == []
    assert report.max_grad_error < tolerance


@pytest.mark.parametrize("name", ["lstm_lm", "float_lstm", "gru", "rnn"])
def test_ten_adamw_steps_through_the_plan_equal_eagers(name: str):
    model, x, tolerance = built(name)
    twin = copy.deepcopy(model)
    plan = magis.optimize(model, (x,), latency_limit=1.1, time_budget=5, max_states=50, device="h200", progress=False)
    losses = ten_steps_beside_eager(
        model, twin, lambda: plan(x), lambda: twin(x), lambda params: torch.optim.AdamW(params, lr=1e-2)
    )
    assert losses[1] == pytest.approx(losses[0], rel=tolerance)
    for (key, a), (_, b) in zip(model.state_dict().items(), twin.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=tolerance, atol=tolerance, msg=key)
    constants = [n.target.value for n in plan.graph.nodes if n.role is Role.CONSTANT]
    with peak_meter(model, [x, *constants]) as meter:  # what max_memory_allocated would see around the call
        plan(x)  # .grad is None: each gradient becomes .grad as the plan made it, laid out like its weight
    assert meter.peak_bytes <= 1.02 * plan.peak_bytes


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_an_lstm_on_cuda_trains_as_eager_or_is_refused():
    """On CUDA a module's traced weights have no data pointers for cuDNN's flat buffer (the
    capture failed there); it unrolls as on CPU. cuDNN draws inter-layer dropout itself: refused
    with the way out, which then trains as eager does, masks included."""
    torch.manual_seed(0)
    model, ids = LanguageModel().double().cuda(), torch.randint(0, 13, (4, 2), device="cuda")
    with pytest.raises(magis.CaptureError, match=r"nn.LSTM 'lstm' .*cuDNN.*cudnn.enabled = False"):
        magis.capture(model, (ids,))
    twin = copy.deepcopy(model)
    with torch.backends.cudnn.flags(enabled=False):
        plan = magis.optimize(
            model, (ids,), latency_limit=1.1, time_budget=5, max_states=50, device="h200", progress=False
        )
        losses = ten_steps_beside_eager(
            model, twin, lambda: plan(ids), lambda: twin(ids), lambda params: torch.optim.AdamW(params, lr=1e-2)
        )
    assert losses[1] == pytest.approx(losses[0], rel=1e-9)
    for (key, a), (_, b) in zip(model.state_dict().items(), twin.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=key)


class Packing(nn.Module):
    """Packs its padded batch itself, as models with per-sequence lengths do."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.GRU(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = nn.utils.rnn.pack_padded_sequence(x, [3, 2])
        return self.encoder(packed)[0].data.sum()


def test_a_packed_sequence_is_refused():
    x = torch.randn(3, 2, 4)
    with pytest.raises(magis.CaptureError, match=r"pack_padded_sequence .*pass the padded tensor"):
        magis.capture(Packing(), (x,))
    model = nn.Sequential()
    model.encoder = nn.LSTM(4, 5)
    packed = nn.utils.rnn.pack_padded_sequence(x, [3, 2])
    with pytest.raises(magis.CaptureError, match=r"nn.LSTM 'encoder' .*PackedSequence"):
        magis.capture(model, (packed,), lambda out: out[0].data.sum())


def test_an_lstm_under_autocast_is_refused():
    class Autocast(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lstm = nn.LSTM(4, 5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self.lstm(x)[0].float().square().mean()

    with pytest.raises(magis.CaptureError, match=r"nn.LSTM 'lstm' .*autocast"):
        magis.capture(Autocast(), (torch.randn(3, 2, 4),))


def test_dropout_drawn_inside_a_fused_kernel_is_refused(monkeypatch: pytest.MonkeyPatch):
    """cuDNN draws the masks from its own state: a graph cannot reproduce them."""
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    with torch._subclasses.fake_tensor.FakeTensorMode():
        cuda = torch.empty(3, 2, 4, device="cuda")
    assert "cuDNN" in refusal("GRU", cuda, live_dropout=True)
    assert refusal("GRU", cuda, live_dropout=False) is None
    assert refusal("GRU", torch.empty(3, 2, 4), live_dropout=True) is None
