"""The methods a benchmark compares, as a registry: magis and its peers, one code path for all.

Every method gives, for a workload at a preset (a :class:`Subject`), two things:

- ``real(subject, budget)``: a :class:`Runnable`, a
  :data:`~yardstick.protocol.Step` that runs one training step for real and
  returns the loss and the gradients (checked against eager PyTorch's by
  :mod:`yardstick.compare`), and the model whose weights it uses;
- ``simulate(subject, budget)``: the graph and operator order the method would run,
  for magis' simulator (peak memory) and cost model (latency).

Measured and simulated figures of one method therefore come from the same
configuration of it, and at tiny/small sizes they can be checked against each
other. Adding a method is one :func:`register` call. A ``budgeted`` method runs
once per memory budget (``compile@0.5``).

The package:

- :mod:`~yardstick.methods.method_registry` — :class:`Method`, :class:`Variant`, :data:`METHODS`,
  :func:`register`, :func:`variants` (the rows of a comparison) and :class:`MethodUnavailable`;
- :mod:`~yardstick.methods.subject` — :class:`Subject`, the workload every method works on;
- :mod:`~yardstick.methods.steps` — the eager, magis-runtime and traced steps the families build on;
- one module per family, each registering its methods, imported below in :data:`METHODS`' order:

  - :mod:`~yardstick.methods.eager_peer` — ``eager``, plain PyTorch: the reference;
  - :mod:`~yardstick.methods.checkpoint_peers` — ``checkpoint-block`` and ``checkpoint-sqrt``,
    activation checkpointing of every block or of √n segments of blocks (Chen et al. 2016);
  - :mod:`~yardstick.methods.compile_peer` — ``compile``, ``torch.compile``'s min-cut partitioner
    under an activation memory budget, its graphs run eagerly; ``inductor`` (opt-in), the same
    compiled by Inductor as users run ``torch.compile``: timed, its peak its allocator's;
  - :mod:`~yardstick.methods.accumulate_peers` — ``accumulate`` over k micro-batches, alone or
    stacked on ``checkpoint-block`` or ``compile``;
  - :mod:`~yardstick.methods.checkmate_dtr_peers` — ``checkmate`` (MILP, HiGHS) and ``dtr``, the
    rematerialization baselines planned on the captured step;
  - :mod:`~yardstick.methods.rockmate_peer` — ``rockmate``, opt-in and measured only (rockmate, CUDA);
  - :mod:`~yardstick.methods.magis_methods` — ``magis-captured``, ``magis-scheduled``,
    ``magis-fission``, ``magis-optimize`` and ``magis-optimize-lat``;
  - :mod:`~yardstick.methods.full_step` — the full steps, each with AdamW's update (opt-in):
    ``eager+step`` (their reference), ``eager+step-in-backward``, ``accumulate+step``,
    ``checkpoint-block+step``, ``compile+step`` and ``magis-optimize-lat+step``.

Peers (what a practitioner reaches for today) have kind :data:`PEER`, magis' own methods :data:`MAGIS`.
"""

from __future__ import annotations

from yardstick.methods.method_registry import (
    ACCUMULATE,
    DEFAULT_BUDGETS,
    DEFAULT_DEVICE,
    FULL_STEP_REFERENCE,
    LATENCY_LIMITS,
    MAGIS,
    METHODS,
    PEER,
    REFERENCE,
    Method,
    MethodUnavailable,
    Runnable,
    Simulated,
    Variant,
    register,
    variants,
)
from yardstick.methods.subject import Subject

# Each family registers its methods when imported: this order is METHODS' order, the rows' order.
# isort: off
from yardstick.methods import eager_peer, checkpoint_peers, compile_peer, accumulate_peers
from yardstick.methods import checkmate_dtr_peers, rockmate_peer, magis_methods, full_step

# isort: on

__all__ = [
    "ACCUMULATE",
    "DEFAULT_BUDGETS",
    "DEFAULT_DEVICE",
    "FULL_STEP_REFERENCE",
    "LATENCY_LIMITS",
    "MAGIS",
    "METHODS",
    "PEER",
    "REFERENCE",
    "Method",
    "MethodUnavailable",
    "Runnable",
    "Simulated",
    "Subject",
    "Variant",
    "accumulate_peers",
    "checkmate_dtr_peers",
    "checkpoint_peers",
    "compile_peer",
    "eager_peer",
    "full_step",
    "magis_methods",
    "register",
    "rockmate_peer",
    "variants",
]
