"""tests/ on sys.path: the backend tests import the shared helpers (test_native_common)."""

import sys
from pathlib import Path

TESTS = str(Path(__file__).resolve().parents[1])
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)
