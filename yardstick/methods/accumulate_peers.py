"""``accumulate`` and the combinations a practitioner stacks on it: gradient accumulation over k
micro-batches (``accumulate@4``), alone, every block checkpointed (``accumulate@4+checkpoint-block``)
or compiled (``accumulate@4+compile@0.5``).

One variant per divisor k > 1 of the batch (:attr:`~yardstick.methods.method_registry.Method.micro_batched`):
each runs the peer it stacks on over the subject's micro-batches
(:meth:`~yardstick.methods.subject.Subject.accumulating`, :mod:`yardstick.peers.accumulation`). Where that
is not the full batch's gradient (batch norm, dropout, masked labels) the row's ``gradient_note`` says why.
"""

from __future__ import annotations

from typing import Any

from yardstick.methods.checkpoint_peers import CHECKPOINT_BLOCK
from yardstick.methods.compile_peer import compile_real, compile_simulate
from yardstick.methods.eager_peer import eager_real, eager_simulate
from yardstick.methods.method_registry import ACCUMULATE, PEER, Method, register
from yardstick.methods.subject import Subject
from yardstick.peers.accumulation import gradient_differences


def micro_batch_details(subject: Subject, _budget: float | None) -> dict[str, Any]:
    """A micro-batched variant's row facts: the micro-batch count and size, and why its gradients differ, if they do."""
    note = gradient_differences(subject.graph, subject.inputs, subject.micro_batches)
    return {"micro_batches": subject.micro_batches, "micro_batch": subject.batch_size // subject.micro_batches} | (
        {"gradient_note": note} if note else {}
    )


register(
    Method(
        ACCUMULATE,
        "gradient accumulation: k micro-batches of batch/k, each loss x 1/k, gradients summed in .grad",
        PEER,
        eager_real,
        eager_simulate,
        micro_batched=True,
        details=micro_batch_details,
    )
)
register(
    Method(
        f"{ACCUMULATE}+checkpoint-block",
        "gradient accumulation over k micro-batches, every block checkpointed",
        PEER,
        *CHECKPOINT_BLOCK,
        micro_batched=True,
        details=micro_batch_details,
    )
)
register(
    Method(
        f"{ACCUMULATE}+compile",
        "gradient accumulation over k micro-batches of torch.compile under activation_memory_budget",
        PEER,
        compile_real,
        compile_simulate,
        budgeted=True,
        micro_batched=True,
        details=micro_batch_details,
    )
)
