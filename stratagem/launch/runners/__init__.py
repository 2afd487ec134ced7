"""Runners: where a plan's harness runs. `local` (N gloo ranks in this host's processes), `ray_runner` (a
placement group on a Ray cluster), `real` (the real-run evaluator the search receives), `calibrate` (a
prepared set of runs on this node, fitted), `sweep` and `tabulate` (every plan of a small grid, for benches).
Import names from their modules (the package re-exports nothing): importing it imports no torch or ray.
"""
