"""Importing the package must not start CUDA.

torch.cuda.is_available() (and device_count()) starts the CUDA driver in the
process that asks. A launcher that imports fgpsdp_runtime and then forks its
ranks (multiprocessing's fork or forkserver, whose server imports the package
once) would hand every rank a driver it cannot use: their first CUDA call fails
with "CUDA error: initialization error". Seen on a GPU machine in
tests/test_bad_input.py, whose ranks come from a forkserver; checked here on
any machine by recording the calls that would start the driver.
"""
import os
import subprocess
import sys
import textwrap

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_PROBE = textwrap.dedent("""
    import pkgutil, importlib, torch
    calls = []
    def record(name, real):
        def wrapped(*args, **kwargs):
            calls.append(name)
            return real(*args, **kwargs)
        return wrapped
    for owner, name in [(torch.cuda, "is_available"), (torch.cuda, "device_count"),
                        (torch.cuda, "init"), (torch.cuda, "_lazy_init"),
                        (torch._C, "_cuda_getDeviceCount"), (torch._C, "_cuda_init")]:
        if hasattr(owner, name):  # a CPU build of torch has no torch._C._cuda_*
            setattr(owner, name, record(name, getattr(owner, name)))
    import fgpsdp_runtime
    for m in pkgutil.iter_modules(fgpsdp_runtime.__path__):
        importlib.import_module("fgpsdp_runtime." + m.name)
    from fgpsdp_runtime.profiling import nvtx_range
    with nvtx_range("outside CUDA"):
        pass
    print("CALLS", sorted(set(calls)), torch.cuda.is_initialized())
""")


def test_importing_every_module_starts_no_cuda():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([_ROOT, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", _PROBE], cwd=_ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    line = [l for l in done.stdout.splitlines() if l.startswith("CALLS ")][-1]
    assert line == "CALLS [] False", line
