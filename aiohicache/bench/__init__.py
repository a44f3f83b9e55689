"""Benchmarks (never timed tests): run them with ``aiohicache bench ...``."""

from .core import FULL, QUICK, CoreReport, CoreSizes, format_report, run_core

__all__ = ("FULL", "QUICK", "CoreReport", "CoreSizes", "format_report", "run_core")
