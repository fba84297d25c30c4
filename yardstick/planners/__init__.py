"""The rematerialization baselines, planned on a captured step: the problem both see
(:mod:`~yardstick.planners.recompute_problem`), Checkmate's MILP (:mod:`~yardstick.planners.checkmate`)
and DTR's eviction policy (:mod:`~yardstick.planners.dtr`)."""
