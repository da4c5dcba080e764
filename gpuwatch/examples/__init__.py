"""Applications of the library: what a job imports, shown whole.

`trainer` is the example DDP trainer; `bench_worker`, `sharded_worker`, `fsdp_worker` and
`recovery_job` are the workloads the tests, the GPU scripts and the bench run (in place, sharded,
FSDP2, the recovery bench's job). Each writes its step log through `steplog`.
"""
