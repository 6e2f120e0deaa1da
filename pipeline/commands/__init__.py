"""One module per ``deepdpm`` subcommand (see :mod:`pipeline.cli`)."""
