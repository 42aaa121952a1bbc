"""One module per area; each adds its subcommands with ``register``."""
