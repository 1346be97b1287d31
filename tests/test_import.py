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
import shutil
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


_UNBUILT_PROBE = textwrap.dedent("""
    import sys, warnings, torch
    # An editable install's finder maps fgpsdp_runtime._C to the checkout's build
    # from anywhere: stop it, as a copy of the package without one would.
    sys.modules["fgpsdp_runtime._C"] = None
    from fgpsdp_runtime import ops
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ops._compiled_for(torch.device("cpu"))
    print("AVAILABLE", ops.extension_available())
    print("WARNED", [str(w.message) for w in seen])
""")


def test_a_checkout_without_the_built_extension_says_so(tmp_path):
    """Before, the fallback's warning quoted Python's "cannot import name '_C' from
    partially initialized module (most likely due to a circular import)"."""
    copy = tmp_path / "fgpsdp_runtime"
    shutil.copytree(os.path.join(_ROOT, "fgpsdp_runtime"), copy,
                    ignore=shutil.ignore_patterns("_C*", "__pycache__"))
    out = subprocess.run([sys.executable, "-c", _UNBUILT_PROBE], cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(tmp_path)},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "AVAILABLE False" in out.stdout, out.stdout
    assert "fgpsdp_runtime._C is not built for this Python (run `make setup`" in out.stdout, \
        out.stdout
