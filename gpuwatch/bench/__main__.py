"""`python -m gpuwatch.bench` runs the bench, also where `gpuwatch bench` is not wired into the CLI."""

from gpuwatch.bench.cli import bench

bench(prog_name="gpuwatch bench")
