"""The deploy tests render the chart with the chart tests' helm runner (tests/helm/test_helm_chart.py)."""

import sys
from pathlib import Path

HELM_TESTS = str(Path(__file__).resolve().parents[1] / "helm")
if HELM_TESTS not in sys.path:
    sys.path.insert(0, HELM_TESTS)
