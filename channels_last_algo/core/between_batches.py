"""Code between batches that ``.view()``s an NHWC tensor: run as NCHW runs it.

Between one training batch and the next a trainer runs its callbacks' and the model's batch-end
and epoch-end hooks, and its evaluation, whose epoch end reads what its steps kept
(``torch.cat(outputs).view(-1)``): a pruning pass (``torch.nn.utils.prune`` takes
``torch.abs(weight).view(-1)``), a ``parameters_to_vector`` of the weights, a metric that reads a
segmentation output through ``.view(-1)``. A view NHWC strides cannot take raises there ("view size
is not compatible with input tensor's size and stride") where NCHW's succeeds, and no step's watch
(:mod:`~channels_last_algo.core.viewed_outputs`) is on. While :class:`BetweenBatches` watches, such
a view of a channels-last tensor, or of what shape ops made of one meanwhile (``z.flatten(2).view(n, -1)``),
where NCHW's strides would take it (:mod:`~channels_last_algo.core.nchw_twins`), runs instead:

- of a weight or a weight's gradient: the weights go contiguous (``weights_viewed``), and it is a
  true view, as every later one;
- of any other tensor (``weight.data`` too, which a restride would leave holding old memory): on a
  channels-first copy, which in-place writes keep in step with the tensor while the watch lasts
  (:mod:`~channels_last_algo.core.aliased_copies`); one line names the place, once.

A ``.reshape()``, ``.flatten()`` or ``.contiguous()`` that copies where NCHW has a view (a max-norm
through ``weight.reshape(n, -1)``), or views where NCHW copies, is kept in step with its tensor, or
apart, as NCHW's is; the first write through it makes the weights contiguous if it is a weight's,
else names the place once.

Random numbers drawn like a channels-last tensor (a random pruning's ``torch.rand_like(weight)``) are drawn in the
memory order NCHW's tensor has (:mod:`~channels_last_algo.core.random_draws`), so they fall on the same elements.

Every other op runs as it is, at the cost of one Python call. The trainers turn the watch on at a
training batch's end, then at each training step's end (after its backward: gradient code there that
views now and then, a gradient norm every 50 steps), and at each evaluation batch's end, and off at the
next batch's start and at the end of fit or of an evaluation run, so no step's forward pays for it;
a process forked meanwhile (a DataLoader's workers, started between epochs) starts without it.

Example:
    >>> import torch
    >>> conv = torch.nn.Conv2d(3, 4, 1).to(memory_format=torch.channels_last)
    >>> lines = []
    >>> between = BetweenBatches(lambda tensor: False, lambda why: False, lines.append)
    >>> between.begin()
    >>> out = conv(torch.randn(2, 3, 4, 4).to(memory_format=torch.channels_last))
    >>> out.view(2, -1).shape                  # NHWC strides cannot take it: a copy does
    torch.Size([2, 64])
    >>> between.end()
    >>> len(lines)
    1
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch.overrides import TorchFunctionMode

from channels_last_algo.core.aliased_copies import AliasedCopies
from channels_last_algo.core.late_views import original, refused_by_strides
from channels_last_algo.core.layout import Layout, layout_of, unreadable_among
from channels_last_algo.core.module_calls import exit_mode
from channels_last_algo.core.nchw_twins import COPY_OR_VIEW, SHAPE_OPS, NchwTwins
from channels_last_algo.core.random_draws import DRAWS, drawn_in, nchw_draw_order
from channels_last_algo.core.view_watch import VIEWS, calling_code, written_through

__all__ = ['BetweenBatches']

_CHANNELS_LAST = (Layout.NHWC, Layout.NDHWC)
_WATCHING: weakref.WeakSet = weakref.WeakSet()  # the watches whose mode is on in this process


class BetweenBatches:
    """Runs the views NHWC strides refuse, from :meth:`begin` to :meth:`end`, but not while
    :meth:`pause`\\ d (a batch runs); :meth:`resume` after one.

    Args:
        weight_gradient: whether a tensor is the gradient of one of the model's weights.
        weights_viewed: called for a view of a weight (a parameter) or of a weight's gradient: makes the
            model's weights contiguous, True where they are now.
        found: takes the line that names a place where a view ran on a copy (once a place).
    """

    def __init__(
        self,
        weight_gradient: Callable[[torch.Tensor], bool],
        weights_viewed: Callable[[str], bool],
        found: Callable[[str], None],
    ) -> None:
        self._weight_gradient = weight_gradient
        self._weights_viewed = weights_viewed
        self._found = found
        self._places: set[str] = set()
        self._mode: Optional[_FailingViews] = None
        self.wanted = False  # between begin and end
        self._stepped = False  # a training step ran since the last batch_end

    def begin(self) -> None:
        """A training batch is over: watch until the next one starts (:meth:`pause`), and after each
        batch (:meth:`resume`) until :meth:`end`."""
        self.wanted = True
        self.resume()

    def resume(self, after_evaluation: bool = False) -> None:
        """Watch again if :meth:`begin` wants it; ``after_evaluation``: also if not, until the next batch."""
        if (self.wanted or after_evaluation) and self._mode is None:
            self._mode = _FailingViews(self)
            self._mode.__enter__()
            _WATCHING.add(self)

    def batch_end(self, evaluation_loop: bool = False) -> None:
        """A batch is over: :meth:`begin` if it ran a training step; after a batch of a named ``evaluation_loop``
        (whose caller ends it: :meth:`end`) watch until the next batch, over the loop's epoch-end code."""
        if self._stepped:
            self._stepped = False
            self.begin()
        else:
            self.resume(after_evaluation=evaluation_loop)

    def pause(self, step: bool = False) -> None:
        """A batch, or its training ``step``, starts: no watch until it is over."""
        self._stepped = self._stepped or step
        mode, self._mode = self._mode, None
        _WATCHING.discard(self)
        if mode is not None:
            exit_mode(mode)

    def end(self) -> None:
        self.wanted = False
        self.pause()

    def view(self, func: Any, args: tuple, kwargs: dict, copies: AliasedCopies) -> Any:
        """``func(*args, **kwargs)``, a view NHWC strides refused: a true one once the weights are
        contiguous, else one of a copy kept in step."""
        tensor, where = args[0], calling_code()
        weight_or_gradient = isinstance(tensor, torch.nn.Parameter) or self._weight_gradient(tensor)
        if weight_or_gradient and self._weights_viewed(f'a weight is viewed at {where}, between batches'):
            if layout_of(tensor) not in _CHANNELS_LAST:
                return func(*args, **kwargs)
        if where not in self._places:
            self._places.add(where)
            self._found(
                f'the .view() at {where}, between batches, ran on a channels-first copy of an NHWC '
                'tensor (every time: .reshape there instead keeps the speed); writes through it reach the tensor'
            )
        return copies.view(func, tensor, args[1:], kwargs)

    def written(self, tensor: torch.Tensor, where: str, how: str) -> None:
        """A write went through what a shape op at ``where`` made of ``tensor`` (a copy here, an alias in NCHW, or
        the reverse), and reached what NCHW's reaches. For a weight or its gradient the weights go contiguous, where
        that op is a view again; any other place is named once."""
        weight_or_gradient = isinstance(tensor, torch.nn.Parameter) or self._weight_gradient(tensor)
        if weight_or_gradient and self._weights_viewed(f'a weight is {how}, between batches'):
            return
        if where not in self._places:
            self._places.add(where)
            self._found(f'{how}, between batches: kept in step as in NCHW (every time)')


