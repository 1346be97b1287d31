"""Forward pre-hooks that wait for a bucket's all-gather just before it is read.

With the ``next_forward`` schedule the updated parameters of step t are still
being all-gathered when forward t+1 starts. Each module waits, in its forward
pre-hook, only for the buckets holding parameters it is the first to read.

[Note: who reads a parameter]
A module may read its own parameters and those of submodules it does not
call (``nn.MultiheadAttention`` reads ``out_proj.weight`` without calling
``out_proj``), or a submodule's before calling it (a weight's norm taken by
its parent). So the first forward after construction (nothing pending)
records which modules run, in which order, and, through a torch function
mode, which parameters each torch call reads. Each parameter is then waited
for at the earliest of: the module running when it was first read, the
earliest running module that holds it directly, or else the deepest running
module that holds it in its subtree. A forward whose module order
differs from the recording (another branch, another module order) waits for
every pending bucket at the first difference, runs safely, and the next
forward records again. Parameters read outside any module's forward must be
synchronised by the caller (``model.synchronize()``).

[Note: one module ahead]
A difference is seen only at the first pre-hook that does not match, after
whatever the forward ran since the last one that did. A forward that skips
the module due next and reads its parameters in its place
(``F.linear(h, self.b.weight)`` instead of ``self.b(h)``) reads them in that
gap, before anything tells it apart from the recording (Megatron-LM issue
950: a module ran with stale weights). So what the next recorded module
needs is waited for as soon as nothing but such a gap can come before it:
when a module returns (its forward hook; only the caller's code runs between
it and the next pre-hook), or, where the next module is called from inside
this one (a child), at this one's pre-hook. Waiting one whole module early
instead cost VGG-16 5-14% per step at 2x1 (every conv's compute lost its
overlap); this costs the caller's code between two modules (an activation, a
pooling), and moves the waits the plan is profiled from: VGG-16 a median 3%
(docs/benchmarks/2026-12-04-forward-waits-ahead.md). A read, in that gap, of
a module further ahead is not covered (two modules skipped, the second's
weight read): such a forward must be synchronised by the caller.

[Note: modules compiled apart]
Compiled code runs the hooks of the modules inside it at tracing only (ours do
nothing there), and its reads of parameters are no torch calls a mode sees at
run time (inductor's kernels). So the recording forward's mode marks, while
dynamo traces, every parameter a traced call takes (an attribute dynamo sets
again after its graph runs, with no guard on it), as read at the place of the
module running then, the last whose hooks ran eagerly. (Not seen: a parameter's
``.data`` there, which dynamo takes without a torch call.) And a module compiled
apart, by ``torch.compile(m)`` (the OptimizedModule around it) or in place
(``m.compile()``: its calls get our hooks around them, _EagerHooksAround),
stands for its whole subtree: it takes one place in the recording and waits
there for its subtree's buckets and for what its code read first; modules
inside it whose hooks run eagerly (a graph break) neither record nor follow.

[Note: one graph per compiled code]
Dynamo guards a graph on the torch function modes on the stack when it was
traced. The recording forward's mode is on the stack while compiled code runs
there; were it missing from the forwards after, each compiled module's code
would be traced and compiled a second time, halving dynamo's recompile budget per
code object (its recompile limit, an error under fullgraph=True, came sooner: a
block warmed up before wrapping; ResNet-50's 8 kinds of bottleneck). So the same
mode, one per waiter, is pushed around every call of compiled code we hook (a
module compiled in place, an OptimizedModule's forward, a module's forward
compiled by ``m.forward = torch.compile(m.forward)``), in every forward and in
calls outside it; outside a recording forward its eager calls (graph breaks)
pass through untouched, and the marks its graph leaves are dropped when the
next recording begins. Compiled modules with no parameters of their own get the
mode the same way (no hooks), those found at wrapping and when the parameters'
places change. Still traced twice, with the mode and without: a function compiled
apart and called from eager code (not a module), a parameterless module compiled
after wrapping (in place, or set into the tree so), and compiled code called
inside a mode the forward enters itself (dynamo guards on the modes' order,
which differs then).
"""
from __future__ import annotations

import functools
import threading
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from .lifecycle import HookHandles
from .module_guards import ModuleHook, is_traced_by_dynamo, plain_named_parameters
from .param_guards import storage_address


