"""`bench/gc_probe` on `PYTHONPATH` makes a real process report its collections."""

import os
import subprocess
import sys
from pathlib import Path

PROBE = Path(__file__).resolve().parents[2] / "bench" / "gc_probe"


def test_a_process_reports_its_collections_without_importing_the_checkout(
    tmp_path: Path,
) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(PROBE), os.environ.get("PYTHONPATH", "")]),
        "GC_PROBE_DIR": str(tmp_path),
        "GC_PROBE_AFTER_S": "0",
    }
    subprocess.run(
        [sys.executable, "-c", "import gc\nfor _ in range(3): gc.collect()"],
        env=env,
        check=True,
        timeout=60,
    )
    (report,) = tmp_path.glob("*.txt")
    assert "gen2 3 in" in report.read_text()


def test_without_a_directory_nothing_is_timed(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(PROBE), "GC_PROBE_AFTER_S": "0"}
    env.pop("GC_PROBE_DIR", None)
    probe = "import gc, sys\nsys.exit(len(gc.callbacks))"
    finished = subprocess.run(
        [sys.executable, "-c", probe], env=env, check=False, cwd=tmp_path, timeout=60
    )
    assert finished.returncode == 0
