"""What a distributed setting, the optimizers and the ``weights`` option allow for the layout of a model's weights.

In one process and under DDP the weights go channels last: ``ChannelsLast`` restrides them at
``Event.INIT``, before Composer wraps the model in DDP, and DDP's gradient bucket views take
the parameters' strides when the wrapper is built, so gradients, buckets and weights are all
NHWC (1x1 and depthwise kernels included, with their real channels-last strides) and no
gradient is restrided on its way into a bucket.

Sharding needs contiguous weights: FSDP2 (``fully_shard``) refuses non-contiguous
parameters, FSDP1 flattens them into a 1D ``FlatParameter`` in logical order, and tensor
parallelism shards DTensors the same way. There the weights stay contiguous and only the
activations go NHWC: a convolution whose input is NHWC computes in NHWC (oneDNN and cuDNN take
the layout from the input or the weight), so its output, and the activations after it, stay
NHWC; only each weight gradient is copied to the contiguous layout.

Optimizers that flatten parameters or gradients with ``.view`` (LBFGS, ZeroRedundancyOptimizer
with bucket views; :mod:`~channels_last_algo.core.flattening_optimizers`) and the option
``weights='contiguous'`` get the same plan (:func:`for_training`).

A model that is *already* wrapped in DDP is refused: its buckets were built with the old
strides, so restriding now would copy every gradient every step.

Example:
    >>> import torch
    >>> str(weight_layout_for(torch.nn.Conv2d(3, 8, 3)))
    'weights channels last (no sharding: one process, or DDP wrapped after the conversion)'
    >>> class FSDP2Config: ...      # any sharding config: Composer's, a Lightning FSDPStrategy
    >>> plan = weight_layout_for(torch.nn.Conv2d(3, 8, 3), fsdp_config=FSDP2Config())
    >>> plan.contiguous, plan.sharded
    (True, False)
"""

from __future__ import annotations

import dataclasses
import gc
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Optional, Union

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from channels_last_algo.core.argument_checks import require_module
from channels_last_algo.core.first_optimizer_step import FirstStep, torch_step
from channels_last_algo.core.flattening_optimizers import flattening
from channels_last_algo.core.layout import MemoryFormat

__all__ = [
    'WEIGHTS',
    'OptimizerWatch',
    'WeightLayoutPlan',
    'ddp_around',
    'for_training',
    'optimizer_plan',
    'weight_layout_for',
]


@dataclasses.dataclass(frozen=True)
class WeightLayoutPlan:
    """The weight layout a distributed setting allows, and why.

    Attributes:
        contiguous: keep the 4D/5D weights contiguous (channels first); activations still go
            NHWC. False: restride the weights to channels last.
        reason: what in the setting decided it, naming the wrapper, its module path or the config.
        sharded: the parameters are already sharded or flattened by a wrapper, which owns their
            storage; nothing may restride them.
    """

    contiguous: bool
    reason: str
    sharded: bool = False

    @property
    def memory_format(self) -> MemoryFormat:
        """The weights' memory format: channels first when they stay contiguous."""
        return MemoryFormat.CHANNELS_FIRST if self.contiguous else MemoryFormat.CHANNELS_LAST

    def __str__(self) -> str:
        layout = 'weights contiguous, activations NHWC' if self.contiguous else 'weights channels last'
        return f'{layout} ({self.reason})'


def _module_label(path: str) -> str:
    return f'at {path!r}' if path else 'at the top'


def weight_layout_for(
    model: torch.nn.Module,
    fsdp_config: Optional[Any] = None,
    tp_config: Optional[Any] = None,
) -> WeightLayoutPlan:
    """The weight layout allowed for ``model``, wrapped as it is now and to be wrapped as configured.

    Args:
        model: the model, bare or already wrapped (FSDP1, FSDP2, DTensor parameters).
        fsdp_config: the sharding config the trainer will apply (Composer's ``FSDPConfig`` or
            ``FSDP2Config`` as ``State.fsdp_config`` holds it, a Lightning ``FSDPStrategy``), or
            None when the model will not be sharded.
        tp_config: Composer's tensor-parallel config (``State.tp_config``), or None.

    Raises:
        ValueError: ``model`` is already wrapped in ``DistributedDataParallel``.
    """
    require_module(model, 'weight_layout_for')
    if not torch.distributed.is_available():
        return WeightLayoutPlan(False, 'torch.distributed is not available: one process')
    plan = _wrapped_now(model)
    if plan is not None:
        return plan
    if fsdp_config is not None:
        return WeightLayoutPlan(
            True, f'{type(fsdp_config).__name__}: FSDP will shard the parameters, which needs them contiguous'
        )
    if tp_config is not None:
        return WeightLayoutPlan(
            True,
            f'{type(tp_config).__name__}: tensor parallelism will shard the parameters, which needs them contiguous',
        )
    return WeightLayoutPlan(False, 'no sharding: one process, or DDP wrapped after the conversion')


