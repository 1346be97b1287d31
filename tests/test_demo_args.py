"""examples/demo.py with other arguments than `make demo`'s: --help, one step (its
summary once read an empty list of timed steps), world sizes 1 and 3, --steps 0."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "examples", "demo.py")


def _run(*args, timeout=240):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, DEMO, *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_demo_help():
    out = _run("--help", timeout=60)
    assert out.returncode == 0 and "--world-size" in out.stdout


@pytest.mark.parametrize("world_size,steps", [(1, 2), (2, 1), (3, 2)])
def test_demo_small_runs(world_size, steps):
    out = _run("--world-size", str(world_size), "--steps", str(steps), "--layers", "1",
               "--width", "32")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "largest |parameter difference| to DDP" in out.stdout


def test_demo_refuses_zero_steps():
    out = _run("--steps", "0", timeout=60)
    assert out.returncode == 2 and "--steps must be at least 1" in out.stderr
