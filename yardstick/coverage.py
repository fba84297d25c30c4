"""Which models magis captures and trains exactly: a sweep over the model zoo.

Every architecture that transformers registers for causal LM, masked LM, seq2seq LM,
image classification and sequence classification, plus diffusers' ``UNet2DModel``,
``UNet2DConditionModel`` and ``AutoencoderKL``, is built from its configuration
shrunk to a few layers of a few dozen channels (random weights, nothing downloaded),
in train mode, and put through :func:`magis.profile` with ``run=True``. Each gets
one :class:`Verdict`:

- ``not built`` / ``eager fails``: the small configuration cannot be built, or eager
  PyTorch cannot train it on CPU (a model that needs inputs or a device we do not
  give it, or whose own loss or gradients are not finite in any dtype tried). These
  are outside the denominator: there is nothing to compare with.
- ``timed out``: the sweep's driver gave up on it (a model whose CPU reference
  kernels are slow, such as a sequential state-space scan); listed, not counted.
- ``pass``: captured, the gradients cover the same parameters as eager's and equal
  them (:data:`GRADIENT_TOLERANCE`), and the simulated peak equals the measured one
  (:data:`PEAK_TOLERANCE`).
- ``refused``: capture failed with a :class:`~magis.CaptureError` that names its
  cause (grouped by :func:`cause_of`).
- ``wrong``: captured, but a gradient is missing, extra or different, or the peak
  is off: the failures that must never happen.

With ``plan=True`` a passing architecture is also planned as a user would plan it
(:func:`magis.optimize` within :data:`PLAN_SEARCH`'s latency limit, a short search) and the
plan called once beside eager: a search that fails, or a plan whose gradients differ from
eager's, is ``wrong`` too (a rule the search applies to that model breaks it). The step is then
captured once, by the search: the captured step checked is the plan's ``baseline``.
"""

from __future__ import annotations

import importlib
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from magis.api import measure_against_eager, optimize
from magis.backend.eager import GRADIENT_TOLERANCE
from magis.cost.memory import simulate_memory
from magis.frontend.capture import CaptureError, capture
from magis.models.workloads import HFTask, transformers_module
from magis.plan import Plan

#: largest relative difference of simulated to measured peak that counts as equal
PEAK_TOLERANCE = 0.02
#: the search a plan of :func:`check` (``plan=True``) gets: the default limit, few states
PLAN_SEARCH: dict[str, Any] = {"latency_limit": 1.10, "max_states": 8, "time_budget": 10.0, "device": "h200"}
#: a small configuration above this many parameters is not small: not built
MAX_PARAMETERS = 20_000_000

BATCH, SEQUENCE, TARGET_SEQUENCE, IMAGE, VOCAB, LABELS = 2, 16, 8, 32, 128, 3

#: transformers' registries swept, task -> name of the mapping in ``transformers.models.auto.modeling_auto``
TASKS = {
    "causal-lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "masked-lm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "seq2seq-lm": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "image-classification": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
    "sequence-classification": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
}
DIFFUSERS = ("UNet2DModel", "UNet2DConditionModel", "AutoencoderKL")

#: the fast sample run in CI (names of :class:`Architecture`): :func:`choose_sample` over the full
#: sweep of 2026-11-22 (transformers 5.23, diffusers 0.42): 179 of the 182 operators seen there
SAMPLE: frozenset[str] = frozenset(
    (
        "NemotronHForCausalLM (causal-lm)",
        "FunnelForSequenceClassification (sequence-classification)",
        "CpmAntForCausalLM (causal-lm)",
        "PhimoeForSequenceClassification (sequence-classification)",
        "Swinv2ForImageClassification (image-classification)",
        "AutoencoderKL (diffusion)",
        "ProphetNetForCausalLM (causal-lm)",
        "MobileNetV1ForImageClassification (image-classification)",
        "InklingForCausalLM (causal-lm)",
        "FNetForSequenceClassification (sequence-classification)",
        "HieraForImageClassification (image-classification)",
        "BloomForCausalLM (causal-lm)",
        "ConvBertForSequenceClassification (sequence-classification)",
        "XLNetLMHeadModel (causal-lm)",
        "ResNetForImageClassification (image-classification)",
        "DebertaV2ForMaskedLM (masked-lm)",
        "TapasForSequenceClassification (sequence-classification)",
        "YosoForSequenceClassification (sequence-classification)",
        "Ernie4_5_MoeForCausalLM (causal-lm)",
        "ApertusForCausalLM (causal-lm)",
    )
)
SAMPLE_SIZE = 20

