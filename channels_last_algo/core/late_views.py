"""Views that NHWC strides refuse where no watch is on: code first reached on a later step.

The view watch (:mod:`~channels_last_algo.core.viewed_outputs`) follows the first training step, the first
batch of each evaluation loop, and every step while a view could not be placed; later steps run with no
mode, at full speed. Code that first runs later (a gradient norm per filter every 50 steps through
``w.grad.view(n, -1)``, a branch a schedule or a batch's size switches on) would then raise where NCHW's
``.view()`` succeeds ("view size is not compatible with input tensor's size and stride"). While a step
or batch is :func:`armed`, ``Tensor.view`` and ``Tensor.view_as`` are thin wrappers: a view that
succeeds costs one Python call more; one that NHWC strides refuse, of a channels-last tensor or of a
view of one (``z[:, :2]``, ``z.flatten(2)``), is handed to the owner that armed
this thread (``owner.late_view(tensor)``, which starts the watch there, for the rest of the step) and
runs again under that watch, as on a watched step. Other threads (autograd's GPU threads run backward
hooks) and other errors see torch's own error. A ``torch.compile`` wrapper's network that dynamo traces
again, down such a path, meets the refusal as it traces, where no wrapper runs: its forward
(:func:`retrying_refused_traces`) hands the call to the owner (``owner.late_view(None)``, then
``owner.compiled_call(wrapper, args, rehearse=True)``, which runs the network eagerly under the watch and
so places the view's maker) and runs once more, where the failed call wrote no buffer (code before
a graph break runs before the code after it is traced: run twice, it would update running statistics
twice). Modes and tensor subclasses meanwhile see the wrapper
as the op: :func:`original` gives torch's method back. :func:`explain_unwatched_view` adds what
would fix it to the error of a view no watch could take.

Example:
    >>> import torch
    >>> class Owner:
    ...     started = []
    ...     def late_view(self, tensor):        # a watch would start here; this one only counts
    ...         self.started.append(tuple(tensor.shape))
    >>> owner = Owner()
    >>> z = torch.randn(2, 3, 4, 4).to(memory_format=torch.channels_last)
    >>> arm(owner)
    >>> try:
    ...     z.view(2, -1)                       # no watch took it: torch's error, after the owner heard
    ... except RuntimeError:
    ...     pass
    >>> disarm(owner)
    >>> owner.started, torch.Tensor.view is original(torch.Tensor.view)
    ([(2, 3, 4, 4)], True)
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from typing import Any, Optional

import torch

from channels_last_algo.core.layout import is_4d_or_5d, layout_of
from channels_last_algo.core.saved_state import plain_attributes, put_back

__all__ = [
    'COMPILED_VIEW',
    'RAN_BEFORE_THE_BREAK',
    'SCRIPTED_VIEW',
    'UNWATCHED_VIEW',
    'arm',
    'disarm',
    'explain_unwatched_view',
    'original',
    'passing_through',
    'refused_by_strides',
    'retrying_refused_traces',
]

_REFUSED = ('view size is not compatible', 'must be 1 to view')  # torch's errors: a shape, a dtype of another size
_TRACE_REFUSED = 'Cannot view a tensor with shape'  # dynamo's, as its fake tensors word it
_METHODS = {name: getattr(torch.Tensor, name) for name in ('view', 'view_as')}
_armed: list[tuple[int, weakref.ref]] = []  # (thread, owner), the last armed last


def _wrapper(method: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def view(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        try:
            return method(self, *args, **kwargs)
        except RuntimeError as error:
            owner = _owner(self, error)
            if owner is None:
                raise
            owner.late_view(self)
        return method(self, *args, **kwargs)  # under the watch the owner started

    view.__name__, view.__qualname__ = method.__name__, method.__qualname__  # as modes and subclasses name it
    return view


_WRAPPERS = {name: _wrapper(method) for name, method in _METHODS.items()}
_VIEW, _VIEW_AS = _WRAPPERS['view'], _WRAPPERS['view_as']
_PASSING = frozenset(wrapper.__code__ for wrapper in _WRAPPERS.values())


def refused_by_strides(error: BaseException) -> bool:
    """Whether ``error`` is torch refusing a view that the tensor's strides cannot take: of a shape ("view size is not
    compatible"), or of a dtype of another element size (``z.view(torch.int16)``, whose last stride must be 1).

    Example:
        >>> z = torch.zeros(1, 3, 2, 2).to(memory_format=torch.channels_last)
        >>> try:
        ...     z.view(torch.int16)
        ... except RuntimeError as error:
        ...     refused_by_strides(error)
        True
    """
    return isinstance(error, RuntimeError) and any(refusal in str(error) for refusal in _REFUSED)


def original(func: Any) -> Any:
    """torch's own method for a wrapper this module put on ``torch.Tensor``; any other ``func`` as it is."""
    if func is _VIEW:
        return _METHODS['view']
    return _METHODS['view_as'] if func is _VIEW_AS else func


