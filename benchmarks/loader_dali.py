"""NVIDIA DALI's CPU pipeline as an optional loader: the same NHWC uint8 batches as ``collate_nhwc``.

DALI is optional and no project dependency; install it with ``pip install nvidia-dali-cuda120``
(its CPU operators run without a GPU). This module imports without it: :func:`dali_available`
says whether it is there, and :func:`dali_pass` raises ImportError with that command if not.

:func:`dali_pass` builds one CPU-only DALI pipeline (``device_id=None``, every operator on the
CPU, ``threads`` worker threads) over an ImageFolder-layout folder (``folder/<class>/<image>``;
files and labels as :class:`CheckedImageFolder` lists them: sorted class folders, its checks)
and returns a function that runs one pass, i.e. one epoch: every image once, in file order, as
``(images, labels)`` batches; images ``(N, 3, crop, crop)`` uint8 with channels-last strides
(NHWC memory, DALI's own buffer: no copy), labels int64. The last batch holds the remainder:
DALI pads the epoch to whole batches by repeating the last image, and the pass drops the
repeats. Only one pass may run at a time; a pass left early runs the rest of its epoch when it
is closed, so the next one starts on the epoch boundary.

- train: torchvision's ImageNet recipe as DALI has it: ``decoders.image_random_crop`` (area
  0.08..1, aspect ratio 3/4..4/3, RGB; DALI's own window sampler), an antialiased linear resize
  to ``crop`` x ``crop``, a horizontal flip with probability 0.5.
- val: decode (RGB), antialiased linear resize of the short side to ``resize`` and centre crop
  ``crop``, with torchvision's geometry (long side truncated, offsets rounded half to even).

No normalisation: that happens on the device (``NormalizeBatch``), as for the NHWC path.

Example::

    run = dali_pass(Path('/data/imagenet/val'), 'val', batch_size=64, crop=224, resize=232, threads=2, seed=0)
    for images, labels in run():  # one epoch; call run() again for the next
        ...
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from channels_last_algo.app.data.image_folder import CheckedImageFolder
from channels_last_algo.app.data.transforms import check_size, eval_transform

INSTALL = 'pip install nvidia-dali-cuda120'
READER = 'reader'
SPLITS = ('train', 'val')


def dali_available() -> bool:
    """Whether NVIDIA DALI can be imported."""
    try:
        import nvidia.dali  # noqa: F401
    except ImportError:
        return False
    return True


def dali_pass(
    folder: Path, split: str, *, batch_size: int, crop: int, resize: int, threads: int, seed: int
) -> Callable[[], Iterator[tuple[torch.Tensor, torch.Tensor]]]:
    """A function that runs one pass (one epoch) of a CPU DALI pipeline over ``folder`` and yields
    ``(images, labels)`` batches: images ``(N, 3, crop, crop)`` uint8 channels-last, labels int64.

    The pipeline is built here, once; each call of the returned function reads the next epoch.
    ``resize`` (the val short side, >= ``crop``) is not used for train.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    for name, value in (('batch_size', batch_size), ('crop', crop), ('threads', threads)):
        check_size(name, value)
    if split == 'val':
        eval_transform(crop, resize)  # the NHWC path's checks: sizes, resize >= crop
    if not dali_available():
        raise ImportError(f'dali_pass needs NVIDIA DALI, which is not installed: {INSTALL}')
    pipe = _pipeline(CheckedImageFolder(folder).samples, split, batch_size, crop, resize, threads, seed)
    return _epochs(pipe, batch_size)


def _pipeline(samples: list, split: str, batch_size: int, crop: int, resize: int, threads: int, seed: int) -> Any:
    """The built CPU pipeline over ``samples`` (path, label): read in file order, decode, crop as ``split`` does."""
    from nvidia.dali import fn, types
    from nvidia.dali.pipeline import Pipeline

    pipe = Pipeline(batch_size=batch_size, num_threads=threads, device_id=None, seed=seed)
    with pipe:
        encoded, labels = fn.readers.file(
            files=[path for path, _ in samples],
            labels=[label for _, label in samples],
            pad_last_batch=True,
            name=READER,
        )
        if split == 'train':
            images = _random_resized_crop_flip(encoded, crop)
        else:
            images = _resize_centre_crop(
                fn.decoders.image(encoded, device='cpu', output_type=types.RGB), encoded, crop, resize
            )
        pipe.set_outputs(images, labels)
    pipe.build()
    return pipe


def _random_resized_crop_flip(encoded: Any, crop: int) -> Any:
    """torchvision's train geometry in the DALI graph: DALI's own random crop window, decoded, resized, flipped."""
    from nvidia.dali import fn, types

    images = fn.decoders.image_random_crop(
        encoded,
        device='cpu',
        output_type=types.RGB,
        random_area=[0.08, 1.0],
        random_aspect_ratio=[3 / 4, 4 / 3],
    )
    images = fn.resize(images, size=[crop, crop], interp_type=types.INTERP_LINEAR, antialias=True)
    return fn.flip(images, horizontal=fn.random.coin_flip(probability=0.5))


def _epochs(pipe: Any, batch_size: int) -> Callable[[], Iterator[tuple[torch.Tensor, torch.Tensor]]]:
    """A function that reads ``pipe``'s next epoch, the padding repeats of its last batch dropped."""
    count = pipe.epoch_size(READER)
    batches = math.ceil(count / batch_size)

    def one_pass() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        done = 0
        try:
            while done < batches:
                images, labels = pipe.run()
                kept = min(batch_size, count - done * batch_size)
                done += 1
                yield _nhwc_batch(images)[:kept], _labels(labels)[:kept]
        except GeneratorExit:
            for _ in range(batches - done):  # the rest of the epoch: the next pass starts on its boundary
                pipe.run()
            raise

    return one_pass


def _resize_centre_crop(images: Any, encoded: Any, crop: int, resize: int) -> Any:
    """torchvision's ``Resize(resize)`` + ``CenterCrop(crop)`` geometry in the DALI graph: the short side
    to ``resize``, the long side scaled and truncated, the window's offsets rounded half to even."""
    from nvidia.dali import fn, types
    from nvidia.dali import math as dali_math

    shape = fn.peek_image_shape(encoded)  # (H, W, C), int64
    height, width = shape[0], shape[1]
    short = dali_math.min(height, width)
    resized = [resize * side // short for side in (height, width)]  # int(resize * side / short), exactly

    def offset(side: Any) -> Any:  # int(round((side - crop) / 2)), as Python rounds: x.5 to even
        half = (side - crop) // 2
        return half + ((side - crop) & 1) * (half & 1)

    images = fn.resize(
        images,
        resize_y=fn.cast(resized[0], dtype=types.FLOAT),
        resize_x=fn.cast(resized[1], dtype=types.FLOAT),
        interp_type=types.INTERP_LINEAR,
        antialias=True,
    )
    start = fn.cast(fn.stack(*(offset(side) for side in resized)), dtype=types.INT32)
    return fn.slice(images, start=start, shape=[crop, crop], axis_names='HW')


def _nhwc_batch(images: Any) -> torch.Tensor:
    """DALI's dense ``(N, H, W, C)`` uint8 batch as an ``(N, C, H, W)`` channels-last view of the same memory."""
    return torch.from_dlpack(images.as_tensor()).permute(0, 3, 1, 2)


def _labels(labels: Any) -> torch.Tensor:
    """DALI's ``(N, 1)`` int32 labels as ``(N,)`` int64."""
    return torch.from_dlpack(labels.as_tensor()).reshape(-1).to(torch.int64)
