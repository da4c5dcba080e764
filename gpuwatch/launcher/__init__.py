"""The parts of `gpuwatch launch` around torchrun: which runtime dir the ranks get, whether the job's script is
there, the watch that moves a job off a quarantined GPU by itself, and torchrun's output (a log file, one line
per failed rank). gpuwatch.launcher.launch runs the loop; each module here does one of those jobs."""
