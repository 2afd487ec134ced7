"""`python -m stratagem.launch.harness`: the harness's command line (one plan, one JSON result).

It ends through `run.cli`, which leaves the process with os._exit after flushing: interpreter teardown with
gloo threads alive can abort after the result was written (run.cli says why)."""

from stratagem.launch.harness.cli import cli

if __name__ == "__main__":
    cli()
