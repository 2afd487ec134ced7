"""The regret benchmark's parts (bench/search_regret.py is its command): instances and truth (instances.py),
out-of-sample calibrations (folds.py), methods (methods.py, procedures.py), replay (replay.py), figures
(scoring.py) and what is printed, written and generated into the README (report.py)."""

__all__ = ["folds", "instances", "methods", "procedures", "replay", "report", "scoring"]
