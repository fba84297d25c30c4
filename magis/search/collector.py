"""Python's cyclic garbage collector, paused while a search runs.

A search at paper size keeps thousands of graphs alive, each of thousands of nodes,
and makes millions of small objects per minute. Every collection of the oldest
generation walks all of them: measured on GPT-Neo and BTLM at paper size, a third of
a 60 s search went to the collector. The search makes no reference cycles that
matter (its graphs, nodes and states are trees of immutable objects, freed by
reference counting), so the collector is paused for its duration, and afterwards
restored as it was, with one collection for whatever cycles did form.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused() -> Iterator[None]:
    """Run the body with the cyclic collector off; restore it (and collect once) after,
    unless it was already off (a search inside a search: the outer one restores it)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.collect()
