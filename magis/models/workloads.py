"""The seven training workloads of the MAGIS evaluation (§7.1, Table 2), at three sizes.

======================  =====  ==========================================
workload                batch  configuration (preset ``paper``)
======================  =====  ==========================================
resnet50                64     image 224
bert-base               32     sequence 512
vit-base                64     image 224, patch 16
unet                    32     image 256
unetpp                  16     image 256
gpt-neo-1.3b            32     sequence 512
btlm-3b                 32     sequence 512
======================  =====  ==========================================

Every model is built from a configuration with random weights (nothing is
downloaded) and wrapped so that ``built.model(*built.example_inputs)`` returns the
scalar training loss: transformers models get their labels and report ``.loss``;
the U-Nets are trained with per-pixel cross-entropy against an integer mask.
Models are in train mode with their configurations' dropout probabilities.
The paper trains GPT-Neo and BTLM in bf16 and the rest in tf32; here every model
is float32 (labels and token ids int64).

Presets: ``paper`` is Table 2; ``tiny`` runs one eager step on a laptop CPU in well
under a second (unit tests); ``small`` keeps the real architecture where it fits and
peaks at 0.5-2 GiB of live tensor memory in an eager CPU training step (measured
figures beside the presets), for experiments that run plans for real.

Building under ``torch._subclasses.fake_tensor.FakeTensorMode`` gives fake weights
and inputs, so even the 3B-parameter model is built in about a second without
allocating memory, ready for graph capture.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode

from magis.models.unet import UNet, UNetPlusPlus

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

PRESETS = ("tiny", "small", "paper")


@dataclass(frozen=True)
class Built:
    """A model ready for one training step.

    ``loss_fn`` maps the model's output to the scalar loss; ``None`` means the output
    is the loss (or, for a transformers output object, its ``.loss``). Every workload
    here returns the loss itself, so it is ``None`` for all of them.
    """

    model: nn.Module
    example_inputs: tuple
    loss_fn: Callable[[Any], torch.Tensor] | None = None
    inference: bool = False  # the model's output is not a loss: plan its forward (Workload.inference)


@dataclass(frozen=True)
class Workload:
    """One evaluation workload: its presets and how to build it."""

    name: str
    description: str
    presets: dict[str, dict]
    builder: Callable[[dict, int], Built] = field(repr=False, compare=False)
    inference: bool = False
    """A forward pass in eval mode (Serenity's networks): ``model(*inputs)`` is the output, not a loss."""

    @property
    def has_sequence(self) -> bool:
        """Whether the model takes token sequences, so that :meth:`build` can change their length."""
        return all("seq" in sizes for sizes in self.presets.values())

    def build(self, preset: str = "tiny", batch: int | None = None, seed: int = 0, *, seq: int | None = None) -> Built:
        """Build the model (train mode; eval mode for an :attr:`inference` workload) and example
        inputs of ``preset``, optionally at another batch size or (a model that takes token
        sequences: :attr:`has_sequence`) another sequence length.

        A model built with ``seq`` is configured for sequences of exactly that length: its
        ``max_positions`` (the learned position table of BERT and GPT-Neo, GPT-Neo's causal
        masks) becomes ``seq``, so any length can be built, and the step's memory is a
        polynomial in it (:func:`magis.fits` relies on that). For BERT the paper preset's
        table is as long as its sequences already; GPT-Neo's 2048 positions shrink with it.
        Seeds torch with ``seed`` first, so two builds are identical. Works inside
        ``FakeTensorMode`` (fake weights and inputs, nothing allocated).
        """
        sizes = self._preset(preset)
        batch = sizes["batch"] if batch is None else batch
        _check_size("batch", batch)
        if seq is not None:
            if not self.has_sequence:
                raise self._no_sequence()
            _check_size("seq", seq)
            sizes = {**sizes, "seq": seq, **({"max_positions": seq} if "max_positions" in sizes else {})}
        torch.manual_seed(seed)
        built = replace(self.builder(sizes, batch), inference=self.inference)
        built.model.train(not self.inference)
        return built

    def sized(self, dim: str, preset: str = "paper") -> SizedWorkload:
        """``make(n)``: ``preset`` built at batch size ``n`` (``dim="batch"``) or sequence length ``n``
        (``dim="sequence"``), on fake tensors, as ``(model, inputs)``: the form :func:`magis.fits` takes."""
        if dim not in ("batch", "sequence"):
            raise ValueError(f"dim must be 'batch' or 'sequence', got {dim!r}")
        if dim == "sequence" and not self.has_sequence:
            raise self._no_sequence()
        self._preset(preset)  # an unknown preset fails here, not at the first size
        return SizedWorkload(self, dim, preset)

    def _no_sequence(self) -> ValueError:
        return ValueError(
            f"{self.name} takes no token sequences (its inputs are images): it has no sequence length; size it by batch"
        )

    def _preset(self, preset: str) -> dict:
        if preset not in self.presets:
            raise ValueError(f"unknown preset {preset!r} for {self.name}: choose one of {', '.join(self.presets)}")
        return self.presets[preset]


@dataclass(frozen=True)
class SizedWorkload:
    """A built-in workload at ``preset`` as a function of one size (:meth:`Workload.sized`); it
    pickles (its builder by name), so another process can build it too."""

    workload: Workload
    dim: str
    preset: str

    def __call__(self, n: int) -> tuple:
        """The model and its inputs at size ``n``, on fake tensors: ``(model, inputs)``."""
        workload = self.workload
        with fake_if(True):
            built = workload.build(self.preset, batch=n) if self.dim == "batch" else workload.build(self.preset, seq=n)
        assert built.loss_fn is None, "every workload's model returns its loss"
        return built.model, built.example_inputs


def _check_size(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


class HFTask(nn.Module):
    """A transformers model called with positional tensors; returns its loss.

    ``HFTask(model, ("input_ids", "labels"))(ids, labels)`` is
    ``model(input_ids=ids, labels=labels).loss``: graph capture passes positional
    arguments, transformers expects keywords.
    """

    def __init__(self, model: PreTrainedModel, input_names: tuple[str, ...]) -> None:
        super().__init__()
        self.model = model
        self.input_names = input_names

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.model(**dict(zip(self.input_names, inputs, strict=True))).loss


class CrossEntropyTask(nn.Module):
    """A network trained with cross-entropy against integer targets, class labels (an image
    classifier) or per-pixel masks (a segmentation network): ``forward(images, targets) -> loss``."""

    def __init__(self, network: nn.Module) -> None:
        super().__init__()
        self.network = network

    def forward(self, images: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.network(images), targets)


class MissingDependency(RuntimeError):
    """A workload needs a package that is not installed (the message says which and how to get it)."""


def transformers_module() -> ModuleType:
    """``transformers``, imported when a workload first needs it: magis itself runs without it."""
    try:
        return importlib.import_module("transformers")
    except ImportError as err:
        raise MissingDependency(
            "this workload is a transformers model and transformers is not installed: pip install 'magis[models]'"
        ) from err


def _instantiate(model_class: type[PreTrainedModel], config: PretrainedConfig) -> PreTrainedModel:
    """``model_class(config)``; under ``FakeTensorMode`` without weight initialization.

    Fake weights have no values to initialize, and ``trunc_normal_`` (ViT) rejection-samples
    with a data-dependent loop that fake tensors cannot run. ``no_init_weights`` also skips
    the weight tying that initialization ends with, so tie explicitly.
    """
    if detect_fake_mode() is None:
        return model_class(config)
    with importlib.import_module("transformers.initialization").no_init_weights():
        model = model_class(config)
    model.tie_weights()
    return model


def _float_dtype(model: nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype


def _images(model: nn.Module, batch: int, size: int) -> torch.Tensor:
    return torch.randn(batch, 3, size, size, dtype=_float_dtype(model))


def _tokens(vocab: int, batch: int, seq: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), dtype=torch.int64)


def _classification(model: PreTrainedModel, sizes: dict, batch: int) -> Built:
    labels = torch.randint(0, sizes["labels"], (batch,), dtype=torch.int64)
    return Built(HFTask(model, ("pixel_values", "labels")), (_images(model, batch, sizes["image"]), labels))


def _language_model(model: PreTrainedModel, sizes: dict, batch: int) -> Built:
    """Token ids and labels: for a causal LM the labels are the ids (transformers shifts them);
    for the masked LM every position is a prediction target."""
    ids = _tokens(sizes["vocab"], batch, sizes["seq"])
    return Built(HFTask(model, ("input_ids", "labels")), (ids, ids.clone()))


def _build_resnet(sizes: dict, batch: int) -> Built:
    hf = transformers_module()
    config = hf.ResNetConfig(
        embedding_size=sizes["embedding"],
        hidden_sizes=list(sizes["hidden_sizes"]),
        depths=list(sizes["depths"]),
        layer_type="bottleneck",
        num_labels=sizes["labels"],
        problem_type="single_label_classification",
    )
    return _classification(_instantiate(hf.ResNetForImageClassification, config), sizes, batch)


def _build_bert(sizes: dict, batch: int) -> Built:
    hf = transformers_module()
    config = hf.BertConfig(
        vocab_size=sizes["vocab"],
        hidden_size=sizes["hidden"],
        num_hidden_layers=sizes["layers"],
        num_attention_heads=sizes["heads"],
        intermediate_size=sizes["intermediate"],
        max_position_embeddings=sizes["max_positions"],
    )
    model = _instantiate(hf.BertForMaskedLM, config)
    # The MLM head registers its output bias twice, as ``cls.predictions.bias`` and as the
    # tied ``cls.predictions.decoder.bias``. aot_export_module lifts every registration
    # as its own graph input; the one forward never reads gets no gradient and export
    # fails ("Found a parameter that did not receive a gradient"). Drop the unread name
    # (the weights are tied already; transformers' tie_weights() would now fail looking for it).
    del model.cls.predictions.bias
    return _language_model(model, sizes, batch)


def _build_vit(sizes: dict, batch: int) -> Built:
    hf = transformers_module()
    config = hf.ViTConfig(
        image_size=sizes["image"],
        patch_size=sizes["patch"],
        hidden_size=sizes["hidden"],
        num_hidden_layers=sizes["layers"],
        num_attention_heads=sizes["heads"],
        intermediate_size=sizes["intermediate"],
        num_labels=sizes["labels"],
        problem_type="single_label_classification",
    )
    return _classification(_instantiate(hf.ViTForImageClassification, config), sizes, batch)


def _segmentation(network: nn.Module, sizes: dict, batch: int) -> Built:
    masks = torch.randint(0, sizes["classes"], (batch, sizes["image"], sizes["image"]), dtype=torch.int64)
    return Built(CrossEntropyTask(network), (_images(network, batch, sizes["image"]), masks))


def _build_unet(sizes: dict, batch: int) -> Built:
    return _segmentation(UNet(3, sizes["classes"], sizes["width"], sizes["depth"]), sizes, batch)


def _build_unetpp(sizes: dict, batch: int) -> Built:
    return _segmentation(UNetPlusPlus(3, sizes["classes"], sizes["width"], sizes["depth"]), sizes, batch)


# Causal LMs keep ``use_cache=True`` (the default) in training. Without a cache object,
# transformers' mask builder looks for packed sequences in ``position_ids`` with a
# data-dependent ``.all()`` that aot_export_module cannot trace; an all-ones
# attention_mask instead hits a data-dependent check in the sdpa mask path. The
# cache only references the keys and values autograd saves anyway, and it dies with
# the output object inside ``HFTask.forward``.


def _build_gpt_neo(sizes: dict, batch: int) -> Built:
    hf = transformers_module()
    config = hf.GPTNeoConfig(
        vocab_size=sizes["vocab"],
        max_position_embeddings=sizes["max_positions"],
        hidden_size=sizes["hidden"],
        num_layers=sizes["layers"],
        num_heads=sizes["heads"],
        attention_types=[[["global", "local"], sizes["layers"] // 2]],
        window_size=sizes["window"],
        bos_token_id=sizes["vocab"] - 1,
        eos_token_id=sizes["vocab"] - 1,
        use_cache=True,
    )
    # GPT-Neo has only the eager attention implementation in transformers (no sdpa).
    return _language_model(_instantiate(hf.GPTNeoForCausalLM, config), sizes, batch)


def _build_btlm(sizes: dict, batch: int) -> Built:
    """BTLM-3B-8K (Dey et al. 2023) on ``LlamaForCausalLM``, the nearest transformers class.

    BTLM is a GPT-2-style decoder with a SwiGLU MLP; transformers has no class for it
    (the hub model needs ``trust_remote_code``). Llama matches its parameter shapes:
    gated SiLU MLP with three projections, biases on every projection
    (``attention_bias``/``mlp_bias``), tied input/output embeddings, multi-head
    attention with as many key/value heads as query heads. What differs: Llama uses
    rotary position embeddings where BTLM uses ALiBi (neither has parameters; RoPE
    rotates q and k, ALiBi adds a bias to the attention scores), RMSNorm where BTLM uses
    LayerNorm (no norm bias: 65 x hidden fewer parameters), and none of BTLM's muP
    constant multipliers (embedding scale, 1/d attention scaling, output logit scale).
    The matmul shapes, and so the memory and time profile, are BTLM's.
    """
    hf = transformers_module()
    config = hf.LlamaConfig(
        vocab_size=sizes["vocab"],
        hidden_size=sizes["hidden"],
        intermediate_size=sizes["intermediate"],
        num_hidden_layers=sizes["layers"],
        num_attention_heads=sizes["heads"],
        num_key_value_heads=sizes["heads"],
        max_position_embeddings=sizes["max_positions"],
        rms_norm_eps=1e-5,
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=True,
        bos_token_id=sizes["vocab"] - 1,
        eos_token_id=sizes["vocab"] - 1,
        use_cache=True,
    )
    return _language_model(_instantiate(hf.LlamaForCausalLM, config), sizes, batch)


# Architecture sizes of the paper's models; presets override some and add batch and input sizes.
#
# The ``small`` presets, measured: peak live tensor memory of one eager CPU training step
# (forward + backward, no optimizer; magis.backend.meter.LiveTensorMeter, parameters, inputs
# and gradients included) and the CPU seconds of that step on one thread.
#   resnet50      0.78 GiB  4.0 s        unetpp         0.69 GiB  7.3 s
#   bert-base     1.06 GiB  6.4 s        gpt-neo-1.3b   1.17 GiB  6.1 s
#   vit-base      0.78 GiB  6.6 s        btlm-3b        1.25 GiB  6.2 s
#   unet          0.58 GiB 10.4 s
# (medians of experiments/peers.py's interleaved eager steps, on a machine shared with other jobs)
_RESNET50 = dict(embedding=64, hidden_sizes=(256, 512, 1024, 2048), depths=(3, 4, 6, 3), labels=1000)
_BERT_BASE = dict(vocab=30522, hidden=768, layers=12, heads=12, intermediate=3072, max_positions=512)
_VIT_BASE = dict(patch=16, hidden=768, layers=12, heads=12, intermediate=3072, labels=1000)
_UNET = dict(width=64, depth=4, classes=2)
_UNETPP = dict(width=32, depth=4, classes=2)
_GPT_NEO_13B = dict(vocab=50257, hidden=2048, layers=24, heads=16, window=256, max_positions=2048)
_BTLM_3B = dict(vocab=50257, hidden=2560, layers=32, heads=32, intermediate=6826, max_positions=8192)
_TINY_TRANSFORMER = dict(hidden=32, layers=2, heads=2, intermediate=64)
_TINY_LM = dict(_TINY_TRANSFORMER, vocab=256, max_positions=64)

WORKLOADS: dict[str, Workload] = {  # the seven of the MAGIS evaluation; the zoo adds the seeds' (magis.models.zoo)
    w.name: w
    for w in (
        Workload(
            "resnet50",
            "ResNet-50 image classification (He et al. 2016), transformers ResNetForImageClassification",
            {
                "tiny": dict(
                    batch=2, image=32, embedding=8, hidden_sizes=(16, 32, 64, 128), depths=(1, 1, 1, 1), labels=10
                ),
                "small": dict(_RESNET50, batch=8, image=224),
                "paper": dict(_RESNET50, batch=64, image=224),
            },
            _build_resnet,
        ),
        Workload(
            "bert-base",
            "BERT-base masked language modelling (Devlin et al. 2019), transformers BertForMaskedLM",
            {
                "tiny": dict(_TINY_LM, batch=2, seq=16),
                "small": dict(_BERT_BASE, batch=2, seq=512, layers=4),
                "paper": dict(_BERT_BASE, batch=32, seq=512),
            },
            _build_bert,
        ),
        Workload(
            "vit-base",
            "ViT-base/16 image classification (Dosovitskiy et al. 2021), transformers ViTForImageClassification",
            {
                "tiny": dict(_TINY_TRANSFORMER, batch=2, image=32, patch=8, labels=10),
                "small": dict(_VIT_BASE, batch=4, image=224),
                "paper": dict(_VIT_BASE, batch=64, image=224),
            },
            _build_vit,
        ),
        Workload(
            "unet",
            "U-Net segmentation (Ronneberger et al. 2015), magis.models.unet.UNet",
            {
                "tiny": dict(_UNET, batch=2, image=32, width=4),
                "small": dict(_UNET, batch=2, image=256),
                "paper": dict(_UNET, batch=32, image=256),
            },
            _build_unet,
        ),
        Workload(
            "unetpp",
            "U-Net++ segmentation with nested skip pathways (Zhou et al. 2018), magis.models.unet.UNetPlusPlus",
            {
                "tiny": dict(_UNETPP, batch=2, image=32, width=4),
                "small": dict(_UNETPP, batch=2, image=256),
                "paper": dict(_UNETPP, batch=16, image=256),
            },
            _build_unetpp,
        ),
        Workload(
            "gpt-neo-1.3b",
            "GPT-Neo 1.3B causal language modelling (Black et al. 2021), transformers GPTNeoForCausalLM",
            {
                "tiny": dict(_TINY_LM, batch=2, seq=32, window=8),
                "small": dict(_GPT_NEO_13B, batch=2, seq=256, hidden=1024, layers=4),
                "paper": dict(_GPT_NEO_13B, batch=32, seq=512),
            },
            _build_gpt_neo,
        ),
        Workload(
            "btlm-3b",
            "BTLM-3B-8K causal language modelling (Dey et al. 2023), shapes on transformers LlamaForCausalLM",
            {
                "tiny": dict(_TINY_LM, batch=2, seq=32, intermediate=86),
                "small": dict(_BTLM_3B, batch=2, seq=256, hidden=1280, heads=16, intermediate=3413, layers=2),
                "paper": dict(_BTLM_3B, batch=32, seq=512),
            },
            _build_btlm,
        ),
    )
}


@contextlib.contextmanager
def fake_if(enabled: bool) -> Iterator[FakeTensorMode | None]:
    """Build under ``FakeTensorMode`` (no real memory) when ``enabled``."""
    if not enabled:
        yield None
        return
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        yield mode