class ForwardParamWaiter:
    def __init__(self, root: nn.Module, bucket_of_param: dict[int, list[int]],
                 wait_bucket: Callable[[int], None], wait_all: Callable[[], None],
                 direct_call: Callable[[], None],
                 bucket_storages: Callable[[], frozenset[int]] = frozenset):
        self._root = root
        # data_ptr() of every bucket buffer's storage (a tensor there aliases
        # parameters), taken when a forward records: share_memory() moves them.
        self._bucket_storages_now = bucket_storages
        self._bucket_storages: frozenset[int] = frozenset()
        # Called when ``root`` runs outside the wrapper's forward (model.module(x)).
        self._direct_call = direct_call
        self._bucket_of_param = bucket_of_param  # id(param) -> buckets holding it
        self._wait_bucket = wait_bucket
        self._wait_all = wait_all
        self._recorded: Optional[list[int]] = None  # id(module) in pre-hook order
        self._needs: list[list[int]] = []  # buckets to wait for at each recorded position
        # Per recorded position: the next position's module is in this one's subtree
        # (called from inside it). See [Note: one module ahead].
        self._next_is_inside: list[bool] = []
        # In a following forward: the needs of every position up to this one are waited for.
        self._waited_through = -1
        self._recording: list[int] = []
        self._first_read: dict[int, int] = {}  # id(param) -> recording position
        # The one mode of this waiter, on the stack in a recording forward and
        # around compiled calls (see [Note: one graph per compiled code]).
        self._recorder = _ParamReadRecorder(self)
        self._recorder_entered = False  # by begin_forward, for the recording forward
        # A recording forward took a parameter's .detach() or .data, or read a view
        # of one without autograd history: it may be saved for backward apart
        # from its gradient (see scheduler.py).
        self.reads_detached_params = False
        self._cursor = 0
        # Calls of modules compiled apart under way (see [Note: modules compiled apart]).
        self._compiled_depth = 0
        # The wrapper's parameters, where compiled code that ran in a recording
        # forward leaves its mark (see [Note: modules compiled apart]).
        self._params = [p for _, p in plain_named_parameters(root) if id(p) in bucket_of_param]
        # "record" or "follow" (this forward), "landed" (this forward, after a
        # deviation landed everything), or "off" (no forward of the wrapper).
        # Off until the first: a loop may call model.module(...) before it, or
        # never call the wrapper, and such calls must land the gathers.
        self._mode = "off"
        self._forward_thread: Optional[int] = None  # threading.get_ident() of the forward's
        self.deviations = 0  # forwards whose module order differed from the recording
        self._modules = [m for m in root.modules() if any(True for _ in m.parameters())]
        # First among the module's pre-hooks: those registered before wrapping
        # (weight_norm's, pruning's, a user's) may read the parameters too.
        self._hook = ModuleHook(self._pre_hook)
        # First among its forward hooks too: a user's may read the next module's.
        self._post_hook_of_ours = ModuleHook(self._post_hook)
        self._handles = HookHandles()
        for m in self._modules:
            self._add_hooks(m)
        self._hooked = {id(m) for m in self._modules}
        # Compiled modules with no parameters of their own: no hooks (nothing to
        # wait for), only our mode around their compiled calls. Looked for here and
        # when the parameters' places change (see [Note: one graph per compiled code]).
        self._compiled_without_params: list[nn.Module] = []
        self._find_compiled_without_params()

    def _find_compiled_without_params(self) -> None:
        self._compiled_without_params = [
            m for m in self._root.modules()
            if not any(True for _ in m.parameters())
            and ("_compiled_call_impl" in m.__dict__ or _compiled_forward(m) is not None)]

    def _add_hooks(self, module: nn.Module) -> None:
        self._handles.add(module.register_forward_pre_hook(self._hook, prepend=True))
        self._handles.add(module.register_forward_hook(self._post_hook_of_ours, prepend=True))

    def hook_modules_compiled_apart(self) -> None:
        """After the module tree changed: a module of ours set back into it compiled
        by ``torch.compile(m)`` (``layers[i] = torch.compile(layers[i])`` after
        wrapping) gets our hooks on the OptimizedModule around it, whose hooks run
        eagerly, as one compiled so before wrapping has them: the hooks of the
        modules inside run in compiled code, where ours do nothing."""
        for m in self._root.modules():
            if isinstance(m, _OptimizedModule) and id(m) not in self._hooked \
                    and any(True for _ in m.parameters()):
                self._add_hooks(m)
                self._modules.append(m)
                self._hooked.add(id(m))
                self._recorded = None  # (see _hook_compiled_calls)
        self._find_compiled_without_params()

    def remove(self) -> None:
        self._handles.remove()
        for m in self._modules + self._compiled_without_params:
            hooks = m.__dict__.get("_compiled_call_impl")
            if isinstance(hooks, (_EagerHooksAround, _RecorderAround)):
                m._compiled_call_impl = hooks.compiled
            forward = m.__dict__.get("forward")
            if isinstance(forward, _RecorderAround):
                m.__dict__["forward"] = forward.compiled

    def _hook_compiled_calls(self) -> None:
        """A module compiled by ``nn.Module.compile()`` runs its hooks, ours among
        them, inside compiled code, where ours do nothing: its calls get our hooks
        around them, eagerly. (Before, the wrapper waited for every bucket before
        such a forward: torchtune compiles each layer so.) And the compiled calls
        of these and of the modules whose ``forward`` is compiled get our mode
        around them (see [Note: one graph per compiled code])."""
        for m in self._modules:
            compiled = m.__dict__.get("_compiled_call_impl")
            if compiled is not None and not isinstance(compiled, _EagerHooksAround):
                m._compiled_call_impl = _EagerHooksAround(compiled, m, self)
                # Compiled since the recording: the pre-hooks of the modules inside
                # no longer run eagerly, so the recording's waits there would never
                # come, nor would a deviation be seen. Learn the order again.
                self._recorded = None
            forward = _compiled_forward(m)
            if forward is not None:
                # See [Note: one graph per compiled code]. (Compiled since the
                # recording: as above.)
                m.__dict__["forward"] = _RecorderAround(forward, self)
                self._recorded = None
        for m in self._compiled_without_params:  # (nothing inside them records)
            compiled = m.__dict__.get("_compiled_call_impl")
            if compiled is not None and not isinstance(compiled, _RecorderAround):
                m._compiled_call_impl = _RecorderAround(compiled, self)
            forward = _compiled_forward(m)
            if forward is not None:
                m.__dict__["forward"] = _RecorderAround(forward, self)

    def call_compiled(self, compiled: Callable, *args, **kwargs):
        """Calls compiled code with this waiter's mode on the stack, as in the
        recording forward: see [Note: one graph per compiled code]."""
        if is_traced_by_dynamo() or self._recorder_on_this_thread():
            return compiled(*args, **kwargs)  # (inside other compiled code, or recording)
        with self._recorder:
            return compiled(*args, **kwargs)

    def _recorder_on_this_thread(self) -> bool:
        return any(mode is self._recorder for mode in _function_mode_stack())

    def recording_here(self) -> bool:
        """A recording forward runs on this thread."""
        return self._mode == "record" and self._forward_thread == threading.get_ident()

    @property
    def in_forward(self) -> bool:
        """A forward of the wrapper is running on this thread. (Its pre-hooks wait
        for what it reads; another thread reading then, a logger's, waits for what
        it reads itself.)"""
        return self._mode != "off" and self._forward_thread == threading.get_ident()

    # -- per forward -----------------------------------------------------------

    def begin_forward(self, landed: bool = False) -> None:
        """``landed``: the caller has landed every all-gather, and the modules hold
        other tensors than the parameters (a functional_call's): this forward
        neither records nor follows (a recording would find no bucket for them)."""
        self._forward_thread = threading.get_ident()
        self._compiled_depth = 0
        self._hook_compiled_calls()
        # A forward without autograd (an eval) does not record either: the
        # recorder's function mode on the stack turns off torch's fast paths
        # (nn.MultiheadAttention's, nn.TransformerEncoderLayer's), whose fused
        # kernels round apart from the slow path. The next forward that builds a
        # graph records (training forwards take no fast path).
        if landed or (self._recorded is None and not torch.is_grad_enabled()):
            self._wait_all()
            self._mode = "landed"
        elif self._recorded is None:
            self._wait_all()  # nothing may be pending while we learn who reads what
            self._bucket_storages = self._bucket_storages_now() or frozenset()
            self._mode = "record"
            self._recording = []
            self._first_read = {}
            self._place_traced_reads(keep=False)
            # Thread-local: only this forward's calls are seen.
            self._recorder.__enter__()
            self._recorder_entered = True
        else:
            self._mode = "follow"
            self._cursor = 0
            self._waited_through = -1

    def end_forward(self) -> None:
        if self._recorder_entered:
            self._recorder_entered = False
            self._recorder.__exit__(None, None, None)
        if self._mode == "record":
            self._place_traced_reads()
            self._recorded = self._recording
            self._needs = self._assign(self._recording)
            self._next_is_inside = self._next_inside(self._recording)
        # Buckets no module waited for (modules skipped this time): land them now.
        self._wait_all()
        self._mode = "off"

    def _pre_hook(self, module: nn.Module, args) -> None:
        if is_traced_by_dynamo():
            # Traced by torch.compile, this would run once at tracing and never
            # again. Compiled code waits earlier instead: the wrapper's compiled
            # forward waits for everything; a submodule compiled by
            # torch.compile(m) waits in the pre-hook of the OptimizedModule around
            # it (which runs eagerly) for its subtree, and one compiled in place
            # (nn.Module.compile()) in this hook, called eagerly around it
            # (_EagerHooksAround).
            return
        if self._mode == "off" or self._forward_thread != threading.get_ident():
            # Outside the wrapper's forward: the root or a submodule called
            # directly (an eval, generate(), CLIP's model.module.encode_image(x)
            # calling self.visual) would read what the gathers have not yet
            # written. So is a call on another thread while the loop's forward
            # runs (a logger's eval): it must not move that forward's place in the
            # recording, nor wait as the loop. (Activation checkpointing's
            # recomputation runs in backward, which the wrapper lets through.)
            self._direct_call()
            return
        inside_compiled = self._compiled_depth > 0
        if _compiled_apart(module):
            self._compiled_depth += 1
        if inside_compiled:
            return  # see [Note: modules compiled apart]
        if self._mode == "record":
            self._place_traced_reads()
            self._recording.append(id(module))
        elif self._mode == "follow":
            position = self._cursor
            if position < len(self._recorded) and self._recorded[position] == id(module):
                self._wait_through(position + 1 if self._next_is_inside[position] else position)
                self._cursor += 1
            else:
                # Another order than recorded: be safe now, learn again next time.
                self.deviations += 1
                self._wait_all()
                self._recorded = None
                self._mode = "landed"

    def _post_hook(self, module: nn.Module, args, output) -> None:
        if is_traced_by_dynamo():
            return  # first: a look at our state in traced code would be guarded on
        if self._mode == "off" or self._forward_thread != threading.get_ident():
            return
        if self._compiled_depth > 0 and _compiled_apart(module):
            self._compiled_depth -= 1
        # Between here and the next pre-hook only the caller's code runs: what the
        # next recorded module needs is waited for now (see [Note: one module ahead]).
        if self._mode == "follow" and self._compiled_depth == 0:
            self._wait_through(self._cursor)

    def _wait_through(self, position: int) -> None:
        """Wait for the needs of every recorded position up to ``position``, once each."""
        last = min(position, len(self._needs) - 1)
        while self._waited_through < last:
            self._waited_through += 1
            for b in self._needs[self._waited_through]:
                self._wait_bucket(b)

    def _note_detached(self, tensor: torch.Tensor) -> None:
        """During a recording forward: ``tensor.detach()`` (or ``.data``) was taken."""
        if id(tensor) in self._bucket_of_param:
            self.reads_detached_params = True  # sticky: a later recording may not see it

    def _note_read(self, tensor: torch.Tensor) -> None:
        """During a recording forward: ``tensor`` was read by a torch call."""
        key = id(tensor)
        if (key not in self._bucket_of_param and not self.reads_detached_params
                and tensor.grad_fn is None and torch.is_grad_enabled()
                and self._aliases_a_bucket(tensor)):
            # A view of a parameter without its autograd history (a detached view,
            # w.t().detach(), or one taken under no_grad, which still says
            # requires_grad): a call that reads it with gradients on may save it
            # for backward, as a detach would.
            self.reads_detached_params = True
        if not self._recording:
            return  # no pre-hook has run (compiled modules): nowhere to wait earlier
        if key in self._bucket_of_param and key not in self._first_read:
            # The module whose pre-hook ran last is running, or has called
            # modules that already returned: either way no later than the read.
            self._first_read[key] = len(self._recording) - 1

    def _place_traced_reads(self, keep: bool = True) -> None:
        """Compiled code that ran since the last pre-hook read the parameters it
        marked: at the place of the module running then (the last recorded), and
        took a ``.detach()`` of those it marked so. ``keep=False``: the marks
        left since the last recording (compiled code runs outside recordings
        too) are dropped."""
        for param in self._params:
            read = param.__dict__.pop(_READ_IN_COMPILED_CODE, False)
            detached = param.__dict__.pop(_DETACHED_IN_COMPILED_CODE, False)
            if keep and detached:
                self.reads_detached_params = True
            if keep and read and self._recording:
                self._first_read.setdefault(id(param), len(self._recording) - 1)

    def _aliases_a_bucket(self, tensor: torch.Tensor) -> bool:
        return storage_address(tensor) in self._bucket_storages

    # -- the assignment ----------------------------------------------------------

    def _next_inside(self, order: list[int]) -> list[bool]:
        """Per position: the next position's module is in this one's subtree."""
        names = {}
        for name, m in self._root.named_modules():
            names.setdefault(id(m), name)
        inside = []
        for mid, next_mid in zip(order, order[1:]):
            outer, inner = names.get(mid), names.get(next_mid)
            inside.append(outer is not None and inner is not None
                          and (outer == "" or inner.startswith(outer + ".")))
        return inside + [False] if order else []  # the last module: nothing after it

    def _assign(self, order: list[int]) -> list[list[int]]:
        by_id = {id(m): m for m in self._modules}
        depth = {id(self._root): 0}
        for name, m in self._root.named_modules():
            if name:
                depth[id(m)] = name.count(".") + 1
        first_position: dict[int, int] = {}
        for position, mid in enumerate(order):
            first_position.setdefault(mid, position)
        owner: dict[int, int] = {}  # id(param) -> position of the module that waits
        # 1) the earliest running module that holds the parameter directly
        for mid, position in sorted(first_position.items(), key=lambda kv: kv[1]):
            for _, p in plain_named_parameters(by_id[mid], recurse=False):
                owner.setdefault(id(p), position)
        # 2) otherwise the deepest running module that holds it in its subtree
        for mid, position in sorted(first_position.items(),
                                    key=lambda kv: (-depth.get(kv[0], 0), kv[1])):
            for _, p in plain_named_parameters(by_id[mid]):
                owner.setdefault(id(p), position)
        # 3) earlier if a torch call read it before that module ran
        for pid, position in self._first_read.items():
            owner[pid] = min(owner.get(pid, position), position)
        needs: list[list[int]] = [[] for _ in order]
        seen_bucket: set[int] = set()
        for pid, position in sorted(owner.items(), key=lambda kv: kv[1]):
            for b in self._bucket_of_param.get(pid, ()):
                if b not in seen_bucket:  # a bucket is waited for where first needed
                    seen_bucket.add(b)
                    needs[position].append(b)
        return needs


