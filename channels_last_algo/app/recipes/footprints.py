"""The peak memory of a model's passes, counted before anything is built: :class:`LiveBytes` follows
the tensor storages a pass makes on the ``meta`` device (shapes only, nothing is allocated) and keeps the
peak of those alive; :func:`model_footprints` turns two batch sizes' peaks into a :class:`Footprint`, a
fixed part and the cost of one more image, and :func:`input_pass_bytes` counts one pass over an input.

Example:
    >>> from channels_last_algo.app.runs.demo import TinyResNet
    >>> train, evaluation, _ = model_footprints(lambda: TinyResNet(num_classes=10), 32, 32)
    >>> train.per_image > evaluation.per_image > 0
    True
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple, Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ['Footprint', 'LiveBytes', 'input_pass_bytes', 'model_footprints']

PROBE_IMAGES = (2, 4)  # the two batch sizes of each pass (2 and not 1: BatchNorm refuses one value a channel)
FALLBACK_CROP = 64  # the largest crop of the CPU pass for a model that does not run on meta


class LiveBytes(TorchDispatchMode):
    """A dispatch mode that follows the storages the operations under it make, and keeps the peak of the
    bytes alive; storages that existed before (the weights, their gradients) are not counted.

    Example:
        >>> with LiveBytes() as live:
        ...     x = torch.empty(256, device='meta')
        ...     y = x * 2
        ...     del x, y
        ...     z = torch.empty(128, device='meta')
        >>> live.peak
        2048
    """

    def __init__(self) -> None:
        super().__init__()
        self.alive: dict[int, tuple[StorageWeakRef, int]] = {}
        self.now = 0
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for key in [key for key, (ref, _) in self.alive.items() if ref.expired()]:
            self.now -= self.alive.pop(key)[1]
        inputs = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                if storage._cdata not in self.alive and storage._cdata not in inputs:
                    self.alive[storage._cdata] = (StorageWeakRef(storage), storage.nbytes())
                    self.now += storage.nbytes()
        self.peak = max(self.peak, self.now)
        return out


class Footprint(NamedTuple):
    """The peak bytes of a pass over ``n`` images: ``fixed + n * per_image``.

    Example:
        >>> Footprint(fixed=100, per_image=10).bytes(4), Footprint(100, 10).most_images(175)
        (140, 7)
    """

    fixed: int
    per_image: int

    def bytes(self, images: int) -> int:
        return self.fixed + images * self.per_image

    def most_images(self, budget: float) -> float:
        """The most images whose pass fits in ``budget`` bytes (inf when an image costs nothing)."""
        return math.inf if self.per_image <= 0 else max(0, int(budget - self.fixed) // self.per_image)

    def times(self, factor: float) -> Footprint:
        return Footprint(int(self.fixed * factor), int(self.per_image * factor))


def _pass_peak(model: torch.nn.Module, shape: tuple[int, ...], train: bool, device: str) -> int:
    """The peak bytes :class:`LiveBytes` sees in one pass over an input of ``shape``, the input batch
    included: a forward and backward with the gradients already there (as at a step's second
    microbatch), or a forward without gradients."""
    model.train(train)
    with LiveBytes() as live:
        batch = torch.empty(shape, device=device)
        if not train:
            with torch.no_grad():
                model(batch)
        else:
            floats = [t for t in tree_flatten(model(batch))[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
            sum(t.float().sum() for t in floats).backward()
    return live.peak


def _footprint(model: torch.nn.Module, crop: int, train: bool, device: str) -> Footprint:
    small, large = (_pass_peak(model, (images, 3, crop, crop), train, device) for images in PROBE_IMAGES)
    per_image = max(0, (large - small) // (PROBE_IMAGES[1] - PROBE_IMAGES[0]))
    return Footprint(max(0, small - PROBE_IMAGES[0] * per_image), per_image)


def _footprints_on(model: torch.nn.Module, crops: tuple[int, int], device: str) -> tuple[Footprint, Footprint]:
    """The training and evaluation footprints of ``model`` on ``device`` at ``crops`` (training, evaluation)."""
    for parameter in model.parameters():
        if parameter.requires_grad:
            parameter.grad = torch.zeros_like(parameter)
    return _footprint(model, crops[0], True, device), _footprint(model, crops[1], False, device)


def _weight_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """The bytes of ``model``'s trained parameters, and of all its parameters and buffers."""
    trained = sum(p.nbytes for p in model.parameters() if p.requires_grad)
    return trained, sum(t.nbytes for t in (*model.parameters(), *model.buffers()))


def model_footprints(
    build: Callable[[], torch.nn.Module], train_crop: int, eval_crop: int
) -> Optional[tuple[Footprint, Footprint, tuple[int, int]]]:
    """The training and evaluation :class:`Footprint` of the model ``build`` returns, and its weight
    bytes (trained, all); on ``meta``, else on the CPU at crops of at most :data:`FALLBACK_CROP` px scaled
    by pixels; None when the model runs on neither."""
    try:
        with torch.device('meta'):
            model = build()
        return (*_footprints_on(model, (train_crop, eval_crop), 'meta'), _weight_bytes(model))
    except Exception:  # data-dependent code, or a model that creates its tensors on a device of its own
        pass
    crops = (min(train_crop, FALLBACK_CROP), min(eval_crop, FALLBACK_CROP))
    try:
        model = build()
        train, evaluation = _footprints_on(model, crops, 'cpu')
    except Exception:  # the model cannot run here at all: no estimate, and no refusal
        return None
    train = Footprint(train.fixed, train.per_image * train_crop**2 // crops[0] ** 2)
    evaluation = Footprint(evaluation.fixed, evaluation.per_image * eval_crop**2 // crops[1] ** 2)
    return train, evaluation, _weight_bytes(model)


def input_pass_bytes(build: Callable[[], torch.nn.Module], shape: tuple[int, ...], train: bool) -> Optional[int]:
    """The peak bytes of one pass of the model ``build`` returns over a random input of ``shape`` (forward and
    backward when ``train``, with the weights, their gradients and the input), counted on ``meta``; None where
    the model does not run there.

    Example:
        >>> from channels_last_algo.app.runs.demo import TinyResNet
        >>> input_pass_bytes(lambda: TinyResNet(num_classes=10), (2, 3, 32, 32), True) > 2 * 3 * 32 * 32 * 4
        True
    """
    try:
        with torch.device('meta'):
            model = build()
        if train:
            for parameter in model.parameters():
                parameter.grad = torch.zeros_like(parameter) if parameter.requires_grad else None
        return _pass_peak(model, shape, train, 'meta') + _weight_bytes(model)[1] * (2 if train else 1)
    except Exception:  # data-dependent code, or a model that makes its tensors on a device of its own
        return None