#: configuration fields set to small values wherever a configuration (or a sub-configuration) has them
SMALL_SIZES: dict[str, int] = {
    "hidden_size": 32,
    "d_model": 32,
    "n_embd": 32,
    "dim": 32,
    "embed_dim": 32,
    "word_embed_proj_dim": 32,
    "embedding_size": 32,
    "projection_dim": 32,
    "intermediate_size": 64,
    "ffn_dim": 64,
    "d_ff": 64,
    "n_inner": 64,
    "hidden_dim": 64,
    "encoder_ffn_dim": 64,
    "decoder_ffn_dim": 64,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_layers": 2,
    "n_layer": 2,
    "n_layers": 2,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "num_decoder_layers": 2,
    "num_attention_heads": 4,
    "num_heads": 4,
    "n_head": 4,
    "n_heads": 4,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "d_kv": 8,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_k": 2,
    "top_k": 2,
    "n_group": 1,
    "topk_group": 1,
    "vocab_size": VOCAB,
    "max_position_embeddings": 64,
    "n_positions": 64,
    "n_ctx": 64,
    "image_size": IMAGE,
}


@dataclass(frozen=True)
class Architecture:
    """One model class to sweep: a transformers class for a task, or a diffusers model."""

    task: str
    model_type: str
    class_name: str

    @property
    def name(self) -> str:
        return f"{self.class_name} ({self.task})"


@dataclass
class Verdict:
    """What happened to one architecture (see the module docstring for the statuses)."""

    architecture: str
    task: str
    status: str
    cause: str = ""
    nodes: int | None = None
    parameters: int | None = None
    max_grad_error: float | None = None
    missing_gradients: list[str] = field(default_factory=list)
    extra_gradients: list[str] = field(default_factory=list)
    simulated_peak_bytes: int | None = None
    measured_peak_bytes: int | None = None
    seconds: float = 0.0
    ops: list[str] = field(default_factory=list)  # the distinct operators of the captured step
    dtype: str = ""  # of parameters and float inputs: float64, or float32 where eager needs it
    plan_peak_ratio: float | None = None  # with plan=True: the plan's peak over the captured step's
    plan_grad_error: float | None = None  # its gradients against eager's

    @property
    def counted(self) -> bool:
        """In the denominator: eager PyTorch trains this architecture."""
        return self.status in ("pass", "refused", "wrong")


def architectures(tasks: tuple[str, ...] = tuple(TASKS), with_diffusers: bool = True) -> list[Architecture]:
    """Every architecture of transformers' registries for ``tasks`` (and diffusers' three)."""
    auto = importlib.import_module("transformers.models.auto.modeling_auto")
    unique: dict[tuple[str, str], Architecture] = {}
    for task in tasks:
        for model_type, class_name in getattr(auto, TASKS[task]).items():
            if isinstance(class_name, str):  # several model types may share a class: sweep it once
                unique.setdefault((task, class_name), Architecture(task, model_type, class_name))
    found = list(unique.values())
    if with_diffusers:
        found += [Architecture("diffusion", name, name) for name in DIFFUSERS]
    return found


def shrink(config: Any) -> Any:
    """``config`` with every known size field (and those of its sub-configurations) made small."""
    for key, value in list(vars(config).items()):
        if key.startswith("_"):
            continue
        if hasattr(value, "to_dict") and hasattr(value, "model_type"):
            shrink(value)
        elif key in SMALL_SIZES and isinstance(value, int) and not isinstance(value, bool):
            setattr(config, key, min(value, SMALL_SIZES[key]))
        elif key in ("depths", "num_heads", "hidden_sizes", "embed_dims", "num_attention_heads") and isinstance(
            value, (list, tuple)
        ):
            setattr(config, key, _small_list(key, value))
    if hasattr(config, "num_labels"):
        config.num_labels = LABELS  # a property (id2label's length): not among the fields above
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None)
    if isinstance(heads, int) and isinstance(kv, int) and heads % kv:
        config.num_key_value_heads = heads
    for token, value in (("pad_token_id", 0), ("bos_token_id", 1), ("eos_token_id", 2), ("decoder_start_token_id", 0)):
        if getattr(config, token, None) is None or isinstance(getattr(config, token), int):
            setattr(config, token, value)
    for probability in ("hidden_dropout_prob", "attention_probs_dropout_prob", "dropout", "attention_dropout"):
        if isinstance(getattr(config, probability, None), float):
            setattr(config, probability, min(getattr(config, probability), 0.1))
    return config


