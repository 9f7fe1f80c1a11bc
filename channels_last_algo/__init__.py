"""Train conv nets in channels-last (NHWC) memory format, and keep them there.

The package has three layers, and imports point down only:

- :mod:`channels_last_algo.core`: torch only. Layout, conversion, repair, audit, auto mode,
  kernel safety, the framework-neutral guard and fused inference.
- :mod:`channels_last_algo.integrations`: thin adapters that decide *when* the core acts in
  a trainer (Composer, Lightning). Each is imported on first use, so
  ``import channels_last_algo`` needs only torch, torchvision and pyyaml.
- :mod:`channels_last_algo.app`: the NHWC data path, YAML recipes, the comparison and the
  ``channels-last`` command.

Example:
    >>> import torch
    >>> from channels_last_algo import apply_channels_last
    >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3))
    >>> apply_channels_last(model).converted
    ['0.weight']
"""

__version__ = '0.2.0'

from channels_last_algo.core import *  # noqa: F401,F403  (the core's public API)
from channels_last_algo.core import __all__ as _core_all
from channels_last_algo.integrations import integration_attribute

__all__ = [*_core_all, 'ChannelsLast', 'ChannelsLastCallback', 'FusedEval', 'FusedEvalCallback']


def __getattr__(name: str):
    """``ChannelsLast`` and ``FusedEval`` (Composer), ``ChannelsLastCallback`` and ``FusedEvalCallback``
    (Lightning): loaded from their integration on first use, with the install command when it is missing."""
    return integration_attribute(name, __name__)
