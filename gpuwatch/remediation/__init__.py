"""Remediation: stopping jobs whose GPU is taken or whose rank died or hung, and the incidents they leave.

* service.py: `Remediation`, the monitor listener and its one thread;
* stopping.py: one job's stop signal → SIGTERM → SIGKILL escalation;
* exits.py: learning at once that a rank's process ended (pidfd);
* judging.py: the trainers' timelines and jobs' progress, judged by gpuwatch.health.trainer_rules;
* incidents.py: the incident record, stored in SQLite.

Its HTTP routes are in gpuwatch.serving.remediation_api, its metrics in gpuwatch.serving.remediation_metrics.
"""

from gpuwatch.remediation.service import Remediation, parse_signal

__all__ = ["Remediation", "parse_signal"]
