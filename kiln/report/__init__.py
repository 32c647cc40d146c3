"""Compile traces and their HTML report (`KILN_TRACE_DIR`, `kiln report`)."""

from kiln.report.html import build_report  # noqa: F401
from kiln.report.trace import trace_dir  # noqa: F401
