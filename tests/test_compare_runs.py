"""examples/compare_runs.py, which runs the framework comparisons (Lightning's,
accelerate's, transformers'): a run that hangs is stopped whole at its timeout,
torchrun's ranks included."""
import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import compare_runs  # noqa: E402

# A rank that says where it is, then hangs (a torch DDP run hung so at exit).
HANGING_RANK = """
import os, sys, time
path = os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.pid")
open(path + ".tmp", "w").write(str(os.getpid()))
os.replace(path + ".tmp", path)  # whole or absent
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc (Linux)")
def test_a_hung_torchrun_is_stopped_with_its_ranks_at_the_timeout(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(HANGING_RANK)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", "2", str(script), str(tmp_path)]
    started = time.monotonic()
    with pytest.raises(SystemExit, match="failed 1 times"):
        compare_runs.run(command, tries=1, timeout_s=20)
    assert time.monotonic() - started < 60
    files = [tmp_path / f"rank{r}.pid" for r in range(2)]
    assert all(f.exists() for f in files), "the ranks had not started within the timeout"
    pids = [int(f.read_text()) for f in files]
    deadline = time.monotonic() + 10  # (SIGKILL is delivered, not waited for)
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    survivors = [p for p in pids if _alive(p)]
    for pid in survivors:  # (not left behind by a failing run of the test)
        subprocess.run(["kill", "-9", str(pid)], check=False)
    assert survivors == []
