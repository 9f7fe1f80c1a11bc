"""Evaluation on a fused copy: swap it in for the network a trainer's module holds, then back.

The trainer-neutral half of ``fuse_eval``: the integrations decide *when* (each evaluation,
test and prediction pass), this class does the swap.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Mapping
from typing import Any, Optional

import torch

from channels_last_algo.core.argument_checks import ExampleInputError
from channels_last_algo.core.fuse.inference import fuse_for_inference
from channels_last_algo.core.module_calls import is_torchscript
from channels_last_algo.core.weight_layout import weight_layout_for

__all__ = ['FusedEvaluation', 'example_of', 'parameter_holders']

log = logging.getLogger(__name__)


def parameter_holders(owner: torch.nn.Module) -> list[str]:
    """The names of ``owner``'s children that hold parameters: the network a trainer's module keeps is its one
    such child (a LightningModule's ``net``, Composer's ``HuggingFaceModel.model``); metrics hold none.

    Example:
        >>> owner = torch.nn.Module()
        >>> owner.net, owner.act = torch.nn.Conv2d(3, 4, 1), torch.nn.ReLU()
        >>> parameter_holders(owner)
        ['net']
    """
    return [name for name, child in owner.named_children() if any(True for _ in child.parameters())]


def example_of(network: torch.nn.Module, batch: Any) -> Optional[torch.Tensor]:
    """The tensor of ``batch`` that ``network`` likely takes first: the batch itself, its first item, or in a
    mapping the value named as the first argument of ``network``'s forward (transformers' ``pixel_values``);
    None where that is no tensor.

    Example:
        >>> net, images = torch.nn.Conv2d(3, 4, 1), torch.randn(2, 3, 4, 4)
        >>> all(example_of(net, batch) is images for batch in (images, (images, 0), {'label': 0, 'input': images}))
        True
    """
    if isinstance(batch, Mapping):
        first = next(iter(inspect.signature(network.forward).parameters), None)
        batch = batch.get(first)
    elif isinstance(batch, (tuple, list)):
        batch = batch[0] if batch else None
    return batch if isinstance(batch, torch.Tensor) else None


class FusedEvaluation:
    """Evaluate on a fused copy: swap it in for the network an owner module holds, then back.

    :meth:`start` replaces ``owner.<attribute>`` by
    :func:`~channels_last_algo.core.fuse.fuse_for_inference` of that network as it is at that
    moment (its current weights: EMA's, say, when they are swapped in), checked on an example
    input when one is given; it does nothing while a copy is in. :meth:`end` puts the original
    object back (and does nothing when none is out), so anything that saves the owner
    afterwards saves the training network. :class:`~channels_last_algo.core.guard.LayoutGuard`
    (``fuse_eval=True``) calls them at the first batch and the end of each evaluation pass.

    Example:
        >>> holder = torch.nn.Module()
        >>> holder.net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU()).eval()
        >>> original = holder.net
        >>> evaluation = FusedEvaluation()
        >>> evaluation.start(holder, 'net')
        >>> type(holder.net).__name__, evaluation.active
        ('InferenceModel', True)
        >>> evaluation.end()
        >>> holder.net is original
        True
    """

    def __init__(self) -> None:
        self._swapped: Optional[tuple[torch.nn.Module, str, torch.nn.Module]] = None
        self._pending = False  # a pass began: fuse at its first batch
        self.passes = 0  # the passes begun, each on a new fused copy

    def loop_name(self, loop: str) -> str:
        """``loop`` named with the pass under way: each pass evaluates a new fused copy, watched anew
        (``LayoutGuard.on_batch(batch, loop=...)``)."""
        return f'{loop}, fused copy {self.passes}'

    def begin_pass(self) -> None:
        """An evaluation, test or prediction pass begins: :meth:`first_batch` fuses."""
        self._pending = True
        self.passes += 1

    def first_batch(self, network: Callable[[], tuple[torch.nn.Module, str, torch.nn.Module]], batch: Any) -> None:
        """At a pass's first batch (after :meth:`begin_pass`; nothing otherwise): swap ``owner.<attribute>``
        (``network()`` gives owner, attribute and the network there) for a fused copy from its current
        weights, checked on this batch's first tensor; a sharded or TorchScript network is evaluated unfused, with
        a warning."""
        if not self._pending:
            return
        self._pending = False
        owner, attribute, module = network()
        plan = weight_layout_for(module)
        unfused = 'the network is TorchScript, which has no code to fuse' if is_torchscript(module) else None
        if plan.sharded or unfused:
            log.warning('fuse_eval: evaluating unfused, since %s', unfused or plan.reason)
            return
        self.start(owner, attribute, example_input=example_of(module, batch))

    @property
    def active(self) -> bool:
        """Whether a fused copy is swapped in now."""
        return self._swapped is not None

    def start(self, owner: torch.nn.Module, attribute: str = 'module', example_input: Any = None) -> None:
        """Swap a fused copy of ``owner.<attribute>`` in (see
        :func:`~channels_last_algo.core.fuse.fuse_for_inference` for ``example_input``)."""
        if self._swapped is not None:
            return
        network = getattr(owner, attribute, None)
        if not isinstance(network, torch.nn.Module):
            raise ValueError(
                f'{type(owner).__name__}.{attribute} is {type(network).__name__}, not the nn.Module to '
                'fuse; name the attribute that holds the network'
            )
        try:
            fused = fuse_for_inference(network, example_input)
        except ExampleInputError as error:  # the owner's code calls it with more than the batch's tensor
            log.info('fuse_eval: fused without an example input, since %s', error)
            fused = fuse_for_inference(network)
        setattr(owner, attribute, fused)
        self._swapped = (owner, attribute, network)

    def end(self) -> None:
        """Put the original network back (the pass is over)."""
        self._pending = False
        if self._swapped is None:
            return
        owner, attribute, network = self._swapped
        setattr(owner, attribute, network)
        self._swapped = None
