"""Whether other processes hold a tensor's memory, so that giving it new strides (a new ``.data``) would cut
it off from them.

Hogwild training (``model.share_memory()``, then ``torch.multiprocessing`` workers that each train the
same model) and A3C's shared optimizers write into one shared storage from every process. A restrided
tensor is a copy in memory of this process alone: the other processes, the parent among them, would
no longer see its updates, and the model they hold would silently stop training. Such a tensor keeps
its strides.

Example:
    >>> import torch
    >>> weight = torch.nn.Conv2d(3, 4, 3).weight
    >>> shared_between_processes(weight)
    False
    >>> shared_between_processes(weight.detach().share_memory_())
    True
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import shared_cache


def shared_between_processes(tensor: torch.Tensor) -> bool:
    """True where ``tensor``'s memory is shared with other processes: a CPU storage in shared memory, or a
    storage torch sent to or received from another process (the only sign for CUDA, whose storages all
    call themselves shared)."""
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):  # no storage of its own (a tensor subclass, sparse)
        return False
    if storage.device.type == 'cpu':  # torch moves a CPU storage it sends into shared memory
        return storage.is_shared()
    return any(ref.cdata == storage._cdata and not ref.expired() for ref in list(shared_cache.values()))