def _small_list(key: str, values: list | tuple) -> list:
    stages = min(len(values), 2)
    if key == "depths":
        return [1] * stages
    if key in ("num_heads", "num_attention_heads"):
        return [2] * stages
    return [16 * 2**i for i in range(stages)]


def build(
    arch: Architecture, seed: int = 0, dtype: torch.dtype = torch.float64
) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """The architecture at its small configuration (train mode, seeded) in ``dtype``, and a batch.

    Float64 by default, so that the gradient check sees any real difference from
    eager's and no float32 round-off (summation orders differ between kernels:
    diffusers' U-Net differs from itself by 1e-4 in float32, by 1e-13 in float64).
    """
    model, inputs = _build(arch, seed)
    inputs = tuple(x.to(dtype) if x.is_floating_point() else x for x in inputs)
    return model.to(dtype), inputs


def _build(arch: Architecture, seed: int) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(seed)
    if arch.task == "diffusion":
        return _build_diffusers(arch.class_name)
    hf = transformers_module()
    config = shrink(hf.AutoConfig.for_model(arch.model_type))
    with torch.device("meta"):
        size = sum(p.numel() for p in getattr(hf, arch.class_name)(config).parameters())
    if size > MAX_PARAMETERS:
        raise ValueError(f"the small configuration still has {size:,} parameters")
    model = getattr(hf, arch.class_name)(config).train()
    ids = torch.randint(3, VOCAB, (BATCH, SEQUENCE))
    ids[:, -1] = config.eos_token_id  # sequence classifiers built on T5 pool at the end-of-sequence token
    if arch.task in ("causal-lm", "masked-lm"):
        return HFTask(model, ("input_ids", "labels")), (ids, ids.clone())
    if arch.task == "seq2seq-lm":
        return HFTask(model, ("input_ids", "labels")), (ids, torch.randint(3, VOCAB, (BATCH, TARGET_SEQUENCE)))
    if arch.task == "sequence-classification":
        return HFTask(model, ("input_ids", "labels")), (ids, torch.randint(0, LABELS, (BATCH,)))
    channels = getattr(config, "num_channels", 3)
    size = getattr(config, "image_size", IMAGE)
    size = size[0] if isinstance(size, (list, tuple)) else size
    pixels = torch.randn(BATCH, channels, size, size)
    return HFTask(model, ("pixel_values", "labels")), (pixels, torch.randint(0, LABELS, (BATCH,)))


class _DenoisingLoss(nn.Module):
    """A diffusers model trained as its users do: mean squared error of ``.sample`` to a target."""

    def __init__(self, model: nn.Module, extra: tuple[str, ...]) -> None:
        super().__init__()
        self.model = model
        self.extra = extra

    def forward(self, sample: torch.Tensor, target: torch.Tensor, *extra: torch.Tensor) -> torch.Tensor:
        output = self.model(sample, *extra).sample
        return nn.functional.mse_loss(output, target)


def _build_diffusers(class_name: str) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    diffusers = importlib.import_module("diffusers")
    blocks = {"block_out_channels": (16, 32), "norm_num_groups": 8}
    sample = torch.randn(BATCH, 4, 16, 16)
    if class_name == "UNet2DModel":
        model = diffusers.UNet2DModel(
            sample_size=16, in_channels=4, out_channels=4, layers_per_block=1, attention_head_dim=8,
            down_block_types=("DownBlock2D", "AttnDownBlock2D"), up_block_types=("AttnUpBlock2D", "UpBlock2D"),
            **blocks,
        )  # fmt: skip
        return _DenoisingLoss(model, ("timestep",)).train(), (sample, torch.randn_like(sample), torch.tensor([10]))
    if class_name == "UNet2DConditionModel":
        model = diffusers.UNet2DConditionModel(
            sample_size=16, in_channels=4, out_channels=4, layers_per_block=1, cross_attention_dim=32,
            attention_head_dim=8, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), **blocks,
        )  # fmt: skip
        text = torch.randn(BATCH, 7, 32)
        return _DenoisingLoss(model, ("timestep", "text")).train(), (
            sample,
            torch.randn_like(sample),
            torch.tensor([10]),
            text,
        )
    model = diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, layers_per_block=1,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2, **blocks,
    )  # fmt: skip
    image = torch.randn(BATCH, 3, 16, 16)
    return _DenoisingLoss(model, ()).train(), (image, torch.randn_like(image))


