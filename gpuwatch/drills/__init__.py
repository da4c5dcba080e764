"""Fault-injection drills: inject a fault, then prove that detection, the alert metric, quarantine,
the trainers' checkpoint and the job's resume all follow, each within its deadline.

`gpuwatch.drills.service.DrillService` is the daemon's part (routes, metrics, scheduled runs), built by
gpuwatch.daemon; `gpuwatch.drills.cli.drill` is the `gpuwatch drill` command.
"""
