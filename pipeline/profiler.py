"""``--profile``: record each process with py-spy and keep one flame graph per process."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys


class Profiler:
    """Runs ``py-spy record`` on processes; each one's flame graph is ``<out_dir>/<name>.svg``.

    py-spy writes a flame graph when the process it samples exits, so ``finish`` is called once those processes have
    stopped.

    Args:
        out_dir: where the flame graphs land (created by ``start``).
    """

    def __init__(self, out_dir: str):
        self.out_dir = out_dir
        self._recorders: list[subprocess.Popen] = []

    def start(self, pids: dict[str, int]) -> None:
        """Start recording each process (name -> pid); without py-spy, say so and record nothing."""
        os.makedirs(self.out_dir, exist_ok=True)
        exe = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
        for name, pid in pids.items():
            out = os.path.join(self.out_dir, f"{name}.svg")
            try:
                self._recorders.append(
                    subprocess.Popen(
                        [
                            exe,
                            "record",
                            "--pid",
                            str(pid),
                            "--output",
                            out,
                            "--format",
                            "flamegraph",
                            "--rate",
                            "200",
                            "--nonblocking",
                        ],
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.PIPE,
                    )
                )
            except FileNotFoundError:
                print("pipeline: --profile needs py-spy (`pip install py-spy`); not profiling", file=sys.stderr)
                return

    def finish(self) -> None:
        """Wait for every recorder to write its flame graph (interrupting one that hangs); report failures."""
        for rec in self._recorders:
            try:
                rec.wait(60)
            except subprocess.TimeoutExpired:
                rec.send_signal(signal.SIGINT)
                rec.wait(30)
            if rec.returncode:
                print(f"pipeline: py-spy failed: {rec.stderr.read().decode(errors='replace')[-500:]}", file=sys.stderr)
        if self._recorders:
            print(f"pipeline: flame graphs in {self.out_dir}", file=sys.stderr)