class _FailingViews(TorchFunctionMode):
    """The mode :class:`BetweenBatches` runs: a view that raises, of a channels-last tensor or of what shape ops
    made of one (``z.flatten(2)``), where NCHW's strides take it, runs on ``watch.view``; writes through the
    copies it made reach their tensors."""

    def __init__(self, watch: BetweenBatches) -> None:
        super().__init__()
        self.watch = watch
        self.copies = AliasedCopies()
        self.twins = NchwTwins()  # the strides NCHW would give what shape ops make of channels-last tensors

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs, func = kwargs or {}, original(func)  # torch's view, where a late-view wrapper is on
        if torch.compiler.is_compiling() or unreadable_among(types, (args, kwargs)):
            return func(*args, **kwargs)
        tensor = args[0] if args and isinstance(args[0], torch.Tensor) else None
        order = self._nchw_draw_order(func, args, kwargs) if func in DRAWS and tensor is not None else None
        if order is not None:  # random numbers NCHW puts on other elements (a random pruning's rand_like(weight))
            return drawn_in(func, args, kwargs, order)
        followed = func in SHAPE_OPS and tensor is not None and self._followed(tensor)
        try:
            result = func(*args, **kwargs)
        except RuntimeError as error:  # a view NCHW's strides take (its twin's) runs on a copy
            if not followed or func not in VIEWS or not refused_by_strides(error):
                raise
            if self.twins.run(func, args, kwargs) is None:
                raise
            return self.watch.view(func, args, kwargs, self.copies)
        self.copies.written(func, args, kwargs)
        if followed:  # a shape op's result (z.flatten(2), z[:, :2]) keeps the strides NCHW would give it
            ran = self.twins.run(func, args, kwargs)
            if ran is not None:
                if func in COPY_OR_VIEW:  # a copy where NCHW has an alias (weight.reshape(n, -1)), or the reverse
                    result = self.copies.as_in_nchw(tensor, result, *ran, written_through(func, self.watch.written))
                self.twins.note(result, ran[1])
        return result

    def _nchw_draw_order(self, func: Any, args: tuple, kwargs: dict) -> Optional[tuple]:
        """The order NCHW draws ``func``'s numbers in for a channels-last tensor, where it differs from this one's."""
        twin = self.twins.twin(args[0]) if self._followed(args[0]) else None
        return None if twin is None else nchw_draw_order(func, args, kwargs, twin)

    def _followed(self, tensor: torch.Tensor) -> bool:
        """A channels-last tensor, or one a shape op made of one while the mode was on."""
        return tensor in self.twins or layout_of(tensor) in _CHANNELS_LAST


def _none_in_a_forked_process() -> None:
    """A forked process (a DataLoader worker) inherits the mode stack: the watches end there."""
    for watch in list(_WATCHING):
        watch.end()


if hasattr(os, 'register_at_fork'):  # POSIX
    os.register_at_fork(after_in_child=_none_in_a_forked_process)