try:
    from torch._dynamo.eval_frame import OptimizedModule as _OptimizedModule
except ImportError:  # a torch without dynamo: isinstance(m, ()) is False
    _OptimizedModule = ()


def _compiled_forward(module: nn.Module) -> Optional[Callable]:
    """The module's compiled ``forward`` that our mode is not yet around: an
    OptimizedModule's, or one set by ``m.forward = torch.compile(m.forward)``; not
    one ``torch.compiler.disable`` made (its eager calls would all pass through
    the mode)."""
    forward = module.__dict__.get("forward")
    if forward is None or isinstance(forward, _RecorderAround) \
            or getattr(forward, "_torchdynamo_disable", False):
        return None
    if isinstance(module, _OptimizedModule) or hasattr(forward, "_torchdynamo_orig_callable"):
        return forward
    return None


def _compiled_apart(module: nn.Module) -> bool:
    """``module`` runs compiled code with hooks of its own that run eagerly: an
    OptimizedModule (``torch.compile(m)``) or one compiled in place whose calls
    we hooked (``_EagerHooksAround``)."""
    return isinstance(module, _OptimizedModule) \
        or isinstance(module.__dict__.get("_compiled_call_impl"), _EagerHooksAround)


class _EagerHooksAround:
    """Stands in for ``module._compiled_call_impl``, which ``nn.Module.compile()``
    sets and ``module(...)`` calls instead of its ``_call_impl``: runs the waiter's
    pre- and post-hook for the module eagerly around the compiled call, so the
    module waits for its subtree's buckets as a module compiled by
    ``torch.compile(m)`` does in the pre-hook of the OptimizedModule around it.
    Traced itself (the module called from other compiled code), both hooks do
    nothing: that code's own waits cover it."""

    def __init__(self, compiled: Callable, module: nn.Module, waiter: ForwardParamWaiter):
        self.compiled = compiled
        self._module = module
        self._waiter = waiter

    def __call__(self, *args, **kwargs):
        self._waiter._pre_hook(self._module, args)
        output = self._waiter.call_compiled(self.compiled, *args, **kwargs)
        self._waiter._post_hook(self._module, args, output)
        return output

    def __deepcopy__(self, memo):
        # Reached only by a class's own __deepcopy__ that copies __dict__ (torch's
        # __getstate__ drops _compiled_call_impl): the copy is not wrapped.
        return self.compiled


