"""The source distribution holds what building the extension from it needs.

setuptools packs the sources an extension names, not the headers they include:
without MANIFEST.in an sdist (``python -m build --sdist``, what ``pip install``
of a source archive builds from) lacked csrc/include and csrc/cuda, and its
build stopped at the first #include "fgpsdp/...". Building it whole takes minutes;
that every file under csrc/ is in it is what failed.
"""
import os
import shutil
import subprocess
import sys
import tarfile

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SKIP = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "*.so",
                               "__pycache__", ".pytest_cache")


def _files_under(top: str) -> set[str]:
    return {os.path.relpath(os.path.join(d, f), _ROOT)
            for d, _, files in os.walk(os.path.join(_ROOT, top)) for f in files}


def test_the_sdist_holds_every_source_and_header_of_the_extension(tmp_path):
    tree = tmp_path / "tree"
    shutil.copytree(_ROOT, tree, ignore=_SKIP)  # no egg-info written into the checkout
    env = {**os.environ, "FGPSDP_SKIP_CUDA": "1"}
    subprocess.run([sys.executable, "setup.py", "-q", "sdist", "--dist-dir", str(tmp_path)],
                   cwd=tree, env=env, check=True, capture_output=True, timeout=300)
    (archive,) = tmp_path.glob("*.tar.gz")
    with tarfile.open(archive) as packed:
        names = {name.split("/", 1)[1] for name in packed.getnames() if "/" in name}
    needed = _files_under("csrc") | {"setup.py", "pyproject.toml"}
    assert any(name.endswith(".h") for name in needed)
    assert needed <= names, sorted(needed - names)
