"""What ShardedOptimizer's construction says of each optimizer class of a library,
and what the element-wise probe costs (fgpsdp_runtime/elementwise_probe.py).

    pip install pytorch_optimizer          # not a dependency: this survey alone
    python bench/elementwise_probe_survey.py [--library pytorch_optimizer]

For every class the library lists (pytorch_optimizer's get_supported_optimizers()),
built with its default arguments (lr=1e-3 where it has none), in the order the
constructor checks: refused by name (optimizer_kinds.py), then, for a class
outside torch.optim, the probe: accepted, refused (not element-wise; or its step
raised on 1-D pieces), or accepted with a warning (its step raised on the probe's
whole tensors). Then torch.optim's element-wise classes, which the constructor does
not probe, through the probe anyway: none should be refused. The times are one
probe's wall time on this machine, on CPU tensors. A verdict is the probe's, not a
proof: a class it accepts may still differ where its few steps show nothing (see
the docstring of optimizer_kinds.py). Prints a markdown table.
"""
from __future__ import annotations

import argparse
import inspect
import os
import platform
import sys
import time
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from fgpsdp_runtime import elementwise_probe  # noqa: E402
from fgpsdp_runtime.optimizer_kinds import refuse_unsliceable  # noqa: E402

TORCH_ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop",
                     "Adagrad", "Adadelta", "ASGD", "Rprop")


def verdict(optimizer_class: type, by_name: bool = True) -> tuple[str, float, str]:
    """(verdict, probe milliseconds, detail) for a class built with its defaults."""
    if by_name:
        try:
            refuse_unsliceable(optimizer_class)
        except TypeError:
            return "refused by name", 0.0, ""
    defaults = {}
    try:
        lr = inspect.signature(optimizer_class.__init__).parameters.get("lr")
        if lr is not None and lr.default is inspect.Parameter.empty:
            defaults["lr"] = 1e-3
    except (TypeError, ValueError):
        pass
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            elementwise_probe.refuse_unless_elementwise(
                optimizer_class, [{}], defaults, torch.device("cpu"))
        except TypeError as error:
            text = str(error)
            kind = ("refused: step raised on pieces" if "cannot run on flat slices" in text
                    else "refused: not element-wise")
            detail = text[text.index("(by up to"):text.index(";")] + ")" \
                if "(by up to" in text else text[text.index(": ", text.index("of them")) + 2:]
            return kind, 1e3 * (time.perf_counter() - start), detail[:110]
    ours = [w for w in caught if "fgpsdp" in str(w.message)]
    elapsed = 1e3 * (time.perf_counter() - start)
    if ours:
        message = str(ours[0].message)
        detail = message.split("construction: ", 1)[1].split(". check_elementwise")[0] \
            if "construction: " in message else "its step moved none of the probe's tensors"
        return "accepted, warned", elapsed, detail[:110]
    return "accepted", elapsed, ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--library", default="pytorch_optimizer",
                        choices=("pytorch_optimizer",))
    args = parser.parse_args()
    import pytorch_optimizer
    from importlib.metadata import version
    rows = []
    for name in sorted(pytorch_optimizer.get_supported_optimizers()):
        try:
            optimizer_class = pytorch_optimizer.load_optimizer(name)
        except Exception as error:  # noqa: BLE001 (listed, not loadable)
            rows.append((name, "not loadable", 0.0, f"{type(error).__name__}: {error}"[:110]))
            continue
        if elementwise_probe.known_elementwise(optimizer_class):
            rows.append((name, "torch.optim's (not probed)", 0.0, ""))
            continue
        rows.append((optimizer_class.__name__, *verdict(optimizer_class)))
    elementwise_probe_known = elementwise_probe.known_elementwise
    elementwise_probe.known_elementwise = lambda cls: False  # torch.optim's, probed anyway
    try:
        torch_rows = [(f"torch.optim.{name}", *verdict(getattr(torch.optim, name), False))
                      for name in TORCH_ELEMENTWISE]
    finally:
        elementwise_probe.known_elementwise = elementwise_probe_known
    print(f"{args.library} {version(args.library)}, torch {torch.__version__}, "
          f"Python {platform.python_version()}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores\n")
    print("| class | verdict | probe ms | detail |\n|---|---|---:|---|")
    for row_name, kind, ms, detail in rows + torch_rows:
        print(f"| {row_name} | {kind} | {ms:.1f} | {detail.replace('|', '/')} |")
    counts: dict[str, int] = {}
    for _, kind, _, _ in rows:
        counts[kind] = counts.get(kind, 0) + 1
    print(f"\n{len(rows)} classes of {args.library}: "
          + ", ".join(f"{kind} {n}" for kind, n in sorted(counts.items())))
    probed = sorted(ms for _, kind, ms, _ in rows if kind not in
                    ("refused by name", "not loadable", "torch.optim's (not probed)"))
    if probed:
        print(f"probe time over the {len(probed)} probed: median {probed[len(probed) // 2]:.1f} "
              f"ms, largest {probed[-1]:.1f} ms")
    refused_torch = [n for n, kind, _, _ in torch_rows if kind != "accepted"]
    print(f"torch.optim's element-wise classes through the probe: {len(torch_rows)}, "
          f"not accepted: {refused_torch or 'none'}")


if __name__ == "__main__":
    main()