def check(arch: Architecture, seed: int = 0, plan: bool = False) -> Verdict:
    """Build, train eagerly, then capture and run with magis (and, with ``plan``, plan and run
    the plan): one :class:`Verdict`."""
    start = time.perf_counter()
    verdict = Verdict(arch.name, arch.task, "not built")
    for dtype in GRADIENT_TOLERANCE:  # float64 first; float32 where a kernel has no float64
        try:
            model, inputs = build(arch, seed, dtype)
        except Exception as err:  # a configuration the shrinking broke, a missing optional package...
            verdict.status, verdict.cause = "not built", _first_line(err)
            return _timed(verdict, start)
        verdict.parameters, verdict.dtype = sum(p.numel() for p in model.parameters()), str(dtype)
        try:
            torch.manual_seed(seed)
            loss = model(*inputs)
            loss.backward()
            finite = bool(torch.isfinite(loss)) and all(
                bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None
            )
            model.zero_grad(set_to_none=True)
            if not finite:  # nothing to check a capture against (Canine's float64 step)
                raise FloatingPointError("eager's own loss or gradients are not finite")
            verdict.cause = ""
            break
        except Exception as err:
            verdict.status, verdict.cause = "eager fails", _first_line(err)
    else:
        return _timed(verdict, start)
    try:
        planned = _plan(model, inputs) if plan else None
        graph = planned.baseline if isinstance(planned, Plan) else capture(model, inputs)
    except CaptureError as err:
        verdict.status, verdict.cause = "refused", cause_of(str(err))
        return _timed(verdict, start)
    verdict.nodes, verdict.ops = len(graph), sorted({n.op_name for n in graph.nodes if n.target is not None})
    try:
        order = [n.name for n in graph.nodes]
        verdict.simulated_peak_bytes = simulate_memory(graph, order).peak
        measured = measure_against_eager(graph, order, model, inputs, None, seed)
    except Exception as err:  # captured, then an error that names no cause: a failure of magis
        verdict.status, verdict.cause = "wrong", f"{type(err).__name__} after capture: {_first_line(err)}"
        return _timed(verdict, start)
    verdict.max_grad_error = measured["max_grad_error"]
    verdict.missing_gradients = measured["missing_gradients"]
    verdict.extra_gradients = measured["extra_gradients"]
    verdict.measured_peak_bytes = measured["measured_peak_bytes"]
    peak_error = abs(verdict.simulated_peak_bytes - verdict.measured_peak_bytes) / verdict.measured_peak_bytes
    if verdict.missing_gradients or verdict.extra_gradients:
        verdict.status, verdict.cause = "wrong", "gradients for other parameters than eager's"
    elif not verdict.max_grad_error <= GRADIENT_TOLERANCE[dtype]:
        verdict.status, verdict.cause = "wrong", f"gradients differ from eager's by {verdict.max_grad_error:.2g}"
    elif peak_error > PEAK_TOLERANCE:
        verdict.status, verdict.cause = "wrong", f"simulated peak off the measured one by {peak_error:.1%}"
    else:
        verdict.status = "pass"
        if planned is not None:
            _check_plan(verdict, planned, model, inputs, seed, GRADIENT_TOLERANCE[dtype])
    return _timed(verdict, start)


def _plan(model: nn.Module, inputs: tuple) -> Plan | Exception:
    """The plan a user gets (:data:`PLAN_SEARCH`), or why the search failed once the capture
    passed. Not checked by :func:`magis.optimize` against eager (``verify=False``): :func:`check`
    compares its captured step, ``plan.baseline``, itself; a capture error is raised."""
    try:
        return optimize(model, inputs, progress=False, verify=False, **PLAN_SEARCH)
    except CaptureError:
        raise
    except Exception as err:  # the capture passed: whatever fails now is the search's
        return err


def _check_plan(
    verdict: Verdict, planned: Plan | Exception, model: nn.Module, inputs: tuple, seed: int, tolerance: float
) -> None:
    """The plan run beside eager from ``seed`` as ``magis optimize --run`` runs it."""
    try:
        if isinstance(planned, Exception):
            raise planned
        measured = measure_against_eager(
            planned.graph, planned.order, model, inputs, None, seed, runtime=planned.generated
        )
    except Exception as err:  # the capture passed: whatever fails now is the search's or the plan's
        verdict.status, verdict.cause = "wrong", f"plan: {type(err).__name__}: {_first_line(err)}"
        return
    verdict.plan_peak_ratio, verdict.plan_grad_error = planned.report().peak_ratio, measured["max_grad_error"]
    if not verdict.plan_grad_error <= tolerance:  # infinite where the parameters with a gradient differ
        verdict.status = "wrong"
        verdict.cause = (
            f"plan: gradients differ from eager's by {verdict.plan_grad_error:.2g} "
            f"(missing {measured['missing_gradients']}, extra {measured['extra_gradients']})"
        )


