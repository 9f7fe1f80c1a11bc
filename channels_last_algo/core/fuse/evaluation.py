"""Evaluation on a fused copy: swap it in for the network a trainer's module holds, then back.

The trainer-neutral half of ``fuse_eval``: the integrations decide *when* (each evaluation,
test and prediction pass), this class does the swap.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from channels_last_algo.core.fuse.inference import fuse_for_inference

__all__ = ['FusedEvaluation']


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
        setattr(owner, attribute, fuse_for_inference(network, example_input))
        self._swapped = (owner, attribute, network)

    def end(self) -> None:
        """Put the original network back."""
        if self._swapped is None:
            return
        owner, attribute, network = self._swapped
        setattr(owner, attribute, network)
        self._swapped = None
