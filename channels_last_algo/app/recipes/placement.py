"""Where and how a recipe's step runs here: the device and precision, each rank's batch, the microbatch, and the
loader workers the cores here allow.

Example:
    >>> from channels_last_algo.app.recipes.loading import load_recipe
    >>> recipe = load_recipe('recipes/resnet50_imagenet.yaml')
    >>> CPU_MICROBATCH, microbatch_size(recipe, 'gpu', 8)
    (32, 'auto')
    >>> loader_workers(recipe) == min(recipe.data.workers, usable_cores())
    True
"""

from __future__ import annotations

import os
from typing import Union

from channels_last_algo.app.recipes.schema import Recipe, RecipeError

__all__ = [
    'CPU_MICROBATCH',
    'device_and_precision',
    'loader_workers',
    'microbatch_size',
    'rank_batch_sizes',
    'usable_cores',
    'workers_words',
]

# The microbatch 'auto' takes on the CPU. Composer's 'auto' halves the microbatch on a CUDA out-of-memory
# error and refuses any other device: on the CPU memory runs out without an error to catch (the kernel kills
# the process). ResNet-50 in fp32 keeps about 40 MiB of activations per training image at 176 px and 65 MiB at
# 224 px (measured: torch 2.7, oneDNN), so the shipped recipe's 2048-image batch would need about 80 GiB in one
# pass; 32 images need 1.3 to 2.1 GiB. The gradients are summed over the microbatches, so the optimizer step and
# the learning rate are those of the global batch; BatchNorm's statistics are over 32 images (as over each GPU's
# share in data-parallel training).
CPU_MICROBATCH = 32


def device_and_precision(recipe: Recipe) -> tuple[str, str]:
    """Composer's device name and precision for ``recipe`` here: fp32 on the CPU (all Composer's
    Trainer takes there), ``train.gpu_precision`` on a GPU."""
    import torch

    device = recipe.train.device
    if device == 'auto':
        device = 'gpu' if torch.cuda.is_available() else 'cpu'
    if device == 'gpu' and not torch.cuda.is_available():
        raise RecipeError(
            f'{recipe.source}: train.device: gpu was asked for but no CUDA device is visible; '
            'set train.device=auto or cpu'
        )
    return device, ('fp32' if device == 'cpu' else recipe.train.gpu_precision)


def rank_batch_sizes(recipe: Recipe) -> tuple[int, int]:
    world = int(os.environ.get('WORLD_SIZE', 1))  # the launcher's; the process group is not up yet
    train = recipe.train
    for key, size in (('global_batch_size', train.global_batch_size), ('eval_batch_size', train.eval_batch_size)):
        if size is not None and size % world:
            raise RecipeError(f'{recipe.source}: train.{key}: {size} must be a multiple of the world size ({world})')
    eval_size = train.global_batch_size if train.eval_batch_size is None else train.eval_batch_size
    return train.global_batch_size // world, eval_size // world


def microbatch_size(recipe: Recipe, device: str, rank_batch: int) -> Union[int, str]:
    """The images of one forward and backward pass on each rank: ``train.device_train_microbatch_size``,
    whose ``'auto'`` is Composer's on a GPU and :data:`CPU_MICROBATCH` (at most ``rank_batch``) on the CPU.

    Example:
        >>> from channels_last_algo.app.recipes.loading import load_recipe
        >>> recipe = load_recipe('recipes/resnet50_imagenet.yaml')
        >>> microbatch_size(recipe, 'cpu', 2048), microbatch_size(recipe, 'cpu', 8), microbatch_size(recipe, 'gpu', 8)
        (32, 8, 'auto')
    """
    size = recipe.train.device_train_microbatch_size
    if size != 'auto':
        return size
    return 'auto' if device == 'gpu' else min(rank_batch, CPU_MICROBATCH)


def usable_cores() -> int:
    """The CPU cores this process may run on: its affinity where the system keeps one, else all of them."""
    if hasattr(os, 'sched_getaffinity'):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def loader_workers(recipe: Recipe) -> int:
    """The worker processes each of the recipe's loaders starts: ``data.workers``, at most one per usable core
    (more only queue for the same cores, and PyTorch warns of them at every loader)."""
    return min(recipe.data.workers, usable_cores())


def workers_words(asked: int, started: int) -> str:
    """How many loader workers started for ``data.workers: asked``, and why fewer.

    Example:
        >>> workers_words(8, 2)
        '2 loader workers (data.workers 8, capped at the 2 cores this process may use)'
        >>> workers_words(1, 1), workers_words(0, 0)
        ('1 loader worker (data.workers 1)', '0 loader workers (data.workers 0)')
    """
    plural = '' if started == 1 else 's'
    capped = f', capped at the {started} core{plural} this process may use' if started < asked else ''
    return f'{started} loader worker{plural} (data.workers {asked}{capped})'