def passing_through(code: Any) -> bool:
    """Whether ``code`` is a wrapper's, which a watch looks past for the code that called the view."""
    return code in _PASSING


def _owner(tensor: torch.Tensor, error: RuntimeError) -> Any:
    """The owner armed on this thread, where ``error`` is NHWC strides refusing a view of ``tensor``."""
    if not refused_by_strides(error) or torch.compiler.is_compiling():
        return None
    memory = tensor if tensor._base is None else tensor._base  # laid out channels last, as NCHW's is not
    if not (is_4d_or_5d(memory) and layout_of(memory).is_channels_last):
        return None
    return _armed_owner()


def _armed_owner() -> Any:
    """The owner armed last on this thread, if any."""
    thread = threading.get_ident()
    return next((owner() for ident, owner in reversed(_armed) if ident == thread and owner() is not None), None)


def _refused_trace(error: Optional[BaseException]) -> bool:
    """Whether ``error`` (dynamo's), or an error it came from, is a view strides refused."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if refused_by_strides(error) or _TRACE_REFUSED in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


RAN_BEFORE_THE_BREAK = (
    'channels last: dynamo refused this .view() of a channels-last tensor as it traced the code after a graph '
    'break, which a path first taken after the watched steps reached; the code before the break had run and '
    "written the model's buffers (running statistics), so the call is not run again. .reshape or .flatten "
    'instead of .view works in either layout; so does the view where no graph break comes before it.'
)
"""What a refused trace that cannot run again says."""


_modules: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # retrying wrapper -> its inner modules, last watched
_counted: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # retrying wrapper -> (module index, plain attribute)


_GONE = torch.nn.Module()  # stands for an inner module collected since: no buffers, no attributes of its own


def _network(wrapper: torch.nn.Module) -> list[torch.nn.Module]:
    """``wrapper`` and its inner modules as its last watched call found them (a module gone since: an empty one)."""
    return [wrapper, *(_GONE if (module := ref()) is None else module for ref in _modules[wrapper])]


def _buffer_versions(wrapper: torch.nn.Module) -> list[int]:
    """The version counters of the buffers of ``wrapper``'s modules (as its last watched call found them): each write
    in place moves one. Read through each module's own table, a buffer put in place since is read too."""
    return [
        buffer._version for module in _network(wrapper) for buffer in module._buffers.values() if buffer is not None
    ]


def _counts(wrapper: torch.nn.Module) -> list[tuple[dict, str, Any]]:
    """What ``wrapper``'s modules hold now in the plain attributes its last watched call found (``self.calls``): code
    before a graph break that counts runs again with the call, from these."""
    inner, found = _modules[wrapper], []
    for i, key in _counted[wrapper]:  # only these modules dereferenced: this runs on every compiled call
        module = wrapper if i == 0 else inner[i - 1]()
        namespace = vars(_GONE if module is None else module)  # an empty Sequential is falsy: no `or`
        if key in namespace:
            found.append((namespace, key, namespace[key]))
    return found


def _count_places(wrapper: torch.nn.Module) -> list[tuple[int, str]]:
    """Where ``wrapper``'s modules of classes outside torch (whose layers count in buffers, if at all) hold plain
    attributes: by module index, so that nothing kept holds the wrapper."""
    own = {id(vars(m)): i for i, m in enumerate(_network(wrapper)) if type(m).__module__.split('.')[0] != 'torch'}
    return [(own[id(namespace)], key) for namespace, key, _ in plain_attributes(wrapper) if id(namespace) in own]


def retrying_refused_traces(wrapper: torch.nn.Module) -> None:
    """A compiled ``wrapper``'s forward (module_calls.compiled_wrapper), from now on: where dynamo refuses a view NHWC
    strides cannot take as it traces the network again while an owner is armed on this thread, the owner places the
    view's maker (see above) and the call runs once more, traced again; otherwise the error as it was."""
    forward = vars(wrapper).get('forward')
    if forward is None:
        return
    installed = wrapper in _modules
    _modules[wrapper] = [weakref.ref(m) for m in list(wrapper.modules())[1:]]  # none holds the wrapper (one may)
    _counted[wrapper] = _count_places(wrapper)
    if installed:
        return

    def retrying(*args: Any, **kwargs: Any) -> Any:
        owner = _armed_owner()
        before, counts = (None, []) if owner is None else (_buffer_versions(wrapper), _counts(wrapper))
        try:
            return forward(*args, **kwargs)
        except Exception as error:
            if owner is None or not _refused_trace(error):
                raise
            if _buffer_versions(wrapper) != before:  # code before a graph break ran and wrote them: not twice
                _add_note(error, RAN_BEFORE_THE_BREAK)
                raise
        put_back(counts)  # what code before a graph break counted, counted again as the call runs again
        owner.late_view(None)  # out of the except: module hooks read a failed forward from sys.exc_info()
        owner.compiled_call(wrapper, args, rehearse=True)
        torch.compiler.reset()  # a graph cached before a graph break would keep the maker as it was (hooks unguarded)
        return forward(*args, **kwargs)

    retrying.__wrapped__ = forward  # type: ignore[attr-defined]  # the compiled function, found through it
    wrapper.forward = retrying


