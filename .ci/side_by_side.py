"""Run shell commands side by side; print each one's output whole when it ends.

Usage: python .ci/side_by_side.py "command 1" "command 2" ...

CI's framework checks (Lightning's Trainer, Fabric, Accelerate against their torch
DDP) each start a few ranks that leave CI's two cores idle part of the time: side by
side they end sooner than one after another. The outputs are not interleaved, so a
failure reads as it would alone. Exits 1 if any command failed, after all have ended.
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
import time


def main(commands: list[str]) -> int:
    if not commands:
        print(__doc__, file=sys.stderr)
        return 2
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        runs = []
        for i, command in enumerate(commands):
            # (Read back with undecodable bytes replaced: a stray byte of a command's
            # output must not stop this script while the others still run.)
            log = open(f"{tmp}/{i}.log", "w+", errors="replace")
            runs.append((command, log, subprocess.Popen(command, shell=True, stdout=log,
                                                        stderr=subprocess.STDOUT)))
        pending = list(runs)
        failed = []
        while pending:
            for run in list(pending):
                command, log, process = run
                if process.poll() is None:
                    continue
                pending.remove(run)
                log.seek(0)
                print(f"== {command}", flush=True)
                sys.stdout.write(log.read())
                print(f"== exit code {process.returncode} after "
                      f"{time.monotonic() - started:.0f} s: {command}", flush=True)
                log.close()
                if process.returncode != 0:
                    failed.append(command)
            time.sleep(0.5)
    for command in failed:
        print(f"== FAILED: {command}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
