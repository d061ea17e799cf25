"""Executors of one forward step behind the `Decoder` protocol (`base.py`), found by name in
`registry.py`; this package stays import-light for the CLI."""
from slipstream.runtime.registry import RUNTIMES

__all__ = ["RUNTIMES"]
