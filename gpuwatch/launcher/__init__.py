"""`gpuwatch launch`, both modes: a job through torchrun (launch), or its workers run here and recovered
in place (in_place). What they share: the GPUs the daemon calls usable (daemon_gpus), the runtime dir the
ranks get (daemon_dir) and the check that the job's script is there (job_check). torchrun mode's own parts:
the watch that moves a job off a quarantined GPU by itself (gpu_watch) and torchrun's output, a log file and
one line per failed rank (torchrun_output). In-place mode keeps the spares (gpuwatch.spares) it is given.
"""
