"""The development servers started with `--exit-with-parent` (the MongoDB stand-in and the
fake model, as the benchmark and the fault tests start them) stop once their starter is killed
without stopping them, instead of lingering and loading the machine for later runs."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from tests.support import eventually

# The parent starts the server, passes on its pid and announced URL, then waits to be killed.
PARENT = """
import subprocess, sys
child = subprocess.Popen(sys.argv[1:], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
line = child.stdout.readline().decode()
print(child.pid, line.strip(), flush=True)
sys.stdin.read()
"""


def _alive(pid: int) -> bool:
    """Running: it exists and is not a zombie waiting for a reaper."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.parametrize(
    "server",
    [
        ["-m", "devtools.mongo_standin", "--port", "0"],
        ["-m", "devtools.fake_llm", "--port", "0"],
    ],
    ids=["mongo_standin", "fake_llm"],
)
async def test_a_server_stops_once_its_starter_is_killed(server: list[str]) -> None:
    parent = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        PARENT,
        sys.executable,
        *server,
        "--exit-with-parent",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert parent.stdout is not None
        async with asyncio.timeout(30):
            line = await parent.stdout.readline()
        pid_text, announced = line.decode().split(" ", 1)
        child_pid = int(pid_text)
        assert json.loads(announced)["url"]
        assert _alive(child_pid)
        parent.kill()  # SIGKILL: the parent cannot stop its child
        await parent.wait()

        async def gone() -> bool:
            return not _alive(child_pid)

        # A bound, not a timing claim: the whole suite loads both cores meanwhile.
        await eventually(gone, timeout_s=60, what=f"{server[1]} stopping after its parent died")
    finally:
        if parent.returncode is None:
            parent.kill()
            await parent.wait()