class _RecorderAround:
    """Stands in for a module's compiled ``forward`` (an OptimizedModule's, or one
    set by ``m.forward = torch.compile(m.forward)``), or for the compiled call of a
    module with no parameters compiled in place: calls it with the waiter's mode on
    the stack (see [Note: one graph per compiled code]). The module's own hooks,
    ours among them, run eagerly around it as before."""

    def __init__(self, compiled: Callable, waiter: ForwardParamWaiter):
        # Its name, signature (through __wrapped__) and attributes: a Trainer
        # reads forward's signature to choose the dataset's columns.
        functools.update_wrapper(self, compiled)
        self.compiled = compiled
        self._waiter = waiter

    def __call__(self, *args, **kwargs):
        return self._waiter.call_compiled(self.compiled, *args, **kwargs)

    def __deepcopy__(self, memo):
        # A copy of the module (an OptimizedModule's __getstate__ drops forward;
        # another's copies it): not wrapped, as before wrapping.
        return self.compiled


# Calls that read a tensor's metadata, not its values: a model may look at a
# parameter's dtype or device long before it reads it (a dtype for its masks
# at the top of forward), which must not pull the wait forward.
METADATA_ONLY_CALLS = frozenset(
    [getattr(torch.Tensor, name).__get__
     for name in ("dtype", "shape", "device", "requires_grad", "ndim", "is_cuda", "layout",
                  "is_leaf", "is_sparse", "is_quantized", "is_meta")]
    + [getattr(torch.Tensor, name)
       for name in ("size", "dim", "numel", "nelement", "is_floating_point", "is_complex",
                    "element_size", "data_ptr", "stride", "storage_offset", "get_device",
                    "is_contiguous", "__len__")])