def choose_sample(verdicts: list[Verdict], size: int) -> list[str]:
    """Greedy maximum coverage: ``size`` architectures whose captured steps hold the most distinct
    operators together (each pick adds the most operators not yet held; ties: fewer nodes)."""
    captured = [v for v in verdicts if v.ops]
    held: set[str] = set()
    chosen: list[str] = []
    while captured and len(chosen) < size:
        best = max(captured, key=lambda v: (len(set(v.ops) - held), -(v.nodes or 0)))
        if not set(best.ops) - held:
            break
        chosen.append(best.architecture)
        held |= set(best.ops)
        captured.remove(best)
    return chosen


def cause_of(message: str) -> str:
    """A capture error's cause without the instance details (shapes, node names), to group by."""
    cause = re.sub(r"\(node [^)]*\)", "", message.splitlines()[0])
    cause = re.sub(r"size=\([^)]*\)|\[[^\]]*\]|\d+", "#", cause)
    return cause[:160].strip()


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:200]


def _timed(verdict: Verdict, start: float) -> Verdict:
    verdict.seconds = time.perf_counter() - start
    return verdict


@dataclass
class Summary:
    """Counts over a sweep, and the causes of the refusals and failures."""

    verdicts: list[Verdict]

    def count(self, status: str) -> int:
        return sum(v.status == status for v in self.verdicts)

    @property
    def counted(self) -> int:
        return sum(v.counted for v in self.verdicts)

    @property
    def pass_rate(self) -> float:
        return self.count("pass") / self.counted if self.counted else 0.0

    def causes(self, status: str) -> dict[str, list[str]]:
        grouped: dict[str, list[str]] = {}
        for v in self.verdicts:
            if v.status == status:
                grouped.setdefault(v.cause, []).append(v.architecture)
        return dict(sorted(grouped.items(), key=lambda kv: -len(kv[1])))

    def to_json(self) -> dict[str, Any]:
        return {
            "architectures": len(self.verdicts),
            "counted": self.counted,
            "pass": self.count("pass"),
            "refused": self.count("refused"),
            "wrong": self.count("wrong"),
            "eager_fails": self.count("eager fails"),
            "not_built": self.count("not built"),
            "timed_out": self.count("timed out"),
            "pass_rate": self.pass_rate,
            "refused_causes": self.causes("refused"),
            "wrong_causes": self.causes("wrong"),
            "eager_fails_causes": self.causes("eager fails"),
            "not_built_causes": self.causes("not built"),
            "verdicts": [asdict(v) for v in self.verdicts],
        }

    def markdown(self) -> str:
        """The table a person reads: counts, causes grouped, one line per architecture."""
        lines = [
            "# magis coverage",
            "",
            f"{self.counted} architectures eager PyTorch trains on CPU (of {len(self.verdicts)} swept): "
            f"**{self.count('pass')} pass** ({self.pass_rate:.1%}), {self.count('refused')} refused with a "
            f"named cause, **{self.count('wrong')} wrong**. Not counted: {self.count('eager fails')} eager "
            f"fails, {self.count('not built')} not built from a small configuration, "
            f"{self.count('timed out')} timed out.",
        ]
        for status in ("wrong", "refused", "timed out", "eager fails", "not built"):
            causes = self.causes(status)
            if not causes:
                continue
            lines += ["", f"## {status}: causes", "", "| cause | count | architectures |", "|---|---|---|"]
            lines += [f"| {_cell(c)} | {len(a)} | {_cell(', '.join(a))} |" for c, a in causes.items()]
        lines += [
            "",
            "## every architecture",
            "",
            "| architecture | status | nodes | max grad error | simulated / measured peak "
            "| plan: peak ratio, grad error | cause |",
            "|---|---|---|---|---|---|---|",
        ]
        for v in self.verdicts:
            peak = f"{v.simulated_peak_bytes} / {v.measured_peak_bytes}" if v.measured_peak_bytes else ""
            error = f"{v.max_grad_error:.1e}" if v.max_grad_error is not None else ""
            plan = f"{v.plan_peak_ratio:.3f}, {v.plan_grad_error:.1e}" if v.plan_grad_error is not None else ""
            lines.append(
                f"| {v.architecture} | {v.status} | {v.nodes or ''} | {error} | {peak} | {plan} | {_cell(v.cause)} |"
            )
        return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")