WEIGHTS = ('auto', 'contiguous')
"""The ``weights`` option: ``'auto'`` lets the setting and the optimizers decide; ``'contiguous'`` keeps
the weights contiguous (for code of the user's that flattens them, as ``parameters_to_vector`` does)."""


def for_training(
    plan: WeightLayoutPlan,
    optimizers: Union[None, torch.optim.Optimizer, Iterable[torch.optim.Optimizer]] = None,
    weights: str = 'auto',
) -> WeightLayoutPlan:
    """``plan`` (what the distributed setting allows), or contiguous weights where the ``weights``
    option asks or an optimizer flattens them (:mod:`~channels_last_algo.core.flattening_optimizers`).

    Example:
        >>> plan = weight_layout_for(torch.nn.Conv2d(3, 8, 3))
        >>> print(for_training(plan, weights='contiguous'))
        weights contiguous, activations NHWC (weights='contiguous' asked for)
    """
    if plan.contiguous:
        return plan
    if weights == 'contiguous':
        return WeightLayoutPlan(True, "weights='contiguous' asked for")
    for optimizer in [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else optimizers or ():
        found = optimizer_plan(optimizer)
        if found is not None:
            return found
    return plan


_watches: weakref.WeakSet = weakref.WeakSet()  # the live OptimizerWatch objects
_step_hooks: list[Any] = []  # the handles of the process-wide step pre- and post-hook, while installed
_first_steps: dict[int, FirstStep] = {}  # optimizer id -> the watch over its first step, while it runs


def _see_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
    if torch.compiler.is_compiling():  # a compiled step (torch.compile(optimizer.step)): no watch enters its graph
        return None
    stale = _first_steps.pop(id(optimizer), None)  # this optimizer's first step raised, and left its watch on
    if stale is not None:
        stale.stop()
    for watch in list(_watches):
        watch._stepped(optimizer)
    first = _first_steps.get(id(optimizer))
    return None if first is None else first.start(args, kwargs)


def _see_step_end(optimizer: torch.optim.Optimizer, *_: Any) -> None:
    if torch.compiler.is_compiling():
        return
    first = _first_steps.pop(id(optimizer), None)
    if first is not None:
        first.stop()
    for watch in list(_watches):
        watch._on_stepped()


class OptimizerWatch:
    """Sees the first step of every optimizer while it lives, and calls ``on_plan(optimizer, plan)``
    once for the first that flattens ``model``'s parameters: optimizers made after the conversion
    (Lightning's, a plain loop's) are found before they view anything where a known row names them
    (:mod:`~channels_last_algo.core.flattening_optimizers`), and on the spot where a step that is
    not torch's own views them in its first run (:mod:`~channels_last_algo.core.first_optimizer_step`).

    All watches share one process-wide step pre-hook and post-hook. A watch closed or collected leaves them: torch
    walks its live table of those hooks at each step, so a hook removed while an optimizer steps
    (a watch closing itself, or collected then) would fail that step with "OrderedDict mutated
    during iteration". :meth:`stop` only leaves (safe anywhere); :meth:`close` also takes the hooks
    off once no watch is left, and is for outside an optimizer's step hooks.

    Example:
        >>> model, found = torch.nn.Conv2d(3, 8, 1), []
        >>> watch = OptimizerWatch(model, lambda optimizer, plan: found.append(plan.reason))
        >>> model(torch.randn(1, 3, 2, 2)).sum().backward()
        >>> _ = torch.optim.LBFGS(model.parameters()).step(lambda: model(torch.randn(1, 3, 2, 2)).sum())
        >>> found
        ['LBFGS gathers the gradients with p.grad.view(-1)']
        >>> watch.close()
    """

    def __init__(
        self,
        model: torch.nn.Module,
        on_plan: Callable[[torch.optim.Optimizer, WeightLayoutPlan], None],
        on_stepped: Callable[[], None] = lambda: None,
    ):
        self._model = weakref.ref(model)
        self._on_plan = on_plan
        self._on_stepped = on_stepped  # after each optimizer step
        self._seen: set[int] = set()
        _watches.add(self)
        if not _step_hooks:
            _step_hooks.extend(
                (register_optimizer_step_pre_hook(_see_step), register_optimizer_step_post_hook(_see_step_end))
            )

    def _stepped(self, optimizer: torch.optim.Optimizer) -> None:
        if id(optimizer) in self._seen:
            return
        self._seen.add(id(optimizer))
        model, plan = self._model(), optimizer_plan(optimizer)
        if model is None or (plan is None and torch_step(optimizer)):
            return
        ours = {id(p) for p in model.parameters()}
        if not any(id(p) in ours for group in optimizer.param_groups for p in group['params']):
            return
        if plan is not None:
            self.stop()
            self._on_plan(optimizer, plan)
        else:  # a step of the user's or a third party's: watched, once
            _first_steps[id(optimizer)] = FirstStep(optimizer, lambda why: self._viewed(optimizer, why))

    def _viewed(self, optimizer: torch.optim.Optimizer, why: str) -> None:
        """``optimizer``'s first step flattens the weights, their gradients or its state, as ``why`` says."""
        self.stop()
        self._on_plan(optimizer, WeightLayoutPlan(True, why))

    def stop(self) -> None:
        """Stop watching (the shared hook stays)."""
        _watches.discard(self)

    def close(self) -> None:
        """Stop watching; the shared hook comes off once no watch is left."""
        self.stop()
        while _first_steps:  # those steps that raised left on: no step runs now
            _first_steps.popitem()[1].stop()
        if not _watches:
            while _step_hooks:
                _step_hooks.pop().remove()


def optimizer_plan(optimizer: torch.optim.Optimizer) -> Optional[WeightLayoutPlan]:
    """Contiguous weights where ``optimizer`` flattens them (a known row); None where it does not."""
    found = flattening(optimizer)
    if found is None:
        return None
    reason, owns_storage = found
    return WeightLayoutPlan(True, reason, sharded=owns_storage)


def _wrapped_now(model: torch.nn.Module) -> Optional[WeightLayoutPlan]:
    """The plan a wrapper already around ``model`` (or inside it) imposes; None when unwrapped.
    Refuses DDP (see :func:`weight_layout_for`)."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel

    for path, module in model.named_modules():
        if isinstance(module, DistributedDataParallel):
            raise ValueError(
                f'{type(model).__name__} is already wrapped in DistributedDataParallel ({_module_label(path)}): '
                'its gradient buckets keep the strides the parameters had when it was built, so restriding now '
                'would copy every gradient every step. Convert the bare model first (LayoutGuard.on_init or '
                'apply_channels_last), then wrap it; the Composer Trainer does this in this order.'
            )
        if isinstance(module, FullyShardedDataParallel):
            return WeightLayoutPlan(
                True, f'FSDP1 FullyShardedDataParallel {_module_label(path)} flattens the parameters', sharded=True
            )
        if isinstance(module, FSDPModule):
            return WeightLayoutPlan(
                True, f'FSDP2 fully_shard {_module_label(path)} needs contiguous parameters', sharded=True
            )
    for name, param in model.named_parameters():
        if isinstance(param, DTensor):
            return WeightLayoutPlan(True, f'parameter {name!r} is a sharded DTensor', sharded=True)
    return None


def ddp_around(model: torch.nn.Module) -> bool:
    """Whether a live ``DistributedDataParallel`` wraps ``model``: restriding its weights now would leave DDP's
    gradient buckets in the old strides, and with ``gradient_as_bucket_view=False`` (the default) DDP then hands
    back wrong gradients, silently (torch 2.7.0 and 2.14.1, CPU). Found by a walk over the objects alive, for the
    rare restride after the start; False at once without a process group.

    Example:
        >>> ddp_around(torch.nn.Conv2d(3, 8, 3))
        False
    """
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return False
    from torch.nn.parallel import DistributedDataParallel

    return any(  # type(), not isinstance(): a weak proxy whose object is gone raises on __class__
        issubclass(type(obj), DistributedDataParallel) and any(module is model for module in obj.module.modules())
        for obj in gc.get_objects()
    )
