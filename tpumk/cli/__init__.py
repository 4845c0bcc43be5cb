"""The `tpumk` command line: a thin Click shell over the library (one module per command group)."""

from tpumk.cli.app import main

__all__ = ["main"]
