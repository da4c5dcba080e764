"""`gpuwatch bench`: overhead and latency of gpuwatch measured side by side with the NVML floor and with peers.

One module per measurement (sampling, serving, footprint, detection, remediation, trainer, recovery; the
interference package: what a monitor costs the training job beside it), each a `run(ctx) -> Section`;
`recovery_in_place` and `recovery_spare` are the recovery section's jobs (their workloads live in
gpuwatch.examples); `snapshot_cost` is a measurement run by hand on a GPU machine
(`python -m gpuwatch.bench.snapshot_cost`). The machinery
around them: `daemons`, the daemons and peers the bench starts (on gpuwatch.testing's processes, which
the tests use too), `stats` the statistics, `harness` the run's context and keep-alive HTTP, `report`
the table and the JSON, `cli` the click command. README.md says what each section measures. Nothing
here changes a GPU or a node's state: every daemon it starts has its own temp state and runtime dirs,
and only the remediation measurement lets a daemon quarantine a GPU (the bench trainer's own).
"""
