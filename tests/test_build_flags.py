"""setup.py's link flags against a compiler that links libstdc++ statically.

A second, static C++ runtime inside an extension, in a process where torch has
loaded the shared one, writes numbers into streams wrongly: on an H200 image whose
compiler did that, the first TORCH_CHECK message with a number in it crashed the
process; on Debian's g++ 12 the message is cut short. A small library stands in for
the extension (no torch headers: it builds in a second), loaded after torch.
"""
import ast
import os
import shutil
import subprocess
import sys

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SOURCE = r"""
#include <cstring>
#include <sstream>
extern "C" void describe(char* out) {
  std::ostringstream s;
  s << "tensor " << 3L << " is not contiguous";
  std::strcpy(out, s.str().c_str());
}
"""

_LOAD = """
import ctypes, sys
import torch  # loads the shared libstdc++ first, as in a training process
lib = ctypes.CDLL(sys.argv[1])
out = ctypes.create_string_buffer(256)
lib.describe(out)
print(out.value.decode())
"""


def _hide_static_libs_flag() -> str:
    tree = ast.parse(open(os.path.join(_ROOT, "setup.py")).read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                getattr(t, "id", None) == "HIDE_STATIC_LIBS" for t in node.targets):
            return node.value.value
    raise AssertionError("setup.py defines no HIDE_STATIC_LIBS")


def _static_libstdcxx_available(cxx: str) -> bool:
    found = subprocess.run([cxx, "-print-file-name=libstdc++.a"], capture_output=True,
                           text=True).stdout.strip()
    return os.path.isabs(found) and os.path.exists(found)


def _build_and_load(tmp_path, cxx: str, flags: list) -> subprocess.CompletedProcess:
    src = tmp_path / "describe.cpp"
    src.write_text(_SOURCE)
    lib = tmp_path / f"describe{len(flags)}.so"
    subprocess.run([cxx, "-O2", "-fPIC", "-shared", str(src), "-o", str(lib),
                    "-static-libstdc++", *flags], check=True)
    return subprocess.run([sys.executable, "-c", _LOAD, str(lib)], capture_output=True,
                          text=True, timeout=120)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the flag is for Linux's ld")
def test_a_static_libstdcxx_in_the_extension_writes_numbers_rightly(tmp_path):
    cxx = shutil.which(os.environ.get("CXX", "g++"))
    if cxx is None or not _static_libstdcxx_available(cxx):
        pytest.skip("no C++ compiler with a static libstdc++ here")
    done = _build_and_load(tmp_path, cxx, [_hide_static_libs_flag()])
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "tensor 3 is not contiguous", done.stdout
    # The hazard the flag removes, where this toolchain shows it (Debian's g++ 12
    # does): without it the message is cut short, or the process dies.
    bare = _build_and_load(tmp_path, cxx, [])
    print("without the flag:", bare.returncode, repr(bare.stdout.strip()))
