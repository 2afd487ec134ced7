"""`python -m stratagem.cli ...`."""

from stratagem.cli import main

main()
