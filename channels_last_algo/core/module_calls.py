"""One tracker of module calls, shared by the layout audit, the input selection and the repair check.

Each of them needs to know which module is running: the audit names the module of a break, the
input selection follows the first batch inside module calls, and the repair check compares a
swapped layer with its original on its first call. :func:`follow_module_calls` subscribes a
:class:`ModuleCallListener`; while one is subscribed, one process-wide forward pre-hook and one
forward hook (``always_call``: also when the forward raised) call every listener around every
module call. The hooks do nothing while ``torch.compile`` or ``torch.export`` traces the model,
whose graph holds the model's own ops only, nor inside a compiled call (a ``torch.compile`` wrapper's
network, a module compiled in place, a graph break's eager calls): listeners hear the wrapper, or
the module around it, in every torch (torch 2.7 calls the network's own hooks eagerly, newer torch
traces them). While they are on, newer torch's notice at each compiled wrapper's call that global hooks
fire once more for it is quieted where no other global hook is on: the listeners hear that call once.

The hooks come off once no listener is left. They never take themselves off while a forward unwinds
from an error: torch walks its live table of global hooks there, and removing one would replace
that error with "OrderedDict mutated during iteration". After a normal return torch calls them
from a copy of the table, so idle hooks come off at the next module call that returns, or at the
next (un)subscription. A compiled graph guards on the number of global hooks: while a
``torch.compile`` wrapper that ran with them lives, they stay on, idle, and come off when it is
collected. Dynamo leaves the hooks' frames, and what they call, alone where torch calls them
eagerly: strict ``torch.export`` (torch 2.7's default) compiled each such call as a graph of its own
and then refused the export ("exactly one guard export"); inside a traced forward they are inlined.

Example:
    >>> import torch
    >>> class Names:
    ...     def __init__(self):
    ...         self.seen = []
    ...     def entered(self, module, args):
    ...         self.seen.append(type(module).__name__)
    ...     def left(self, module, args, kwargs, output, failed):
    ...         return None                         # or an output to use instead
    >>> names = Names()
    >>> with follow_module_calls(names):
    ...     _ = torch.nn.Sequential(torch.nn.ReLU())(torch.ones(1))
    >>> names.seen
    ['Sequential', 'ReLU']
    >>> tracking(names)
    False
"""

from __future__ import annotations

import contextlib
import sys
import threading
import warnings
import weakref
from collections.abc import Iterator
from typing import Any, Optional, Protocol

import torch
from torch._C._dynamo.eval_frame import set_code_exec_strategy
from torch._dynamo.types import FrameAction, FrameExecStrategy
from torch.nn.modules import module as module_hooks

__all__ = [
    'ModuleCallListener',
    'follow_module_calls',
    'hooks_installed',
    'compiled_in_place',
    'compiled_network',
    'compiled_wrapper',
    'eager_forward',
    'exit_mode',
    'in_graph_capture',
    'is_torchscript',
    'on_mode_stack',
    'on_top_of_mode_stack',
    'paused',
    'settle_hooks',
    'subscribe',
    'tracking',
    'unsubscribe',
]


class ModuleCallListener(Protocol):
    """What :func:`follow_module_calls` calls around each module call."""

    def entered(self, module: torch.nn.Module, args: tuple) -> None:
        """Before ``module``'s forward runs on ``args``."""

    def left(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any, failed: bool) -> Any:
        """After it returned ``output`` (None and ``failed`` when it raised); a value other than
        None replaces the output."""


_listeners: list[weakref.ref] = []  # held weakly: a listener its owner dropped stops by itself
_handles: list[Any] = []
_state: dict[str, Any] = {'depth': 0, 'paused': 0, 'only': None}  # hook calls under way, pauses, who is heard
_compiled = weakref.WeakSet()  # torch.compile wrappers called while the hooks were on


def in_graph_capture() -> bool:
    """True while a tracer or compiler records the model: layouts are its business there."""
    return torch.jit.is_tracing() or torch.compiler.is_compiling() or torch.compiler.is_exporting()


def compiled_wrapper(module: torch.nn.Module) -> bool:
    """A module whose forward runs as one graph: a ``torch.compile`` wrapper (``OptimizedModule``,
    ``module._orig_mod``), or one whose forward on the instance dynamo compiled (Composer's ``compile_config``,
    ``model.forward = torch.compile(model.forward)``)."""
    return isinstance(getattr(module, '_orig_mod', None), torch.nn.Module) or _compiled_function(module) is not None


