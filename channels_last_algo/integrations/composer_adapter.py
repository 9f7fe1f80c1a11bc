"""Where the Composer integration reaches past Composer's events: one function, tested against Composer.

Composer offers no hook between its State and the checkpoint file: its savers
(``composer.utils.checkpoint.save_checkpoint``) write ``state.state_dict()``, or
``state.get_model_state_dict()`` for weights-only checkpoints. :func:`save_canonical` wraps those
two methods on one State instance so the file holds NCHW-contiguous tensors. The integration tests
save through Composer's own ``save_checkpoint`` and fail if Composer renames either method.
"""

from __future__ import annotations

import functools

from channels_last_algo.integrations import require

require('composer', 'composer')

from composer.core import State

from channels_last_algo.core.canonical_checkpoints import canonical_state

__all__ = ['SAVE_METHODS', 'save_canonical']

SAVE_METHODS = ('state_dict', 'get_model_state_dict')  # what Composer's checkpoint savers call


def save_canonical(state: State) -> None:
    """Make what Composer's checkpoint savers write canonical NCHW tensors
    (:func:`~channels_last_algo.core.canonical_checkpoints.canonical_state`), on this State only;
    a second call changes nothing."""
    for name in SAVE_METHODS:
        method = getattr(state, name)
        if getattr(method, '__wrapped__', None) is None:
            setattr(state, name, functools.wraps(method)(lambda method=method: canonical_state(method())))
