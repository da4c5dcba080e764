"""The fleet and scheduler side: the fleet-wide breaker over Prometheus, and the Slurm drain."""
