"""The `stratagem` command line (typer + rich): one module per command group, each only parsing, calling the
library and rendering. Importing this package registers every command on `app`."""

from stratagem.cli import calibrate, clean, compare, explain, export, report, search, status, trace  # noqa: F401  (registers the commands)
from stratagem.cli.app import app, main

__all__ = ["app", "main"]
