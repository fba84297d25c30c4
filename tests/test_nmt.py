"""Echo's LSTM translation model (magis.models.nmt, Echo §II-B): its presets, its attention
against a step-by-step reference, and its plan training like eager PyTorch with dropout live."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from conftest import ten_steps_beside_eager

import magis
from magis.models import NMT, ZOO
from magis.models.zoo import build_workload

aten = torch.ops.aten


def expected_parameters(sizes: dict) -> int:
    """What the configuration implies, counted from the architecture (Echo §II-B, Sockeye's encoder):
    two embeddings; a bidirectional first encoder layer of H/2 units each way and ``layers - 1``
    unidirectional ones; a ``layers``-deep decoder; W_q, W_k (H x H) and v (H) of the MLP score, W_c
    (H x 2H); the output layer."""
    v_src, v_tgt, e, h, n = (sizes[k] for k in ("source_vocab", "target_vocab", "embed", "hidden", "layers"))
    # An LSTM layer of u units over inputs of width i: W_ih (4u x i), W_hh (4u x u), b_ih and b_hh (4u each).
    lstm = lambda i, u: 4 * u * i + 4 * u * u + 2 * 4 * u  # noqa: E731
    encoder = 2 * lstm(e, h // 2) + (n - 1) * lstm(h, h)
    decoder = lstm(e, h) + (n - 1) * lstm(h, h)
    return (v_src + v_tgt) * e + encoder + decoder + 2 * h * h + h + 2 * h * h + h * v_tgt + v_tgt


@pytest.mark.parametrize("preset", ["tiny", "small", "paper"])
def test_presets_build_with_the_configurations_sizes(preset: str):
    sizes = ZOO["nmt"].presets[preset]
    built = build_workload("nmt", preset, None)  # paper: fake tensors
    source, target = built.example_inputs
    assert source.shape == (sizes["batch"], sizes["seq"]) and target.shape == (sizes["batch"], sizes["seq"] + 1)
    assert int(source.max()) < sizes["source_vocab"] if preset != "paper" else source.dtype == torch.int64
    assert sum(p.numel() for p in built.model.parameters()) == expected_parameters(sizes)
    assert built.model.training
    if preset == "paper":  # Echo §VI: batch 128; 2 x 512 LSTM, IWSLT'15 En-Vi vocabularies, 25.6M parameters
        assert (sizes["batch"], sizes["hidden"], sizes["layers"]) == (128, 512, 2)
        assert expected_parameters(sizes) == 25_633_309


def test_every_sequence_length_follows_seq():
    built = ZOO["nmt"].build("tiny", seq=3)
    assert [tuple(x.shape) for x in built.example_inputs] == [(2, 3), (2, 4)]


def test_tiny_loss_is_finite_and_every_parameter_gets_a_gradient():
    built = build_workload("nmt", "tiny", None)
    loss = built.model(*built.example_inputs)
    loss.backward()
    assert loss.dim() == 0 and math.isfinite(loss.item())
    # Near log(vocab) at initialization: the loss is a cross-entropy over the target vocabulary.
    assert abs(loss.item() - math.log(ZOO["nmt"].presets["tiny"]["target_vocab"])) < 1.0
    for name, p in built.model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_batched_attention_equals_the_mlp_score_step_by_step():
    """Eval mode (no dropout): the loss equals the attention computed one target step and one
    source position at a time (score v^T tanh(W_q h_t + W_k h_s), softmax, context, tanh(W_c[c_t; h_t]))."""
    torch.manual_seed(0)
    model = NMT(11, 13, embed=6, hidden=8, layers=3).double().eval()
    source, target = torch.randint(0, 11, (3, 5)), torch.randint(0, 13, (3, 5))
    memory, state = model.encode(source)  # (S, B, H)
    queries, _ = model.decoder(model.target_embed(target[:, :-1].t()), state)  # (T, B, H)
    losses = []
    for b in range(3):
        for t in range(queries.shape[0]):
            h_t = queries[t, b]
            scores = torch.stack(
                [
                    model.energy.weight[0] @ torch.tanh(model.query.weight @ h_t + model.keys.weight @ memory[s, b])
                    for s in range(memory.shape[0])
                ]
            )
            alpha = scores.softmax(0)
            context = sum(alpha[s] * memory[s, b] for s in range(memory.shape[0]))
            a_t = torch.tanh(model.combine.weight @ torch.cat([context, h_t]))
            logits = model.output.weight @ a_t + model.output.bias
            losses.append(-logits.log_softmax(0)[target[b, t + 1]])
    torch.testing.assert_close(model(source, target), torch.stack(losses).mean(), rtol=1e-12, atol=1e-12)


def test_ten_sgd_steps_through_the_plan_equal_eagers_with_dropout_live():
    """float64 on CPU: the plan's ops are eager's (nn.LSTM unrolled as its CPU kernel runs,
    magis.frontend.rnn), inter-layer and attention dropout drawn from the same generator in the
    same order; only the order of floating-point reductions may differ, so 1e-9 relative (as
    tests/test_rnn.py) bounds rounding in float64 while any different mask moves the loss by ~1e-2."""
    built = build_workload("nmt", "tiny", None)
    model, inputs = built.model.double(), built.example_inputs
    twin = copy.deepcopy(model)
    plan = magis.optimize(model, inputs, latency_limit=1.1, time_budget=2, max_states=50, device="h200", progress=False)
    # dropout on both embeddings, between the encoder's layers, inside the decoder's LSTM, on a_t
    assert sum(node.target is aten.native_dropout.default for node in plan.graph.nodes) == 5
    losses = ten_steps_beside_eager(
        model, twin, lambda: plan(*inputs), lambda: twin(*inputs), lambda params: torch.optim.SGD(params, lr=0.1)
    )
    assert losses[1] == pytest.approx(losses[0], rel=1e-9)
    assert len(set(losses[0])) == 10  # the parameters moved and the masks changed
    for (key, a), (_, b) in zip(model.state_dict().items(), twin.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, msg=key)
    # The masks matter: the same step under another seed gives another loss.
    torch.manual_seed(1)
    other = float(twin(*inputs).detach())
    torch.manual_seed(2)
    assert abs(float(twin(*inputs).detach()) - other) > 1e-6


def test_eval_mode_draws_no_dropout():
    built = build_workload("nmt", "tiny", None)
    model = built.model.eval()
    torch.manual_seed(1)
    first = model(*built.example_inputs)
    torch.manual_seed(2)
    assert model(*built.example_inputs).item() == first.item()
