"""One module per CLI sub-command: ``add_arguments(parser)`` and ``run(args) -> int``."""