def arm(owner: Any) -> None:
    """Until :func:`disarm`, views NHWC strides refuse on this thread go to ``owner.late_view(tensor)``
    before they run again; the wrappers go on ``torch.Tensor`` with the first owner armed."""
    if not any(reference() is owner for _, reference in _armed):
        _armed.append((threading.get_ident(), weakref.ref(owner, lambda reference: disarm(None))))
    for name, wrapper in _WRAPPERS.items():
        setattr(torch.Tensor, name, wrapper)


def disarm(owner: Any) -> None:
    """``owner`` (None: only owners gone) hears no more; torch's own methods go back once no owner is armed."""
    _armed[:] = [(ident, ref) for ident, ref in _armed if ref() is not None and ref() is not owner]
    if not _armed:
        for name, method in _METHODS.items():
            setattr(torch.Tensor, name, method)


def _none_in_a_forked_process() -> None:
    """A process forked while a step is armed (a DataLoader's workers) inherits the wrappers: off there."""
    _armed.clear()
    disarm(None)


if hasattr(os, 'register_at_fork'):  # POSIX
    os.register_at_fork(after_in_child=_none_in_a_forked_process)


UNWATCHED_VIEW = (
    'channels last: this .view() of a channels-last tensor ran where no view watch could take it (in another '
    "thread than the training loop's, as autograd runs a GPU backward's hooks, or, in a plain loop, in code "
    'outside guard.on_batch() ... guard.on_batch_end() and outside guard.step()). A view of a weight or of a '
    "gradient: weights='contiguous' keeps them viewable (docs/conversion.md); of an activation: .reshape or "
    '.flatten instead of .view works in either layout.'
)
"""What :func:`explain_unwatched_view` adds to the error of a view that NHWC strides cannot take."""

SCRIPTED_VIEW = (
    'channels last: this .view() of a channels-last tensor ran inside TorchScript (torch.jit.script), '
    'which no view watch sees into. There, .reshape or .flatten instead of .view works in either layout; '
    "a view of a weight: weights='contiguous' keeps them viewable (docs/conversion.md); else mode='off' "
    'for this model.'
)
"""What :func:`explain_unwatched_view` adds instead where the view ran in TorchScript."""

COMPILED_VIEW = (
    'channels last: dynamo refused this .view() of a channels-last tensor as it traced, where no view watch '
    "runs. A torch.compile'd function that calls the model is traced before any eager run: compile the model "
    'itself (torch.compile(model)), whose calls the watch first runs eagerly and places the view for; else '
    '.reshape or .flatten instead of .view works in either layout.'
)
"""What :func:`explain_unwatched_view` adds instead where dynamo refused the view as it traced."""


def explain_unwatched_view(error: BaseException) -> None:
    """Add :data:`UNWATCHED_VIEW` (or :data:`SCRIPTED_VIEW`) to ``error`` where it is torch's "view size
    is not compatible", :data:`COMPILED_VIEW` where dynamo refused such a view as it traced (once).

    Example:
        >>> error = RuntimeError("view size is not compatible with input tensor's size and stride")
        >>> explain_unwatched_view(error)
        >>> 'weights=' in str(error) or any('weights=' in note for note in getattr(error, '__notes__', []))
        True
    """
    if type(error).__module__.startswith('torch._dynamo') and _refused_trace(error):
        note = COMPILED_VIEW
    elif refused_by_strides(error):
        note = SCRIPTED_VIEW if 'TorchScript' in str(error) else UNWATCHED_VIEW
    else:
        return
    if not any(said in getattr(error, '__notes__', ()) or said in str(error) for said in (note, RAN_BEFORE_THE_BREAK)):
        _add_note(error, note)


def _add_note(error: BaseException, note: str) -> None:
    if hasattr(error, 'add_note'):  # Python 3.11+: shown under the traceback
        error.add_note(note)
    else:
        error.args = (f'{error.args[0] if error.args else ""}\n{note}', *error.args[1:])
