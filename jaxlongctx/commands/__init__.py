"""Subcommands of the `jaxlongctx` command line whose runners do more than call the library: they load
models by path, read and write files and print summaries. `jaxlongctx.cli` parses and dispatches."""
