"""`python -m gpuwatch` runs the CLI."""

from gpuwatch.cli import main

main()
