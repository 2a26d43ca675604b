"""Imported at start-up by every Python process with this directory on `PYTHONPATH`: see
`bench/gc_time.py`, loaded here by its path so that the probe imports nothing of the
checkout under measurement (importing `bench` here would decide which checkout runs)."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("_gc_time", Path(__file__).parents[1] / "gc_time.py")
if _spec is not None and _spec.loader is not None:
    _gc_time = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_gc_time)
    _gc_time.install()
