"""Activations that user code ``.view()``s in a shape NHWC strides cannot take: found on the first
step, made channels first where they are made.

``x.view(-1, 16 * 5 * 5)`` after a convolution and a pool (the LeNet flatten), a loss's
``logits.view(n * k, h * w)`` or a hook's ``output.view(n, -1)`` raise on an NHWC activation ("view size is not
compatible with input tensor's size and stride"). While :class:`ViewedOutputs` watches a step (its mode:
:mod:`~channels_last_algo.core.view_watch`), a view that fails so runs on a channels-first copy instead, which
in-place writes keep in step with the activation (:mod:`~channels_last_algo.core.aliased_copies`), and the module
whose output the viewed tensor derives from (through any ops, but no other module) is noted. From the step's end
(its backward may run the forward again: activation checkpointing) that module's NHWC outputs are made channels first
(one copy, an exit in the layout audit) by a forward hook before the module's own, so the view aliases as in NCHW.
The same holds where a ``.reshape()``, ``.flatten()``, ``.unflatten()`` or ``.contiguous()`` copies an NHWC tensor
that NCHW would have aliased (itself or a view) and an in-place write then goes through either of them: the write
reaches the other, and the module is noted; and where NHWC returns a view NCHW would copy
(``z.permute(0, 2, 3, 1).reshape(-1, c)``) and one of them is written (:mod:`~channels_last_algo.core.nchw_twins`
tells which case is which). A module called more than once a step (a pool shared by two stages) is passed over for the
modules its viewed output came from. A batch tensor the guard made NHWC is left as it comes from the next batch on
(:meth:`InputSelection.leave`). A view of a tensor that neither a module nor the guard made (a gradient in a tensor
hook, whose layout its consumers decide), or that a TorchScript module made (it takes no hooks), cannot be placed so:
the watch then stays on for every step, at the cost of following each op. An extension op given 4D/5D tensors runs as
in NCHW (:mod:`~channels_last_algo.core.extension_ops`); a light watch, of extension ops only, then stays on for every
step. A view first reached on a later step starts the watch there (:mod:`~channels_last_algo.core.late_views`); a step
whose batch ran an image channels first that later batches give NHWC (:meth:`InputSelection.missed`) is watched again.

Example:
    >>> import torch
    >>> net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU())
    >>> net = net.to(memory_format=torch.channels_last)
    >>> watch = ViewedOutputs(net)
    >>> x = torch.randn(2, 3, 6, 6).to(memory_format=torch.channels_last)
    >>> with watch:
    ...     flat = net(x).view(2, -1)
    >>> watch.placed
    ['1']
    >>> net(x).is_contiguous()
    True
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_leaves

from channels_last_algo.core.backward_hooks import BackwardHooks, hook_first
from channels_last_algo.core.batch_tree import BatchTensor, path_name
from channels_last_algo.core.between_batches import BetweenBatches
from channels_last_algo.core.channels_first_outputs import Placements
from channels_last_algo.core.inputs import InputSelection
from channels_last_algo.core.late_views import arm, disarm, retrying_refused_traces
from channels_last_algo.core.module_calls import (
    compiled_network,
    compiled_wrapper,
    eager_forward,
    exit_mode,
    is_torchscript,
    on_mode_stack,
    on_top_of_mode_stack,
    paused,
    subscribe,
    unsubscribe,
)
from channels_last_algo.core.saved_state import leaving_no_trace
from channels_last_algo.core.view_watch import ViewWatch, contiguous_gradient, nhwc

__all__ = ['ViewedOutputs']

log = logging.getLogger(__name__)


class ViewedOutputs:
    """Watches steps (``with watch:`` or :meth:`start` / :meth:`stop`) for views NHWC makes fail, and
    makes the outputs they view channels first from then on. ``start(whole_step=False)`` watches one
    forward only: it stops by itself when the outermost module call returns (an evaluation batch), or a
    batch of a named loop (:meth:`begin`) with its own code, until :meth:`end`.

    Args:
        model: the model whose module paths name the placed hooks.

    Attributes:
        placed: paths of the modules whose outputs are now made channels first (a module the forward
            calls from outside the model, a teacher's, by its class, until :meth:`close`).
        unplaced: where a view of a tensor no module made ran on a copy (``file:line``); the watch
            stays on for every step while there is one.
        extensions: where an extension op takes 4D/5D tensors; a light watch of such ops stays on
            for every step while there is one.
        between: the watch between batches (:mod:`~channels_last_algo.core.between_batches`),
            paused by each batch and resumed after each evaluation forward.
        loop: the evaluation loop of the batch begun last, where its caller named one.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        weights_viewed: Callable[[str], bool] = lambda why: False,
        inputs: Optional[InputSelection] = None,
    ) -> None:
        self._paths = weakref.WeakKeyDictionary({m: name for name, m in model.named_modules()})
        self._weights_viewed = weights_viewed
        self._inputs = inputs  # the batch tensors the guard made NHWC, which it can leave as they come
        self.placed: list[str] = []
        self._placements = Placements(model)  # the modules placed, and their hooks
        self.unplaced: list[str] = []
        self.extensions: list[str] = []
        self._mode: Optional[ViewWatch] = None
        self.lasting = False  # the first training step's watch goes on past its end (see end)
        self.stepping = False  # a training step began (begin) and has not ended: a batch begun inside it is its own
        self._hooks = BackwardHooks()  # the model's backward hooks, watched while a step is
        self._hooked_weights: weakref.WeakSet = weakref.WeakSet()  # weights whose hooks get contiguous gradients
        self._to_hook: list[torch.nn.Parameter] = []  # those found in this watch: hooked when it stops
        self._new: list[str] = []
        self._whole_step = True
        self._depth = 0  # module calls under way
        self._model = weakref.ref(model)
        self._step_watched = False  # a whole training step was watched
        self._trial_watched = False  # a channels-last trial step of auto mode was watched
        self._forwards_watched: set[tuple] = set()  # (model.training, loop) of the batches whose forward was watched
        self.loop: Optional[str] = None  # its batch and the code after it watched until its end
        self._rehearsed = weakref.WeakKeyDictionary()  # compiled wrapper -> the modes (training) it ran eagerly in
        self._paused_for: Optional[torch.nn.Module] = None  # the compiled wrapper running without the mode
        self._one_tensor_out: weakref.WeakSet = weakref.WeakSet()  # modules seen returning one tensor
        self._rehearsing = False  # a compiled network's eager rehearsal runs
        self._late_places: set[str] = set()  # where such views ran
        self._late = False  # the watch began late, inside a step or batch (late_view)
        self._rearm: set[bool] = set()  # kinds of batch (whole_step) to watch next, for a view first reached late
        self._armed: Optional[bool] = None  # armed for late views: the kind of batch (whole_step); None: not armed
        self.between = BetweenBatches(self.weight_gradient, weights_viewed, lambda line: self._new.append(line))

    @property
    def watch(self) -> Optional[ViewWatch]:
        """The watch of the step or forward under way; None when none is."""
        return self._mode

    @property
    def watching(self) -> bool:
        """Whether a step or a forward is being watched now."""
        return self._mode is not None

    def begin(self, whole_step: bool, loop: Optional[str] = None) -> None:
        """At a batch (``whole_step=False``: its forward; in evaluation, of a named ``loop``: until :meth:`end`)
        or a training step's start: watch the first training step, the first batch in each of the model's modes and
        loops (an evaluation path may view what training does not), and every one while a view could not be placed;
        the extension ops of every other one. A batch begun inside a step (a plain loop's) is the step's."""
        if self.stepping and not whole_step:
            return
        self.stepping = whole_step
        self.between.pause(step=whole_step)
        training = self._training()
        self.loop = self.loop if whole_step else None if training else loop  # training: a step's watch follows
        seen = (
            self._step_watched
            if whole_step
            else (training, self.loop) in self._forwards_watched or (training and self._step_watched)
        )
        self._watch_or_arm(whole_step, seen)

    def _watch_or_arm(self, whole_step: bool, seen: bool) -> None:
        """Watch where not ``seen``, while a view could not be placed, after a view first reached late (``rearm``), and
        the extension ops while some ran; else arm for a view no watch follows, until the step or batch ends."""
        rearm = whole_step in self._rearm
        if self.unplaced or not seen or self.extensions or rearm:
            self._rearm.discard(whole_step)
            self.start(whole_step, light=seen and not self.unplaced and not rearm)
        if (whole_step or self.loop is not None) and (self._mode is None or self._mode.light):
            self._armed = whole_step  # core/late_views.py
            arm(self)

    def start_trial(self, channels_last: bool) -> bool:
        """Watch one of auto mode's trial steps in ``channels_last`` as training would: the first whole, the later ones
        as later training steps; whether it is watched (or armed). A channels-first one has nothing to watch."""
        if channels_last:
            self._watch_or_arm(True, seen=self._trial_watched)
            self._trial_watched = True
        return channels_last

    def _training(self) -> bool:
        model = self._model()
        return True if model is None else model.training

    def end(self, training: bool, lasting: bool = False) -> list[str]:
        """At a training step's end (``training``), or the next batch: stop; what was found; the watch between
        batches resumes. ``lasting``: the first training step's watch goes on (until :meth:`stop`), over the code
        between the backward and the optimizer step, which reads the gradients (``p.grad.view(-1)``)."""
        first, self.stepping = training and self.watching and not self._step_watched, self.stepping and not training
        self._step_watched = self._step_watched or (training and self.watching)
        if lasting and first:
            self.lasting = True
            found, self._new = self._new, []
            return found
        found = self.stop()
        self.between.resume()  # where wanted, also over a training step's code after its backward, on every step
        return found

    def late_view(self, tensor: Optional[torch.Tensor]) -> None:
        """A view NHWC strides refused where no watch was on (code first run later; None: in a compiled graph): a
        watch starts now, for the rest of the step or batch, and takes it; the next batch of its kind is watched
        whole, to find the maker."""
        self._rearm.add(bool(self._armed))
        self._late = True
        self._rehearsed.clear()  # a compiled network run eagerly (past dynamo's recompile limit) is rehearsed again
        if self._mode is not None:
            self._mode.light = False  # a light watch (extension ops) follows everything from now on
        self.start()
        if tensor is not None and not nhwc(tensor):  # a view of a channels-last tensor (z.flatten(2)): NHWC strides
            self._mode.flattened[tensor] = True

    def gradient_hook_found(self, weight: torch.nn.Parameter, how: str) -> None:
        """A hook on ``weight`` uses the gradient it is given as ``how`` says, which takes it contiguous:
        from the next step on it is given the gradient contiguous (a hook put before the user's)."""
        if weight in self._hooked_weights:
            return
        self._hooked_weights.add(weight)
        self._to_hook.append(weight)
        model = self._model()
        name = next((n for n, p in model.named_parameters() if p is weight), 'a weight') if model else 'a weight'
        self._new.append(f'the gradient of {name} reaches its hooks contiguous from the next step on (the hook {how})')

    def weight_gradient(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is the gradient of one of the model's parameters."""
        model = self._model()
        return model is not None and any(tensor is p.grad for p in model.parameters())

    def start(self, whole_step: bool = True, light: bool = False) -> None:
        """Watch until :meth:`stop` (``whole_step``), or during the next outermost module call (its
        mode entered with that call, so none outlives a batch whose forward never runs); a
        forward-only watch already under way becomes a whole-step one. ``light``: extension ops only."""
        if self.watching:
            self._whole_step = True
            if self._paused_for is None and not on_mode_stack(self._mode):  # its forward has not begun
                self._mode.__enter__()
        else:
            self._whole_step = whole_step
            batch_path = self._inputs.path_of if self._inputs is not None else lambda tensor: None
            self._mode, self._depth = ViewWatch(self, light=light, batch_path=batch_path), 0
            subscribe(self)  # after any mode a module call enters, so that mode leaves first
            if whole_step:
                self._mode.__enter__()
        if self._whole_step and not self._mode.light and torch._C._current_graph_task_id() == -1:  # not in a backward,
            self._hooks.watch(self._model(), self)  # whose hook tables must not change under it

    def stop(self) -> list[str]:
        """Stop watching; return what was found since the last stop, one line each (paths and code places)."""
        mode, self._mode, self.lasting, self._late, self._armed = self._mode, None, False, False, None
        self.stepping = False
        disarm(self)
        paused, self._paused_for = self._paused_for, None
        self._hooks.restore()
        self._placements.settle()
        if self._inputs is not None and self._inputs.missed():  # its batch ran an image channels first: again NHWC
            self._rearm.add(self._whole_step)
        for weight in self._to_hook:  # outside the backward, whose hook tables must not change under it
            hook_first(weight, contiguous_gradient)
        self._to_hook = []
        if mode is not None and paused is None:
            exit_mode(mode)
        if mode is not None:
            unsubscribe(self)
        found, self._new = self._new, []
        return found

    def close(self) -> None:
        """At a run's end: the watch between batches ends; the hooks on modules outside the model come off."""
        self.between.end()
        for module in self._placements.release_outside():
            self.placed.remove(self._name(module))

    def __enter__(self) -> ViewedOutputs:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def entered(self, module: torch.nn.Module, args: tuple) -> None:
        self._depth += 1
        if self._mode is None:
            return
        if self._depth == 1 and not self._whole_step and self._paused_for is None and not on_mode_stack(self._mode):
            self._mode.__enter__()  # a forward-only watch: the forward begins
        followed = args and not self._mode.light and hasattr(module, 'follow_nchw_input')
        twin = self._mode.twins.twin(args[0]) if followed else None
        if twin is not None:  # a layer that lays out what it makes as NCHW would (NCHWMaskDropout's noise)
            module.follow_nchw_input(args[0], twin)
        if compiled_wrapper(module):
            retrying_refused_traces(module)  # for a path its network first takes after the watched steps
            self.compiled_call(module, args, rehearse=module.training not in self._rehearsed.get(module, ()))

    def compiled_call(self, wrapper: torch.nn.Module, args: tuple, rehearse: bool) -> None:
        """Before a compiled ``wrapper``'s graph (see module_calls.compiled_wrapper) runs on ``args``. Dynamo refuses
        a failing view as it traces, where no mode sees it: where ``rehearse`` (once per mode: one graph each), its
        eager forward runs first, without gradients, on copies of its buffers and random state. Then the mode is off."""
        if rehearse:
            self._rehearsed.setdefault(wrapper, set()).add(wrapper.training)
            self._rehearsing, network = True, compiled_network(wrapper)
            try:
                with torch.no_grad(), _disable_current_modes(), paused(only=self), leaving_no_trace(network):
                    eager_forward(wrapper)(*args)
            except Exception as error:  # a rehearsal only: the real call runs (and fails, if it must) as it would
                log.debug('channels last: the eager rehearsal of a compiled forward stopped: %s', error)
            finally:
                self._rehearsing = False
                self._placements.settle()  # the graph traced next makes the viewed outputs channels first
        if self._paused_for is None and on_top_of_mode_stack(self._mode):
            self._paused_for = wrapper  # a graph traced under the mode would be traced again without it
            exit_mode(self._mode)

    def left(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any, failed: bool) -> None:
        """Note ``module`` as the maker of its NHWC outputs, unless an inner module returned them; a
        forward-only watch ends with the outermost call."""
        self._depth = max(self._depth - 1, 0)
        if self._mode is None:
            return
        if module is self._paused_for:
            self._paused_for = None
            self._mode.__enter__()
        if not failed and not self._mode.light and self._paused_for is None:  # not a compiled graph's inner module
            self._mode.calls[module] = self._mode.calls.get(module, 0) + 1
            if isinstance(output, torch.Tensor):
                self._one_tensor_out.add(module)
            for tensor in tree_leaves(output):
                if nhwc(tensor) and tensor not in self._mode.made:
                    self._mode.made[tensor] = module
        if self._depth == 0 and not self._whole_step:
            self._forwards_watched.add((self._training(), self.loop))  # a forward ran watched (not a batch never run)
            if self.loop is None:  # else the batch's own code after it, until end()
                self._new = self.stop()

    def extension_found(self, name: str, where: str) -> None:
        """The extension op ``name`` runs at ``where`` on 4D/5D tensors: every step's extension ops are
        watched, so that it always runs as in NCHW (:mod:`~channels_last_algo.core.extension_ops`)."""
        if where in self.extensions:
            return
        self.extensions.append(where)
        if self._rehearsing:  # inside a compiled graph the op gets what the graph gives it
            self._new.append(
                f'the extension op {name} at {where} takes 4D/5D tensors inside a torch.compile graph, which '
                'no watch reaches: it gets NHWC memory there, so its results equal NCHW only if its kernel '
                "follows strides; where it does not, run that model uncompiled, or with mode='off'"
            )
        else:
            self._new.append(
                f'the extension op {name} at {where} takes 4D/5D tensors: on every step it is given them '
                'contiguous, and contiguous gradients, as in NCHW'
            )

    def _batch_left(self, origins: frozenset, how: str) -> Optional[frozenset]:
        """``origins`` but the batch tensors among them, which the guard's input selection leaves as they come from
        the next batch on where it chose them (one line says so); None where nothing else is left to place."""
        batch = frozenset(origin for origin in origins if isinstance(origin, BatchTensor))
        left = None if not batch or self._inputs is None else self._inputs.leave({b.path for b in batch}, how)
        if left:
            names = ', '.join(path_name(path) for path in left)
            self._new.append(
                f'{names} left as {"they come" if len(left) > 1 else "it comes"} from the next batch on ({how})'
            )
        return None if left is not None and origins == batch else origins - batch

    def _found(self, origins: frozenset, where: str, how: str) -> None:
        """The tensor made by ``origins`` (none: no module made it) is used at ``where`` as ``how`` says,
        which takes it channels first: a batch tensor among them is left as it comes, where the guard chose it."""
        origins = self._batch_left(origins, how)
        if origins is None:
            return
        if not origins and self._late:  # made before the watch began: the next watched step finds its maker
            if where not in self._late_places:
                self._late_places.add(where)
                self._new.append(
                    f'the tensor {how}, code first run after the watched steps, ran on a channels-first copy '
                    'that writes keep in step; the next step is watched to find what makes it'
                )
            return
        scripted = sorted(self._name(module) for module in origins if is_torchscript(module))  # they take no hooks
        if not origins or scripted:
            if where not in self.unplaced:
                self.unplaced.append(where)
                made = "no module's output"
                if scripted:
                    made = f'made by a TorchScript module ({", ".join(scripted)}), which takes no hooks'
                self._new.append(
                    f'the tensor {how} is {made}, so no module can make it channels first: every '
                    'step is watched (slower)'
                    + ('; .reshape there instead of .view keeps the speed' if how.startswith('viewed') else '')
                    + ('; drawing by shape there (torch.randn(x.shape, ...)) keeps it' if 'random' in how else '')
                )
            return
        for module in [module for module in origins if module not in self._placements]:
            self._placements.place(module, module in self._one_tensor_out, compiled_network(module) not in self._paths)
            self.placed.append(self._name(module))
            self._new.append(f'{self.placed[-1]} outputs made channels first ({how})')

    def _name(self, module: torch.nn.Module) -> str:
        """The module's path in the model (a compiled wrapper: its network's), or what it is outside the model."""
        network = compiled_network(module)
        path = self._paths.get(network)  # None: a module outside the model (a teacher the forward calls)
        return f'a {type(network).__name__} outside the model' if path is None else path or type(network).__name__
