"""Trainer reports: the socket ranks report to, and what the daemon holds of each rank (gpuwatch.trainer.contract)."""

from gpuwatch.reports.board import Report, ReportBoard
from gpuwatch.reports.parse import ReportError, parse_report
from gpuwatch.reports.server import ReportServer

__all__ = ["Report", "ReportBoard", "ReportError", "ReportServer", "parse_report"]