class _ParamReadRecorder(TorchFunctionMode):
    """Tells the waiter which tensors each torch call of a recording forward reads.
    Also on the stack around compiled calls outside recording forwards, where its
    eager calls pass through (see [Note: one graph per compiled code])."""

    def __init__(self, waiter: ForwardParamWaiter):
        super().__init__()
        self._waiter = waiter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if is_traced_by_dynamo():
            # Compiled code traced in a recording forward: its tensors are dynamo's
            # proxies, with no storage or autograd history to look at (a look would
            # break the graph, an error under fullgraph=True). Dynamo replays the
            # marks after its graph runs (see [Note: modules compiled apart]).
            for tensor in tensors_in((args, kwargs)):
                if isinstance(tensor, nn.Parameter):
                    setattr(tensor, _READ_IN_COMPILED_CODE, True)
            if func in _DETACHING and args and isinstance(args[0], nn.Parameter):
                setattr(args[0], _DETACHED_IN_COMPILED_CODE, True)
            return func(*args, **kwargs)
        if not self._waiter.recording_here():
            return func(*args, **kwargs)  # around compiled code, outside a recording
        if func not in METADATA_ONLY_CALLS:
            for tensor in tensors_in((args, kwargs)):
                self._waiter._note_read(tensor)
            if func in _DETACHING and args:
                self._waiter._note_detached(args[0])
        return func(*args, **kwargs)


# The mark compiled code traced in a recording forward leaves on a parameter it
# reads: an attribute, which dynamo sets again each time its graph runs and does
# not guard on (a list it would guard on, a new graph for each length).
_READ_IN_COMPILED_CODE = "_fgpsdp_read_in_compiled_code"
# And on one whose .detach() it takes (not the waiter's flag: the graph sets its
# marks at every run, outside recording forwards too, an eval's).
_DETACHED_IN_COMPILED_CODE = "_fgpsdp_detached_in_compiled_code"

# Calls that alias a tensor's memory without its autograd history: a parameter
# read so may be saved for backward apart from its own gradient (see
# scheduler.py, [Note: parameters the backward still reads]).
_DETACHING = frozenset([torch.Tensor.detach, torch.detach, torch.Tensor.data.__get__])


try:
    from torch.overrides import _get_current_function_mode_stack as _function_mode_stack
except ImportError:  # (private in torch; present since 2.0)
    def _function_mode_stack() -> list:
        return []


def tensors_in(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors_in(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item)
