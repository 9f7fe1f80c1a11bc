"""Which tensors of a batch go NHWC: the images, not every 4D/5D tensor.

A batch can hold 4D/5D tensors that are not images: a ``(N, T, H, W)`` frame stack, masks,
dense targets, anything a model ``.view()``s, and ``.view()`` raises on NHWC strides (in the
user's forward, with PyTorch's "view size is not compatible" error that never names this
package). :class:`InputSelection` decides per batch structure, by the ``inputs`` option:

- ``'auto'`` (the default): the tensors the model feeds to a convolution. On the first batch of
  each structure (a training batch, an evaluation batch built otherwise) a ``TorchFunctionMode``
  follows where its 4D/5D tensors flow through the forward (inside module calls, from the first
  outermost one to the end of the first that runs a convolution): a tensor is an image when a
  convolution's input derives from it (through any ops before that convolution), unless the
  model calls ``.view()`` on it (or on what it derives from it before a convolution) with a
  shape that NHWC strides cannot take, or reorders its dimensions so that the convolution takes
  another one as its channels (a ``(N, H, W, C)`` batch permuted to ``(N, C, H, W)``: NHWC as it
  comes). That first batch goes
  NHWC where a guess says so (in the guard: its channel count is some convolution's
  ``in_channels``); a ``.view()`` that the
  guess made fail runs on a contiguous copy instead, and when the following ends, the guess's
  NHWC copies that no convolution took are channels first again, in the batch's own tensors (a
  dense target the loss views). Where no convolution is seen (a compiled forward, whose graph is
  not followed) the guess stands. The choice is logged and kept (:attr:`InputSelection.chosen`);
  later batches of that structure are converted at once. A chosen tensor that a watched step uses
  where NHWC strides change the result (given random numbers, viewed, written through a reshape:
  :mod:`~channels_last_algo.core.viewed_outputs`) is left as it comes from the next batch on
  (:meth:`InputSelection.leave`).
- ``'all'``: every 4D/5D tensor (what ``batch_to_channels_last`` does).
- a list of keys and positions (``['image']``, ``[0]``), or of paths (``[('inputs', 'rgb')]``):
  the tensors whose path in the batch starts with one of them.
- a predicate ``fn(path, tensor) -> bool``, ``path`` a tuple of keys and positions.

A batch is walked by :mod:`~channels_last_algo.core.batch_tree` (tuples, lists, dicts and every
mapping, dataclasses, namespaces): a path's keys are dict keys, positions, and field or attribute
names, so ``inputs=['image']`` also names a dataclass field ``image``.

Example:
    >>> import torch
    >>> class Net(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.conv = torch.nn.Conv2d(3, 4, 1)
    ...     def forward(self, batch):
    ...         return self.conv(batch['image']).sum() + batch['frames'].view(2, 80).sum()
    >>> batch = {'image': torch.randn(2, 3, 4, 4), 'frames': torch.randn(2, 5, 4, 4)}
    >>> selection, restride = InputSelection('auto'), lambda t: t.to(memory_format=torch.channels_last)
    >>> first = selection.start(batch, lambda tensor: True, restride)   # guess: every 4D tensor
    >>> _ = Net()(first)        # the view of the NHWC frame stack runs on a copy
    >>> first['frames'].is_contiguous()     # and once the forward is over, the guess is undone
    True
    >>> selection.describe(batch)
    "batch['image'] (fed to a convolution); left as they came: batch['frames'] (viewed in a shape NHWC cannot take)"
    >>> out = selection.convert(batch, restride)
    >>> out['image'].is_contiguous(memory_format=torch.channels_last), out['frames'].is_contiguous()
    (True, True)
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Optional, Union

import torch
from torch.utils.weak import WeakIdKeyDictionary

from channels_last_algo.core.batch_tree import Path, leaves, map_leaves, path_name
from channels_last_algo.core.input_flow import InputFlow
from channels_last_algo.core.layout import channels_last_contiguous, is_4d_or_5d
from channels_last_algo.core.module_calls import compiled_wrapper, exit_mode, settle_hooks, subscribe, unsubscribe

__all__ = ['Inputs', 'InputSelection', 'check_inputs']

log = logging.getLogger(__name__)

Predicate = Callable[[Path, torch.Tensor], bool]
Inputs = Union[str, Sequence[Union[Hashable, Path]], Predicate]

_RULES = ('auto', 'all')


def check_inputs(value: Any) -> bool:
    """True when ``value`` is a valid ``inputs`` option: ``'auto'``, ``'all'``, a non-empty list
    or tuple of keys, positions and paths, or a callable."""
    if isinstance(value, str):
        return value in _RULES
    if callable(value):
        return _takes_path_and_tensor(value)
    return (
        isinstance(value, (list, tuple))
        and len(value) > 0
        and all(isinstance(entry, (str, int, tuple)) and not isinstance(entry, bool) for entry in value)
    )


def _takes_path_and_tensor(predicate: Callable[..., Any]) -> bool:
    """Whether ``predicate`` can be called as ``predicate(path, tensor)`` (True where its signature is hidden)."""
    try:
        inspect.signature(predicate).bind(None, None)
    except TypeError:
        return False
    except ValueError:  # a builtin without a signature: its first call will tell
        pass
    return True


class InputSelection:
    """The ``inputs`` option at work: which 4D/5D tensors of each batch structure go NHWC.

    Args:
        inputs: ``'auto'``, ``'all'``, a list of keys / positions / paths, or a predicate
            (see the module docstring).

    Attributes:
        chosen: in ``'auto'`` mode, the paths chosen for each batch structure seen so far.
    """

    def __init__(self, inputs: Inputs = 'auto') -> None:
        if not check_inputs(inputs):
            raise ValueError(
                f"inputs must be 'auto', 'all', a non-empty list of batch keys, positions or paths, or a "
                f'predicate fn(path, tensor) -> bool; got {inputs!r}'
            )
        self.inputs = inputs
        self.chosen: dict[Any, frozenset[Path]] = {}
        self._left_because: dict[Any, dict[Path, str]] = {}  # why a tensor the forward saw was left as it came
        self._flow: Optional[InputFlow] = None
        self._structure: Any = None
        self._restrided: dict[Path, torch.Tensor] = {}  # the NHWC copies the first batch's guess made
        self._first_channels_first: frozenset[Path] = frozenset()  # the first batch's tensors it ran channels first
        self._missed = False  # a first batch ran channels first a tensor later batches give NHWC (see missed)
        self._calls: list[bool] = []  # the module calls under way, each: followed inside or not
        self._named_checked: set[str] = set()  # the batch structures a list of inputs was checked against
        self._current: Any = None  # the structure of the batch put last
        self._converted = WeakIdKeyDictionary()  # its tensors this selection made NHWC -> their paths
        self._left_by_use: dict[Any, dict[Path, str]] = {}  # left as they came for a use found in a step, and why

    def __repr__(self) -> str:
        return repr(self.inputs) if not callable(self.inputs) else getattr(self.inputs, '__name__', 'predicate')

    @staticmethod
    def _structure_of(batch: Any) -> Any:
        """What the choice is kept for: the paths of the batch's leaves and of its 4D/5D tensors
        (one walk of the batch)."""
        pairs = leaves(batch)
        return tuple(path for path, _ in pairs), tuple(path for path, leaf in pairs if is_4d_or_5d(leaf))

    def known(self, batch: Any) -> bool:
        """True when the tensors to convert in ``batch`` are known (always, except in ``'auto'``
        mode before a batch of its structure went through :meth:`start` / :meth:`finish`)."""
        return self.inputs != 'auto' or self._structure_of(batch) in self.chosen

    def selected(self, path: Path, tensor: torch.Tensor, structure: Any = None) -> bool:
        """Whether the 4D/5D tensor at ``path`` goes NHWC."""
        if self.inputs == 'auto':
            return path in self.chosen.get(structure, frozenset())
        if self.inputs == 'all':
            return True
        if callable(self.inputs):
            return bool(self.inputs(path, tensor))
        prefixes = [entry if isinstance(entry, tuple) else (entry,) for entry in self.inputs]
        return any(path[: len(prefix)] == prefix for prefix in prefixes)

    def convert(self, batch: Any, restride: Callable[[torch.Tensor], torch.Tensor]) -> Any:
        """``batch`` with ``restride`` applied to its selected tensors (the containers that hold them
        rebuilt, the rest as they came); in ``'auto'`` mode the structure must be :meth:`known`."""
        settle_hooks()  # module hooks left idle by a following that ended inside a module call
        structure = self._structure_of(batch)
        if isinstance(self.inputs, (list, tuple)) and structure not in self._named_checked:
            self._check_named(structure[1])
            self._named_checked.add(structure)
        self._begin_batch(structure)

        def restride_selected(path: Path, leaf: Any) -> Any:
            selected = is_4d_or_5d(leaf) and self.selected(path, leaf, structure)
            return self._noted(path, leaf, restride(leaf)) if selected else leaf

        return map_leaves(batch, restride_selected)

    def _begin_batch(self, structure: Any) -> None:
        self._current = structure
        self._converted = WeakIdKeyDictionary()

    def _noted(self, path: Path, given: torch.Tensor, restrided: torch.Tensor) -> torch.Tensor:
        """``restrided``, noted as the batch's tensor at ``path`` where the restride copied ``given``."""
        if restrided is not given:
            self._converted[restrided] = path
        return restrided

    def path_of(self, tensor: torch.Tensor) -> Optional[Path]:
        """The path in the batch put last of ``tensor``, where this selection made it NHWC (a copy); else None."""
        return self._converted.get(tensor)

    def leave(self, paths: frozenset[Path], why: str) -> Optional[list[Path]]:
        """In ``'auto'`` mode, the tensors at ``paths`` of the batch put last are left as they come from the next
        batch of that structure on, for the use ``why`` says (a ``.view()``, a draw of random numbers, a write
        through a reshape: what NHWC strides change and the batch as it came does not); the paths newly left.
        None in the other modes, where the user chose the tensors."""
        if self.inputs != 'auto':
            return None
        left = self._left_by_use.setdefault(self._current, {})
        new = sorted(set(paths) - set(left), key=path_name)
        left.update({path: why for path in new})
        if self._current in self.chosen:
            self.chosen[self._current] = self.chosen[self._current] - paths
            self._left_because.setdefault(self._current, {}).update(left)
        return new

    def put(
        self, batch: Any, guess: Callable[[torch.Tensor], bool], restride: Callable[[torch.Tensor], torch.Tensor]
    ) -> Any:
        """``batch`` through :meth:`convert` where it is :meth:`known`, else through :meth:`start`."""
        return self.convert(batch, restride) if self.known(batch) else self.start(batch, guess, restride)

    def _check_named(self, candidates: Sequence[Path]) -> None:
        """ValueError when an entry of the ``inputs`` list names no 4D/5D tensor of a batch whose 4D/5D
        tensors are at ``candidates`` (a key or position that is not there: nothing would go NHWC)."""
        for entry in self.inputs:
            prefix = entry if isinstance(entry, tuple) else (entry,)
            if not any(path[: len(prefix)] == prefix for path in candidates):
                found = ', '.join(path_name(path) for path in candidates) or 'none'
                raise ValueError(
                    f'inputs={self.inputs!r}: {entry!r} names no 4D or 5D tensor of the batch (its 4D/5D tensors: '
                    f"{found}); name the image tensors' keys or positions, or use inputs='auto'"
                )

    def start(
        self, batch: Any, guess: Callable[[torch.Tensor], bool], restride: Callable[[torch.Tensor], torch.Tensor]
    ) -> Any:
        """``'auto'``: ``batch`` with ``restride`` applied to the 4D/5D tensors ``guess`` picks, and
        those tensors followed through what runs until :meth:`finish`."""
        self.finish()
        self._structure = self._structure_of(batch)
        self._begin_batch(self._structure)
        guessed: set[Path] = set()

        def restride_guessed(path: Path, leaf: Any) -> Any:
            if not (is_4d_or_5d(leaf) and guess(leaf)):
                return leaf
            guessed.add(path)
            return self._noted(path, leaf, restride(leaf))

        first = map_leaves(batch, restride_guessed)
        given = dict(leaves(batch))
        followed = [(path, leaf) for path, leaf in leaves(first) if is_4d_or_5d(leaf)]
        if not followed:
            self.chosen[self._structure] = frozenset()
            return batch
        self._restrided = {path: leaf for path, leaf in followed if leaf is not given.get(path)}
        self._first_channels_first = frozenset(path for path, leaf in followed if not channels_last_contiguous(leaf))
        self._flow = InputFlow(followed, frozenset(guessed))
        subscribe(self)  # module calls: channels_last_algo.core.module_calls
        return first

    def entered(self, module: torch.nn.Module, args: tuple) -> None:
        """Follow inside the call, except inside a compiled module (where following would make
        torch.compile trace, and later recompile, the graph with the mode on)."""
        outer = self._calls[-1] if self._calls else None
        compiled = compiled_wrapper(module)
        follow = not compiled and outer is not False
        if follow and not outer:
            self._flow.__enter__()
        elif outer and not follow:
            exit_mode(self._flow)
        self._calls.append(follow)

    def left(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any, failed: bool) -> None:
        """The call is over: the mode as the caller had it; the following ends after the outermost
        call that ran a convolution, or that failed."""
        if not self._calls:  # a call that began before the following did
            return
        follow = self._calls.pop()
        outer = self._calls[-1] if self._calls else False
        if follow and not outer:
            exit_mode(self._flow)
        elif outer and not follow:
            self._flow.__enter__()
        if not self._calls and (self._flow.convolutions or failed):  # the network ran, or the step failed
            self.finish()

    @property
    def following(self) -> bool:
        """Whether a first batch's tensors are being followed now (from :meth:`start` to :meth:`finish`)."""
        return self._flow is not None

    def finish(self) -> None:
        """Stop following and keep what was found for the batch structure; nothing if not started.

        Following runs inside module calls only (from the outermost module's call to its return),
        so it never outlives a forward; it ends by itself after the first outermost call that ran
        a convolution, or that failed."""
        flow, self._flow = self._flow, None
        if flow is None:
            return
        unsubscribe(self)
        if self._calls and self._calls[-1]:  # called from inside a followed module call
            exit_mode(flow)
        self._calls = []
        # no convolution seen (a compiled forward, or none ran before the batch ended): keep the guess
        left = self._left_by_use.get(self._structure, {})
        chosen = (flow.fed if flow.convolutions else flow.guessed) - flow.viewed - set(left)
        self.chosen[self._structure] = chosen
        self._missed = self._missed or bool(chosen & self._first_channels_first)
        self._left_because[self._structure] = {
            **{path: 'its dimensions reordered before a convolution' for path in flow.reordered - flow.fed},
            **{path: 'viewed in a shape NHWC cannot take' for path in flow.viewed},
            **left,
        }
        self._undo_guess(chosen)
        log.info('channels last inputs: %s', self._describe(self._structure))

    def missed(self) -> bool:
        """Whether a first batch since the last call ran channels first a tensor that the later batches of its
        structure give NHWC (the guess missed it: a convolution whose channel count no module tells): what ran on
        it ran on other strides than it will from now on."""
        missed, self._missed = self._missed, False
        return missed

    def _undo_guess(self, chosen: frozenset[Path]) -> None:
        """The NHWC copies the guess made of tensors that are not chosen, channels first again in
        the batch's own tensor objects, so a ``.view()`` after the forward (in the loss) works: each
        one's ``.data`` becomes a contiguous copy (same values and autograd history). Only copies
        made here change, never the user's tensors, nor a tensor that requires grad."""
        restrided, self._restrided = self._restrided, {}
        for path, tensor in restrided.items():
            if path not in chosen and not tensor.requires_grad:
                tensor.data = tensor.data.contiguous()

    def describe(self, batch: Any) -> str:
        """Which tensors of ``batch`` go NHWC and why, in one line (for logs)."""
        return self._describe(self._structure_of(batch))

    def _describe(self, structure: Any) -> str:
        paths = structure[1]
        chosen = self.chosen.get(structure, frozenset())
        because = self._left_because.get(structure, {})
        kept = ', '.join(path_name(p) for p in paths if p in chosen) or 'none'
        left = ', '.join(path_name(p) + (f' ({because[p]})' if p in because else '') for p in paths if p not in chosen)
        return f'{kept} (fed to a convolution)' + (f'; left as they came: {left}' if left else '')
