"""One module per ``rankscope`` subcommand (see ``rankscope.cli``)."""
