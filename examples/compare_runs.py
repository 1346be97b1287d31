"""What the framework comparisons share (lightning_compare.py, hf_trainer_compare.py,
accelerate_compare.py, peft_compare.py, fabric_compare.py):
running a training command until it exits cleanly, and the table of parameter
differences, with ``--check``'s verdict."""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from typing import Callable, Optional

import torch

TOLERANCE = 1e-6  # --check: what a pair with fgpsdp may differ by (the clip's rounding)


def free_port_below_ephemeral_range() -> int:
    """A free port for a launcher that binds the port it is given later (torchrun's
    --master_port, Lightning's MASTER_PORT): one below the range the kernel hands out
    for port 0, which every torchrun --standalone store and gloo socket binds, so that
    none of those (of a run side by side with this one) can take it meanwhile. Probed
    on every address, as the stores bind it."""
    import random
    import socket
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default
    below = range(max(1024, low // 2), low)
    if len(below) < 100:  # a range set to start near 1024: take the kernel's pick
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]
    candidates = random.sample(below, 100)
    for port in candidates:
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {candidates}")


def run(command: list[str], tries: int = 3, timeout_s: float = 120) -> None:
    """torch DDP runs on CPU under these frameworks now and then abort at exit, after
    training ("terminate called without an active exception", SIGABRT; also without
    fgpsdp imported) or hang there: such a run is run again, and said so."""
    for attempt in range(1, tries + 1):
        # (Its own process group: a timeout stops the ranks it launched too.)
        process = subprocess.Popen(command, start_new_session=True)
        try:
            code = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill(process)
            code = f"a timeout ({timeout_s:g} s)"
        except BaseException:  # Ctrl-C does not reach a process group of its own
            _kill(process)
            raise
        if code == 0:
            return
        print(f"[compare] exit code {code} (try {attempt} of {tries}): "
              + " ".join(command[1:]), flush=True)
    raise SystemExit(f"failed {tries} times: {' '.join(command)}")


def refuses(command: list[str], message: str, timeout_s: float = 120) -> bool:
    """Whether ``command`` fails, saying ``message`` (a refusal the comparisons check)."""
    process = subprocess.Popen(command, start_new_session=True, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill(process)
        return False
    return process.returncode != 0 and message in output


def check_refusal(what: str, command: list[str], message: str, check: bool) -> None:
    """Prints whether fgpsdp refuses ``what`` (``command`` fails saying ``message``);
    with ``check``, exits 1 where it does not."""
    refused = refuses(command, message)
    print(f"fgpsdp refuses {what}: {'yes' if refused else 'NO'}")
    if check and not refused:
        raise SystemExit(f"fgpsdp did not refuse {what}")


def _kill(process: subprocess.Popen) -> None:
    """Kills the command's process group and every process it started: torchrun starts
    each rank in a session of its own, which outlives the group (a hung rank then kept
    running, and kept the pipe of a caller's ``| tail`` open). Everything is stopped
    first, the tree listed again until it holds nothing new, then killed: nothing
    starts a process between the listing and the kill."""
    os.killpg(process.pid, signal.SIGSTOP)
    stopped: set[int] = set()
    while True:
        new = set(_descendants(process.pid)) - stopped
        if not new:
            break
        for pid in new:
            _signal(pid, signal.SIGSTOP)
        stopped |= new
    os.killpg(process.pid, signal.SIGKILL)
    for pid in stopped:
        _signal(pid, signal.SIGKILL)
    process.wait()


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass  # gone already


def _descendants(pid: int) -> list[int]:
    """The processes below ``pid``, from /proc (none where there is no /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    # pid (comm) state ppid ...: comm may hold spaces and parentheses
                    ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def max_diff(a: str, b: str) -> float:
    pa, pb = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    return max(float((pa[k] - pb[k]).abs().max()) for k in pa)


def print_table(rows: list[tuple[str, str, str]], check: bool,
                tolerances: Optional[dict[str, float]] = None) -> None:
    """``rows``: (label, parameters file, parameters file). With ``check``, exits 1
    when a pair whose label names fgpsdp differs by more than TOLERANCE (or than
    ``tolerances[label]``, for a pair expected to round otherwise)."""
    width = max(len(label) for label, _, _ in rows) + 2
    print(f"\n{'pair':<{width}} max |param difference|")
    failed = []
    for label, a, b in rows:
        diff = max_diff(a, b)
        print(f"{label:<{width}} {diff:.3g}")
        tolerance = (tolerances or {}).get(label, TOLERANCE)
        if "fgpsdp" in label and not diff <= tolerance:
            failed.append(f"{label} (over {tolerance:g})")
    if check and failed:
        raise SystemExit(f"differ: {'; '.join(failed)}")


def rows_against_torch(out: Callable[[str, str], str],
                       names: list[str]) -> list[tuple[str, str, str]]:
    """For print_table: fgpsdp against torch DDP in each run of ``names``, then each
    system's "resumed" run against its "plain" one (an exact resume gives 0)."""
    rows = [(f"fgpsdp against torch DDP: {name}", out("fgpsdp", name), out("torch", name))
            for name in names]
    rows += [(f"{system} resumed against {system} uninterrupted",
              out(system, "resumed"), out(system, "plain")) for system in ("fgpsdp", "torch")]
    return rows


def parse_check(doc: str) -> bool:
    """The comparison's command line: whether ``--check`` was given."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--check", action="store_true",
                        help=f"exit 1 if a pair with fgpsdp differs by more than {TOLERANCE:g}")
    return parser.parse_args().check


def run_both(runs: dict[str, list[str]], command: Callable[[str, str, list[str]], list[str]],
             directory: str) -> Callable[[str, str], str]:
    """Runs each of ``runs`` ({name: the trainer's arguments}, where "{dir}" is
    ``directory`` and "{system}" the system) on torch DDP, then on fgpsdp;
    ``command(system, parameters file, arguments)`` is its command line. Returns
    where a run left its parameters: ``out(system, name)``."""
    def out(system: str, name: str) -> str:
        return os.path.join(directory, f"{system}_{name}.pt")
    for name, extra in runs.items():
        for system in ("torch", "fgpsdp"):
            arguments = [a.format(dir=directory, system=system) for a in extra]
            run(command(system, out(system, name), arguments))
    return out


def torchrun(script: str) -> Callable[[str, str, list[str]], list[str]]:
    """For run_both: ``script system parameters-file arguments...`` on 2 CPU ranks
    launched by torchrun."""
    def command(system: str, params: str, args: list[str]) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node", "2", script, system, params, *args]
    return command
