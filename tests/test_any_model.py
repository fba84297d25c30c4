"""Models as users bring them: tied weights, weights on the meta device or fake, no transformers."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import magis
from magis.frontend.capture import aliased_slots

transformers = pytest.importorskip("transformers")


class SharedEmbedding(nn.Module):
    """T5's pattern: one embedding module reached by two names, its weight tied to a head."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Embedding(11, 6)
        self.encoder = nn.Module()
        self.encoder.embed_tokens = self.shared  # the same module: one slot, two names
        self.mix = nn.Linear(6, 6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.shared.weight  # another module's slot: a tie

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mix(self.encoder.embed_tokens(ids)))
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), ids.flatten())


def test_a_weight_shared_by_slots_gets_one_input_and_its_whole_gradient():
    torch.manual_seed(0)
    model = SharedEmbedding()
    assert len(aliased_slots(model)) == 1  # the head; encoder.embed_tokens is the same slot as shared
    ids = torch.randint(0, 11, (3, 4))
    graph = magis.capture(model, (ids,))
    assert sorted(graph.signature.parameters.values()) == ["mix.bias", "mix.weight", "shared.weight"]
    report = magis.profile(model, (ids,), run=True)
    assert report.missing_gradients == report.extra_gradients == []
    assert report.max_grad_error < 1e-5
    assert model.head.weight is model.shared.weight  # the tie survives the capture


def t5_step() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """A tiny T5 whose embedding is tied four ways (shared, both stacks' embed_tokens, LM head)."""
    config = transformers.T5Config(
        vocab_size=40,
        d_model=16,
        d_kv=8,
        d_ff=32,
        num_layers=1,
        num_decoder_layers=1,
        num_heads=2,
        decoder_start_token_id=0,
        pad_token_id=0,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(config).train()

    class Step(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.t5 = model

        def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return self.t5(input_ids=ids, labels=labels).loss

    return Step(), (torch.randint(1, 40, (2, 5)), torch.randint(1, 40, (2, 4)))


def test_t5_trains_its_tied_embedding_like_eager():
    model, inputs = t5_step()
    report = magis.profile(model, inputs, run=True)
    assert report.missing_gradients == report.extra_gradients == [], report
    assert report.max_grad_error < 1e-4
    graph = magis.capture(model, inputs)
    assert "t5.shared.weight" in graph.signature.gradients


LLAMA = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, vocab_size=512)


def _llama_step(model: nn.Module) -> nn.Module:
    class Step(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm = model

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.lm(input_ids=ids, labels=ids).loss

    return Step()


@pytest.mark.parametrize("build", ["meta", "fake", "fake, real inputs"])
def test_a_model_without_real_weights_is_planned(build: str):
    """The ecosystem's conventions for models one cannot hold: the meta device (accelerate's
    ``init_empty_weights``) and ``FakeTensorMode()`` (strict); the
    forward makes real tensors along the way (rotary positions, an empty KV cache)."""
    config = transformers.LlamaConfig(**LLAMA)
    context = torch.device("meta") if build == "meta" else FakeTensorMode()
    with context:
        model = transformers.LlamaForCausalLM(config)
        ids = torch.randint(0, 512, (2, 64))
    if build == "fake, real inputs":
        ids = torch.randint(0, 512, (2, 64))
    report = magis.profile(_llama_step(model), (ids,))
    assert report.device == "h200"
    # weights (fp32) + their gradients at least, and the logits' activations
    assert report.simulated_peak_bytes > 2 * report.weight_bytes + 2 * 64 * 512 * 4
    assert all(p.device.type == "meta" for p in model.parameters()) == (build == "meta")


def test_planning_a_meta_model_matches_planning_it_with_real_weights():
    config = transformers.LlamaConfig(**LLAMA)
    torch.manual_seed(0)
    real = transformers.LlamaForCausalLM(config)
    with torch.device("meta"):
        meta = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 512, (2, 64))
    planned = [magis.profile(_llama_step(m), (ids,), device="h200") for m in (real, meta)]
    for key in ("nodes", "weight_bytes", "simulated_peak_bytes", "simulated_latency_s"):
        assert getattr(planned[0], key) == getattr(planned[1], key), key


def _run_without_transformers(code: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter where ``import transformers`` fails, as after ``pip install -e .``."""
    prelude = "import sys\nsys.modules['transformers'] = None\n"
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True, timeout=300
    )


def test_the_cli_runs_without_transformers():
    done = _run_without_transformers(
        """
        from magis.cli import main
        assert main(["models"]) == 0
        assert main(["profile", "unet", "--json"]) == 0
        assert main(["profile", "bert-base"]) == 2
        try:
            main(["--help"])
        except SystemExit as exit:
            assert exit.code == 0
        """
    )
    assert done.returncode == 0, done.stderr
    assert "pip install 'magis[models]'" in done.stderr
    assert "ModuleNotFoundError" not in done.stderr
    assert "usage: magis" in done.stdout
