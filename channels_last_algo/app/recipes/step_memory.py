"""The memory of one training step, estimated before training, and the refusal of a step that cannot fit.

On the CPU a microbatch too large for the machine is found only by the kernel's out-of-memory killer,
which ends the process without a message; on a GPU a microbatch the recipe fixes fails with a CUDA
out-of-memory error. :func:`check_step_memory` estimates the step's peak before anything is built and
raises :class:`RecipeError` naming the key, the estimate, the memory this process can use and the
largest microbatch that fits.

The estimate runs the recipe's model, with the layers its algorithms swap in (BlurPool's), on the ``meta``
device (shapes only, nothing is allocated): a forward and backward at ``data.train_crop`` and a forward
without gradients at ``data.eval_crop``, each at two batch sizes, under
:class:`~channels_last_algo.app.recipes.footprints.LiveBytes`, which follows every tensor storage made and
keeps the peak of those alive; the difference of the two peaks is the cost of one more image. To that come
the weights and buffers, their gradients, the optimizer's momentum, the EMA's copy of the weights and the
loaded ``uint8`` batches. A model that does not run on ``meta`` (data-dependent code) runs on the CPU at a
small crop instead, its cost per image scaled by pixels; one that runs on neither gets no estimate and no
refusal. So does a machine whose free memory cannot be read (:func:`available_bytes`).
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import os
import resource
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple, Optional

import torch

from channels_last_algo.app.recipes import models
from channels_last_algo.app.recipes.algorithms import algorithm_registry
from channels_last_algo.app.recipes.footprints import Footprint, model_footprints
from channels_last_algo.app.recipes.placement import loader_workers, microbatch_size
from channels_last_algo.app.recipes.schema import Recipe, RecipeError
from channels_last_algo.app.recipes.value_rules import parse_time

__all__ = [
    'StepEstimate',
    'available_bytes',
    'check_step_memory',
    'estimate_step',
    'size_text',
]

# The estimate counts the bytes of the live tensors, a floor of the real peak: it matches the peak RSS of a
# ResNet-18 or ResNet-50 step on the CPU where glibc returns every freed block (MALLOC_MMAP_THRESHOLD_=65536),
# and is up to 1.8 times below it with glibc's default, which keeps freed activations in its heap; CUDA's caching
# allocator and the library workspaces add less. So a refusal comes only where the floor passes the memory this
# process can use by a quarter, and the microbatch suggested keeps a fifth of it free with the allocator's slack.
REFUSE_ABOVE = 1.25
SUGGEST_WITHIN = 0.8
ALLOCATOR_SLACK = {'cpu': 2.0, 'gpu': 1.5}
WEIGHT_COPIES = ('ema', 'swa')  # algorithms that keep an average of the weights beside them
AMP_DTYPES = {'amp_fp16': torch.float16, 'amp_bf16': torch.bfloat16}
CGROUP_LIMITS = (Path('/sys/fs/cgroup/memory.max'), Path('/sys/fs/cgroup/memory/memory.limit_in_bytes'))


class StepEstimate(NamedTuple):
    """One step's memory: ``held`` throughout (weights and buffers, gradients, momentum, weight copies,
    AMP's half-precision weights), the loaded ``uint8`` batches in memory while training and while
    evaluating, and the footprints of a training and an evaluation microbatch.

    Example:
        >>> step = StepEstimate(100, 10, 20, Footprint(0, 50), Footprint(0, 5))
        >>> step.need(4, 8), step.largest_microbatch(500)
        ((310, 160), 7)
    """

    held: int
    loaded_train: int
    loaded_eval: int
    train: Footprint
    evaluation: Footprint

    def need(self, train_images: int, eval_images: int) -> tuple[int, int]:
        """The peak bytes of a training and of an evaluation microbatch of that many images."""
        training = self.held + self.loaded_train + self.train.bytes(train_images)
        return training, self.held + self.loaded_eval + self.evaluation.bytes(eval_images)

    def largest_microbatch(self, budget: float) -> float:
        """The most images a microbatch of both phases may hold within ``budget`` bytes."""
        training = self.train.most_images(budget - self.held - self.loaded_train)
        return min(training, self.evaluation.most_images(budget - self.held - self.loaded_eval))

    def with_slack(self, factor: float) -> StepEstimate:
        """This estimate with the microbatches' bytes multiplied by ``factor`` (the allocator's slack)."""
        return self._replace(train=self.train.times(factor), evaluation=self.evaluation.times(factor))


def _batches_in_memory(recipe: Recipe, device: str) -> int:
    """The loaded batches of one loader in memory: on the CPU the one in use and its workers' prefetched ones
    (two each, PyTorch's default; :func:`loader_workers`), on a GPU the one moved to it."""
    return 1 + 2 * loader_workers(recipe) if device == 'cpu' else 1


def _loaded_bytes(recipe: Recipe, device: str, batches: tuple[int, int]) -> tuple[int, int]:
    """The bytes of the loaded ``uint8`` batches in memory while training and while evaluating: at an
    evaluation within an epoch (``train.eval_interval`` in batches or a fraction) the training loader's
    batches wait beside the evaluation's, at an epoch's end only its last one."""
    in_memory = _batches_in_memory(recipe, device)
    crops = (recipe.data.train_crop, recipe.data.eval_crop)
    train, evaluation = (in_memory * size * 3 * crop**2 for size, crop in zip(batches, crops))
    fraction, unit = parse_time(recipe.train.eval_interval)
    at_epoch_end = unit == 'ep' or (unit == 'dur' and fraction == 1)
    return train, evaluation + (train // in_memory if at_epoch_end else train)


def _surgeries(recipe: Recipe) -> list[Callable[[torch.nn.Module], object]]:
    """The module surgery of the recipe's Composer algorithms (BlurPool's blur layers, say), as the Trainer
    applies it at ``Event.INIT``: the functional forms ``apply_*(model, ..., optimizers)`` in each
    algorithm's module, with the recipe's options they take. None without Composer."""
    if importlib.util.find_spec('composer') is None:
        return []
    registry, found = algorithm_registry(), []
    for name, options in recipe.enabled_algorithms().items():
        module = vars(sys.modules[registry[name].__module__]) if name in registry else {}
        for attr, function in module.items():
            parameters = (
                inspect.signature(function).parameters if attr.startswith('apply_') and callable(function) else {}
            )
            if {'model', 'optimizers'} <= set(parameters):
                found.append(functools.partial(function, **{k: v for k, v in options.items() if k in parameters}))
    return found


def _recipe_model(recipe: Recipe) -> torch.nn.Module:
    """The recipe's model with its algorithms' module surgery; a surgery that fails is left out."""
    model = models.build_model(recipe.model.name, num_classes=recipe.model.num_classes)
    for surgery in _surgeries(recipe):
        try:
            surgery(model)
        except Exception:  # a surgery for another device (low precision norms on CUDA): the estimate goes without
            continue
    return model


def estimate_step(recipe: Recipe, device: str, precision: str, batches: tuple[int, int]) -> Optional[StepEstimate]:
    """The memory of one step of ``recipe`` on ``device`` ('cpu' or 'gpu') in ``precision``, for the rank's
    ``batches`` (training, evaluation); None when the model runs neither on ``meta`` nor on the CPU."""
    with warnings.catch_warnings():  # the Trainer repeats what building the model and its surgery warn of
        warnings.simplefilter('ignore')
        found = model_footprints(
            functools.partial(_recipe_model, recipe), recipe.data.train_crop, recipe.data.eval_crop
        )
    if found is None:
        return None
    train, evaluation, (trained, weights) = found
    half = AMP_DTYPES[precision].itemsize / 4 if device == 'gpu' and precision in AMP_DTYPES else 1.0
    momentum = trained if recipe.optimizer.momentum > 0 else 0
    copies = sum(name in WEIGHT_COPIES for name in recipe.enabled_algorithms())
    amp_weights = int(trained * half) if half < 1 else 0  # autocast's half-precision copies of the weights
    held = weights + trained + momentum + copies * weights + amp_weights
    return StepEstimate(
        held,
        *_loaded_bytes(recipe, device, batches),
        Footprint(train.fixed, int(train.per_image * half)),
        Footprint(evaluation.fixed, int(evaluation.per_image * half)),
    )


def _meminfo_available(meminfo: Path = Path('/proc/meminfo')) -> Optional[int]:
    try:
        lines = meminfo.read_text().splitlines()
    except OSError:
        return None
    found = [line.split()[1] for line in lines if line.startswith('MemAvailable:')]
    return int(found[0]) * 1024 if found else None


def _cgroup_limit() -> Optional[int]:
    """The memory limit of this container's cgroup (v2, else v1); None where none is set or readable."""
    for path in CGROUP_LIMITS:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        return int(text) if text.isdigit() and int(text) < 2**60 else None
    return None


def _resident_bytes() -> int:
    try:
        return int(Path('/proc/self/statm').read_text().split()[1]) * resource.getpagesize()
    except (OSError, IndexError, ValueError):
        return 0


def available_bytes(device: str) -> Optional[int]:
    """The bytes this rank may still take on ``device``: on a GPU CUDA's free memory of the rank's device;
    on the CPU the smaller of MemAvailable plus what this process holds and the cgroup limit, less what it
    holds, shared among the ranks of this machine. None where it cannot be read.

    Example::

        available_bytes('cpu')  # 23_991_418_880 of a 32 GiB machine with 22 GiB available
    """
    if device == 'gpu':
        try:
            return torch.cuda.mem_get_info(int(os.environ.get('LOCAL_RANK', 0)))[0]
        except Exception:  # no CUDA, or a driver that does not say
            return None
    free = _meminfo_available()
    if free is None:
        return None
    held, limit = _resident_bytes(), _cgroup_limit()
    total = free + held if limit is None else min(free + held, limit)
    return max(0, total - held) // int(os.environ.get('LOCAL_WORLD_SIZE', 1))


def size_text(count: float) -> str:
    """Bytes in GiB, or MiB below one GiB: ``'63.8 GiB'``."""
    return f'{count / 2**30:.1f} GiB' if count >= 2**30 else f'{count / 2**20:.1f} MiB'


def _microbatch(recipe: Recipe, device: str, rank_batch: int) -> int:
    """The images of one pass: the recipe's microbatch, at most the rank's batch; 1 for Composer's
    'auto' on a GPU, which halves the microbatch on CUDA out-of-memory down to 1."""
    size = microbatch_size(recipe, device, rank_batch)
    return 1 if size == 'auto' else min(size, rank_batch)


def _smaller_microbatch(recipe: Recipe, step: StepEstimate, microbatches: tuple[int, int], room: str, fits: int) -> str:
    data, need = recipe.data, step.need(*microbatches)
    phase = (
        f'one training microbatch of {microbatches[0]} images (train.global_batch_size '
        f'{recipe.train.global_batch_size}) at data.train_crop {data.train_crop} px'
        if need[0] >= need[1]
        else f'one evaluation microbatch of {microbatches[1]} images at data.eval_crop {data.eval_crop} px'
    )
    return (
        f'train.device_train_microbatch_size: {phase} with {recipe.model.name} needs about {size_text(max(need))}, '
        f'more than the {room}; the largest microbatch that fits is {fits}: '
        f'--set train.device_train_microbatch_size={fits}'
    )


def _refusal(recipe: Recipe, step: StepEstimate, microbatches: tuple[int, int], device: str, available: int) -> str:
    """The key at fault and its fix: the largest microbatch that keeps :data:`SUGGEST_WITHIN` of
    ``available`` with the allocator's slack; else, where one image a microbatch does not, the batches or
    the crop."""
    budget, slack = available * SUGGEST_WITHIN, step.with_slack(ALLOCATOR_SLACK[device])
    room = f'{size_text(available)} this process can use on the {"CPU" if device == "cpu" else "GPU"}'
    fits = slack.largest_microbatch(budget)
    if fits >= 1:
        return _smaller_microbatch(recipe, step, microbatches, room, int(fits))
    one = f"{size_text(max(step.need(1, 1)))} (up to {size_text(max(slack.need(1, 1)))} with the allocator's slack)"
    if step.held + max(slack.train.bytes(1), slack.evaluation.bytes(1)) <= budget:  # the loaded batches do not fit
        return (
            f'train.global_batch_size: the loaded batches of {recipe.train.global_batch_size} images '
            f'({_batches_in_memory(recipe, device)} of each loader in memory) with one image a microbatch need about '
            f'{one}, too much for the {room}; lower train.global_batch_size, train.eval_batch_size or data.workers'
        )
    key, crop = (
        ('data.train_crop', recipe.data.train_crop)
        if step.train.bytes(1) >= step.evaluation.bytes(1)
        else ('data.eval_crop', recipe.data.eval_crop)
    )
    return (
        f'{key}: even one image a microbatch at {crop} px with {recipe.model.name} needs about {one}, '
        f'too much for the {room}; lower {key} or choose a smaller model.name'
    )


def check_step_memory(recipe: Recipe, device: str, precision: str, batches: tuple[int, int]) -> Optional[StepEstimate]:
    """Refuse ``recipe`` with :class:`RecipeError` when one step on ``device`` needs more than
    :data:`REFUSE_ABOVE` times the memory this rank can use (:func:`available_bytes`), naming the key and
    the largest microbatch that fits; the estimate otherwise, None where there is none.

    Example::

        check_step_memory(load_recipe('recipes/resnet50_imagenet.yaml'), 'cpu', 'fp32', (2048, 2048))
    """
    available = available_bytes(device)
    step = None if available is None else estimate_step(recipe, device, precision, batches)
    if step is None:
        return None
    microbatches = (_microbatch(recipe, device, batches[0]), _microbatch(recipe, device, batches[1]))
    if max(step.need(*microbatches)) > available * REFUSE_ABOVE:
        raise RecipeError(f'{recipe.source}: {_refusal(recipe, step, microbatches, device, available)}')
    return step
