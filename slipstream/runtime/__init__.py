"""Executors of one forward step (see `select.py`); this module stays import-light for the CLI."""

RUNTIMES = ("auto", "eager", "native", "graph", "megakernel")
