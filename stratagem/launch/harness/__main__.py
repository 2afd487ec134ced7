"""`python -m stratagem.launch.harness`: the harness's command line (one plan, one JSON result)."""

from stratagem.launch.harness.run import main

if __name__ == "__main__":
    raise SystemExit(main())
