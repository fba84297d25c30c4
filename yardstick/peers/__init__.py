"""The peers magis is compared with, as practitioners run them, and how each becomes a magis graph for
the simulator: activation checkpointing (:mod:`~yardstick.peers.checkpointing`, captured by
:mod:`~yardstick.peers.checkpointed_capture`), ``torch.compile``'s min-cut partitioner
(:mod:`~yardstick.peers.partitioned_capture`), gradient accumulation (:mod:`~yardstick.peers.accumulation`)
and Rockmate, measured only (:mod:`~yardstick.peers.rockmate`)."""
