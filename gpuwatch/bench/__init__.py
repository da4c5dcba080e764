"""`gpuwatch bench`: overhead and latency of gpuwatch measured side by side with the NVML floor and with peers.

One module per measurement (sampling, serving, footprint, detection, remediation, trainer; the
interference package: what a monitor costs the training job beside it), each a `run(ctx) -> Section`;
`harness` holds what they share (the daemons, HTTP, statistics), `daemon_process` a daemon as a
subprocess (the tests start theirs with it too), `report` the table and the JSON, `cli` the click
command. Nothing here changes a GPU or a node's state: every daemon it
starts has its own temp state and runtime dirs, and only the remediation measurement lets a daemon
quarantine a GPU (the bench trainer's own).
"""
