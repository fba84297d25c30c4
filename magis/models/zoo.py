"""Every built-in workload: MAGIS' seven (:mod:`magis.models.workloads`) and, as they join, the
workloads its seed systems were evaluated on (Echo's NMT, MONeT's convolutional networks,
Serenity's irregularly wired networks)."""

from __future__ import annotations

from magis.models.convnets import CONVNET_WORKLOADS
from magis.models.irregular import IRREGULAR_WORKLOADS
from magis.models.nmt import NMT_WORKLOADS
from magis.models.workloads import WORKLOADS, Built, Workload, fake_if

ZOO: dict[str, Workload] = {
    **WORKLOADS,
    **{w.name: w for w in CONVNET_WORKLOADS},
    **{w.name: w for w in NMT_WORKLOADS},
    **{w.name: w for w in IRREGULAR_WORKLOADS},
}


def get_workload(name: str) -> Workload:
    """The workload called ``name``; a ValueError lists the valid names otherwise."""
    try:
        return ZOO[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}: choose one of {', '.join(ZOO)}") from None


def build_workload(name: str, preset: str, batch: int | None, seed: int = 0) -> Built:
    """The workload ``name`` built at ``preset``: real tensors for tiny and small, fake ones for paper."""
    workload = get_workload(name)
    with fake_if(preset == "paper"):
        return workload.build(preset, batch=batch, seed=seed)
