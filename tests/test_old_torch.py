"""What keeps the package working on the oldest torch setup.py admits (2.4), checked
on the torch CI runs: the shims over APIs that torch changed since.

docs/compatibility.md says what ran on torch 2.4.1 itself.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap

from fgpsdp_runtime import module_guards, reducer


def _disable_of_torch_2_4(fn=None, recursive=True):
    """torch.compiler.disable as torch 2.4 has it: no ``reason``."""
    return fn if fn is not None else (lambda f: f)


def test_the_package_imports_where_torch_compiler_disable_takes_no_reason():
    """Torch 2.4's ``torch.compiler.disable`` takes no ``reason``: a decorator that
    gave one made ``import fgpsdp_runtime`` raise a TypeError there (found on
    2.4.1; nothing could run)."""
    code = textwrap.dedent("""
        import torch
        def disable(fn=None, recursive=True):
            return fn if fn is not None else (lambda f: f)
        torch.compiler.disable = disable
        import fgpsdp_runtime
        print("imported")
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0 and "imported" in run.stdout, run.stderr[-2000:]


def test_eager_only_gives_the_reason_where_torch_takes_one():
    seen = {}

    def disable_with_reason(fn=None, recursive=True, *, reason=None):
        seen["reason"] = reason
        return lambda f: f

    def f():
        return 7

    assert eager_only_applied(disable_with_reason, f)() == 7
    assert seen == {"reason": "why"}
    assert eager_only_applied(_disable_of_torch_2_4, f)() == 7


def eager_only_applied(disable, fn):
    return module_guards.eager_only("why", disable)(fn)


def test_compiled_autograd_is_seen_under_torch_2_4s_name(monkeypatch):
    """Torch 2.4 says ``compiled_autograd_enabled`` where later ones say
    ``in_compiled_autograd_region``: unseen there, a compiled autograd backward
    failed inside torch instead of being refused with our message."""
    from torch._dynamo import compiled_autograd
    monkeypatch.delattr(compiled_autograd, "in_compiled_autograd_region", raising=False)
    monkeypatch.setattr(compiled_autograd, "compiled_autograd_enabled", True, raising=False)
    assert reducer._in_compiled_autograd()
    monkeypatch.setattr(compiled_autograd, "compiled_autograd_enabled", False, raising=False)
    assert not reducer._in_compiled_autograd()

