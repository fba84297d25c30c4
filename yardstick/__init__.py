"""The yardstick: an instrument beside the magis library that measures magis against its peers.

magis never imports it; ``magis bench`` is its command (:mod:`yardstick.command`), and it is
installed with the ``bench`` extra (``pip install -e ".[bench]"``: highspy, numpy, matplotlib,
transformers, diffusers). It holds:

- :mod:`yardstick.methods` — the methods a comparison runs, as a registry: magis' own and its peers;
- :mod:`yardstick.peers` — the peers themselves: activation checkpointing, ``torch.compile``'s
  partitioner, gradient accumulation, Rockmate, and the captures that turn each into a magis graph;
- :mod:`yardstick.planners` — the rematerialization baselines planned on a captured step:
  Checkmate's MILP and DTR's eviction policy;
- :mod:`yardstick.protocol` — how a step's peak memory and latency are measured;
- :mod:`yardstick.compare` and :mod:`yardstick.plot` — a comparison of methods on one workload,
  as ratios to eager PyTorch, and its memory-latency plane;
- :mod:`yardstick.coverage` — which models magis captures and trains exactly, over the model zoo.
"""