def _compiled_function(module: torch.nn.Module) -> Any:
    """The function dynamo made of ``module``'s forward on the instance (seen through ``__wrapped__``), if any."""
    function = vars(module).get('forward')
    while function is not None and not hasattr(function, '_torchdynamo_orig_callable'):
        function = getattr(function, '__wrapped__', None)
    return function


def compiled_network(module: torch.nn.Module) -> torch.nn.Module:
    """The module whose weights a compiled ``module``'s graph runs on: a wrapper's network, else ``module``."""
    network = getattr(module, '_orig_mod', None)
    return network if isinstance(network, torch.nn.Module) else module


def is_torchscript(module: Any) -> bool:
    """Whether ``module`` is TorchScript (``torch.jit.script`` or ``trace``): it takes no hooks, and no Python code
    of it runs to trace, watch or fuse."""
    return isinstance(module, torch.jit.ScriptModule)


def eager_forward(module: torch.nn.Module) -> Any:
    """What a compiled ``module`` (:func:`compiled_wrapper`) runs eagerly: its network, or the forward compiled."""
    network = compiled_network(module)
    return network if network is not module else _compiled_function(module).__wrapped__


def compiled_in_place(module: torch.nn.Module) -> bool:
    """``module.compile()`` was called: each call runs a graph, from the module's own call on."""
    return getattr(module, '_compiled_call_impl', None) is not None


_graphs = threading.local()  # .calls: the compiled modules whose call runs now in this thread (None: paused's)


def _graph_calls() -> list[Optional[torch.nn.Module]]:
    if not hasattr(_graphs, 'calls'):
        _graphs.calls = []
    return _graphs.calls


def _pre_hook(module: torch.nn.Module, args: tuple) -> None:
    if torch.compiler.is_compiling():  # first: a graph guards on nothing of ours
        return
    calls = _graph_calls()
    if calls and calls[-1] is not None:  # inside a compiled call, not an eager run paused() makes there
        return
    if compiled_in_place(module):  # its own call runs as a graph
        calls.append(module)
        return
    compiled = compiled_wrapper(module)  # once: every module call of a watched step asks
    if compiled and module not in _compiled:
        _compiled.add(module)  # its graph guards on the number of global hooks: they stay while it lives
        weakref.finalize(module, settle_hooks)
    if _listeners:
        _state['depth'] += 1
        try:
            for listener in _heard():
                listener.entered(module, args)
        finally:
            _state['depth'] -= 1
    if compiled:  # after the listeners, whose eager rehearsal of its network torch runs as Python
        calls.append(module)


def _hook(module: torch.nn.Module, args: tuple, *kwargs_output: Any) -> Any:
    if torch.compiler.is_compiling():
        return None
    calls = _graph_calls()
    if calls and calls[-1] not in (module, None):
        return None
    if calls and calls[-1] is module:
        calls.pop()
        if compiled_in_place(module):
            return None
    # (kwargs, output) after a forward; (output,) from inside torch's ``except`` when it raised
    kwargs, output = kwargs_output if len(kwargs_output) == 2 else ({}, kwargs_output[0])
    failed = sys.exc_info()[0] is not None
    if not _listeners:  # idle: off now unless unwinding (torch calls forward hooks from a copy of its table)
        if not failed and not _compiled:
            settle_hooks()
        return None
    _state['depth'] += 1
    try:
        for listener in _heard():
            replaced = listener.left(module, args, kwargs, output, failed)
            output = output if replaced is None else replaced
    finally:
        _state['depth'] -= 1
    return output


def _alive() -> list[ModuleCallListener]:
    """The listeners whose owners still hold them, in subscription order."""
    return [listener for listener in (reference() for reference in _listeners) if listener is not None]


def _heard() -> list[ModuleCallListener]:
    """The listeners to call now: all, or while :func:`paused`, the one it names, if any."""
    if not _state['paused']:
        return _alive()
    return [listener for listener in _alive() if listener is _state['only']]


def _forget(reference: weakref.ref) -> None:
    """Drop ``reference``; where its listener was collected, also the hooks if nobody else listens."""
    if reference in _listeners:
        _listeners.remove(reference)
    if reference() is None:
        settle_hooks()


def settle_hooks() -> None:
    """Hooks on while anyone listens; off when no one does, unless inside a hook or while a compiled
    wrapper that saw them lives (removing them would make torch recompile its graph).
    Called by every (un)subscription, and by the input selection at each batch."""
    if _listeners and not _handles:
        for hook in (_pre_hook, _hook):  # an eager call runs as Python, with all it calls; a traced one is inlined
            set_code_exec_strategy(hook.__code__, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))
        _handles.append(module_hooks.register_module_forward_pre_hook(_pre_hook))
        _handles.append(module_hooks.register_module_forward_hook(_hook, with_kwargs=True, always_call=True))
    elif not _listeners and _handles and _state['depth'] == 0 and not list(_compiled):  # list: leaves a dying one out
        while _handles:
            _handles.pop().remove()
    _settle_compiled_call_notice()


