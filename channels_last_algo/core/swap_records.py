"""What a swap table did to a model: :class:`SwapRecord` (one module swapped, by a repair rule or a
kernel bug's safe path) and :class:`UncoveredLayer` (one that a row needed but could not swap), both
made by the swap engine (:mod:`channels_last_algo.core.swap`).

Example:
    >>> SwapRecord('1', 'repair', 'global_avg_pool', 'torch.nn.AdaptiveAvgPool2d', 'ChannelsLastPool').kind
    'repair'
    >>> SwapRecord('1', 'fix', 'global_avg_pool', 'torch.nn.AdaptiveAvgPool2d', 'ChannelsLastPool')
    Traceback (most recent call last):
    ...
    ValueError: swap record kind 'fix' must be one of ('repair', 'safe_path')
"""

from __future__ import annotations

import dataclasses

__all__ = ['KINDS', 'SwapRecord', 'UncoveredLayer']

KINDS = ('repair', 'safe_path')
"""Why a module was changed: a repair rule, or a kernel bug's safe path."""


@dataclasses.dataclass(frozen=True)
class SwapRecord:
    """One module that a swap table changed.

    Attributes:
        path: the module's name in ``model.named_modules()`` ('' for the model itself).
        kind: one of :data:`KINDS`.
        reason: the row applied: the repair rule's name or the kernel bug's name.
        original: qualified name of the module's type before.
        replacement: name of the class it has now.
    """

    path: str
    kind: str
    reason: str
    original: str
    replacement: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f'swap record kind {self.kind!r} must be one of {KINDS}')


@dataclasses.dataclass(frozen=True)
class UncoveredLayer:
    """A module that a row would swap but whose class defines its own version of a method the
    swap takes over, or whose backward other code extends (a repair), so it keeps its class (and its
    layout break or kernel bug).

    Attributes:
        path: the module's name in ``model.named_modules()`` ('' for the model itself).
        kind: one of :data:`KINDS`: the table whose row it needed.
        reason: that row: the repair rule's name or the kernel bug's name.
        layer: qualified name of the module's class.
        overrides: the methods its class defines that the swap would replace (``('forward',)``).
        hooked: other code hooks it forward and backward, which may pick its handling by its exact class.
    """

    path: str
    kind: str
    reason: str
    layer: str
    overrides: tuple[str, ...]
    hooked: bool = False