_COMPILED_CALL_NOTICE = r'Using `torch\.compile\(module\)` when there are global hooks'
_notice_filters: list[tuple] = []  # the warnings filter that quiets it, while one is wanted
_GLOBAL_HOOK_TABLES = (  # what torch asks before that notice
    '_global_backward_pre_hooks',
    '_global_backward_hooks',
    '_global_forward_pre_hooks',
    '_global_forward_hooks',
)


def _settle_compiled_call_notice() -> None:
    """While the hooks are on, torch newer than 2.7 warns at a compiled wrapper's call that global hooks fire once
    more for the wrapper: these hear that call once (see above), so the notice is not the user's, and a warnings
    filter quiets it. Where another global hook is on, the notice may be its owner's: the filter comes off. A
    ``catch_warnings`` block that took the filter with it gets it back at the next settling."""
    ours = {handle.id for handle in _handles}
    others = any(set(getattr(module_hooks, table, ())) - ours for table in _GLOBAL_HOOK_TABLES)
    wanted = bool(_handles) and not others and hasattr(module_hooks, '_has_any_global_hook')
    _notice_filters[:] = [entry for entry in _notice_filters if entry in warnings.filters]
    if wanted and not _notice_filters:
        warnings.filterwarnings('ignore', message=_COMPILED_CALL_NOTICE, category=UserWarning)
        _notice_filters.append(warnings.filters[0])
    while _notice_filters and not wanted:
        warnings.filters.remove(_notice_filters.pop())
        getattr(warnings, '_filters_mutated', lambda: None)()


def on_mode_stack(mode: torch.overrides.TorchFunctionMode) -> bool:
    """Whether ``mode`` is on the torch function mode stack, at any depth."""
    return any(torch._C._get_function_stack_at(i) is mode for i in range(torch._C._len_torch_function_stack()))


def on_top_of_mode_stack(mode: torch.overrides.TorchFunctionMode) -> bool:
    """Whether ``mode`` is the innermost torch function mode, the first to see an op."""
    depth = torch._C._len_torch_function_stack()
    return depth > 0 and torch._C._get_function_stack_at(depth - 1) is mode


def exit_mode(mode: torch.overrides.TorchFunctionMode) -> None:
    """Take ``mode`` off the torch function mode stack wherever it is, the modes above it kept in
    order; nothing if it is not there. A listener's mode entered in one module call and left in
    another may no longer be on top (``__exit__`` pops whatever is), or gone."""
    if not on_mode_stack(mode):
        return
    above = []
    while torch._C._get_function_stack_at(torch._C._len_torch_function_stack() - 1) is not mode:
        above.append(torch._C._pop_torch_function_stack())
    mode.__exit__(None, None, None)
    for entry in reversed(above):
        torch._C._push_on_torch_function_stack(entry)


def subscribe(listener: ModuleCallListener) -> None:
    """Call ``listener`` around every module call until :func:`unsubscribe`; once only."""
    reference = weakref.ref(listener, _forget)
    if reference not in _listeners:
        _listeners.append(reference)
    settle_hooks()


def unsubscribe(listener: ModuleCallListener) -> None:
    """Stop calling ``listener``; nothing if it was not subscribed. Safe inside a module call."""
    _forget(weakref.ref(listener))
    settle_hooks()


@contextlib.contextmanager
def follow_module_calls(listener: ModuleCallListener) -> Iterator[ModuleCallListener]:
    """:func:`subscribe` ``listener`` inside the block."""
    subscribe(listener)
    try:
        yield listener
    finally:
        unsubscribe(listener)


@contextlib.contextmanager
def paused(only: Optional[ModuleCallListener] = None) -> Iterator[None]:
    """No listener is called inside, but ``only``: for module calls a listener makes itself (the
    repair check's side runs, the view watch's rehearsal), which run eagerly, also inside a compiled call."""
    before = _state['only']
    _state['paused'] += 1
    _state['only'] = only
    _graph_calls().append(None)
    try:
        yield
    finally:
        _graph_calls().pop()
        _state['paused'] -= 1
        _state['only'] = before


def hooks_installed() -> bool:
    """Whether the process-wide hooks are on (idle ones included)."""
    return bool(_handles)


def tracking(listener: Optional[ModuleCallListener] = None) -> bool:
    """Whether ``listener`` (by default: anyone) is subscribed."""
    return bool(_alive()) if listener is None else weakref.ref(listener) in _listeners
