"""``channels-last compare``: one recipe's model and data, channels last off and on, timed side by side.

Three variants train the same model from the same initial weights on the same batches:

- ``NCHW``: channels last off, the batch collated NCHW as a usual loader gives it;
- ``composer ChannelsLast``: Composer's own algorithm, ``model.to(memory_format=channels_last)``
  as its ``Event.INIT`` does it, the batch left NCHW;
- ``channels_last_algo``: this project: the model restrided by the guard and the NHWC batches
  of the data path, no conversion at all on the way in.

After warm-up steps, each round times one full training step (forward, loss, backward,
optimizer step) of every variant in turn, so a noisy machine slows all of them alike. Each
speedup is the median of the per-round ratios with its 95% interval; an interval that holds 1.0
is a tie at this noise. The recipe's model (with BlurPool's layers when the recipe turns BlurPool
on), optimizer, label smoothing and precision are used; EMA and progressive resizing, which do
not change the per-step work of a layout, are left out. A layout audit of one extra step of each
variant counts its breaks.

Example:
    >>> from channels_last_algo.app.recipes.loading import load_recipe
    >>> recipe = load_recipe('recipes/resnet50_imagenet.yaml', ['model.name=resnet18',
    ...     'model.num_classes=10', 'train.global_batch_size=4', 'data.train_crop=32'])
    >>> result = compare_recipe(recipe, batches=1, warmup=1)
    >>> [row['variant'] for row in result['rows']]
    ['NCHW', 'composer ChannelsLast', 'channels_last_algo']
    >>> print(format_comparison(result).splitlines()[-1])
    for a number to trust: more steps (--batches 20 or more) on a quiet machine, with nothing else running
"""

from __future__ import annotations

import copy
import itertools
import statistics
from collections.abc import Callable
from typing import Any, Optional

import torch

from channels_last_algo.app.data.loaders import NormalizeBatch, build_loader
from channels_last_algo.app.recipes import models
from channels_last_algo.app.recipes.optimizers import build_optimizer
from channels_last_algo.app.recipes.placement import device_and_precision, loader_workers, workers_words
from channels_last_algo.app.recipes.schema import Recipe, RecipeError
from channels_last_algo.app.recipes.step_memory import (
    ALLOCATOR_SLACK,
    REFUSE_ABOVE,
    available_bytes,
    estimate_step,
    size_text,
)
from channels_last_algo.app.recipes.training_data import build_datasets
from channels_last_algo.app.runs.speedups import interval_span, interval_words, is_tie
from channels_last_algo.core.audit import LayoutAudit
from channels_last_algo.core.guard import LayoutGuard
from channels_last_algo.core.machine_description import describe_machine, machine_label
from channels_last_algo.core.timing import synchronizer, time_interleaved

__all__ = ['compare_recipe', 'format_comparison']

_AUTOCAST = {'amp_fp16': torch.float16, 'amp_bf16': torch.bfloat16}
_CONFIDENCE = 0.95  # of the speedups' intervals
_TRUST = 'for a number to trust: more steps (--batches 20 or more) on a quiet machine, with nothing else running'
_REFERENCES = {'vs_nchw': 'NCHW', 'vs_composer': 'composer ChannelsLast'}  # each speedup column's reference


def _batches(
    recipe: Recipe, count: int, device: torch.device, train_data: Any
) -> list[dict[bool, tuple[torch.Tensor, torch.Tensor]]]:
    """``count`` training batches of ``train_data``, normalised on the device, each
    both NHWC (as this project's loader gives it) and NCHW (as a ``ToTensor`` loader would),
    keyed by ``nhwc``; made before timing so that no variant pays for the other's layout."""
    loader = build_loader(
        train_data,
        batch_size=recipe.train.global_batch_size,
        train=True,
        workers=loader_workers(recipe),
        seed=recipe.train.seed,
    )
    normalize = NormalizeBatch()
    batches = []
    for images, labels in itertools.islice(itertools.cycle(loader), count):
        images, labels = normalize((images.to(device), labels.to(device)))
        batches.append({True: (images, labels), False: (images.contiguous(), labels)})
    return batches


def _model(recipe: Recipe) -> torch.nn.Module:
    from composer.algorithms.blurpool import apply_blurpool

    torch.manual_seed(recipe.train.seed)
    model = models.build_model(recipe.model.name, num_classes=recipe.model.num_classes)
    blurpool = recipe.enabled_algorithms().get('blurpool')
    if blurpool is not None:
        apply_blurpool(model, **blurpool)
    return model


_VARIANTS = 3  # NCHW, Composer's ChannelsLast and this project's


def _variants(base: torch.nn.Module) -> dict[str, tuple[torch.nn.Module, bool, Callable[[Any], Any]]]:
    """Each variant's model, whether its loader gives NHWC batches, and what it does to a batch."""
    from composer.algorithms.channels_last import apply_channels_last as composer_apply

    composer_model = copy.deepcopy(base)
    composer_apply(composer_model)
    ours = copy.deepcopy(base)
    guard = LayoutGuard()
    guard.on_init(ours)
    untouched = lambda batch: batch
    return {
        'NCHW': (base, False, untouched),
        'composer ChannelsLast': (composer_model, False, untouched),
        'channels_last_algo': (ours, True, guard.on_batch),
    }


def _check_memory(recipe: Recipe, device: str, precision: str) -> None:
    """RecipeError before any work when the comparison cannot fit: it trains the whole global batch in one
    pass (no microbatches, so every variant times the same step) and holds three copies of the model."""
    batch = recipe.train.global_batch_size
    available = available_bytes(device)
    step = None if available is None else estimate_step(recipe, device, precision, (batch, batch))
    if step is None:
        return
    need = _VARIANTS * step.held + step.loaded_train + step.train.bytes(batch)
    if need > REFUSE_ABOVE * available:
        budget = available / ALLOCATOR_SLACK[device] - _VARIANTS * step.held - step.loaded_train
        fits = step.train.most_images(budget)
        raise RecipeError(
            f'{recipe.source}: train.global_batch_size: compare trains the whole batch of {batch} images in one pass '
            f'(no microbatches) with {_VARIANTS} copies of {recipe.model.name}, which needs about '
            f'{size_text(need)}, more than the {size_text(available)} free here; '
            + (f'--set train.global_batch_size={int(fits)}' if fits >= 1 else 'lower data.train_crop')
        )


def compare_recipe(
    recipe: Recipe, batches: int = 10, warmup: int = 2, data_path: Optional[str] = None
) -> dict[str, Any]:
    """Time ``batches`` interleaved training steps of each variant after ``warmup`` untimed ones.

    Returns a JSON-ready dict: the machine, settings (the loader workers started too), and one row per variant:
    min and median step time (s), images/s, speedups over NCHW and over Composer's ChannelsLast (medians of the
    per-round ratios) with their 95% intervals (None against itself or under 6 batches), and the audit's breaks.
    """
    if batches < 1 or warmup < 0:
        raise ValueError(f'batches must be >= 1 and warmup >= 0, got batches={batches}, warmup={warmup}')
    device_name, precision = device_and_precision(recipe)
    train_data, _ = build_datasets(recipe, data_path)  # a data path that is not there is refused first
    _check_memory(recipe, device_name, precision)
    device = torch.device('cuda' if device_name == 'gpu' else 'cpu')
    if device.type == 'cuda':
        torch.backends.cudnn.benchmark = True
    data = _batches(recipe, warmup + batches, device, train_data)
    variants, step = _variant_steps(recipe, device, precision)
    feeds = {name: iter(data) for name in variants}  # every variant trains on batch i in round i
    timings = time_interleaved(
        {name: lambda name=name: step(name, next(feeds[name])) for name in variants},
        rounds=batches,
        warmup=warmup,
        synchronize=synchronizer(device),
    )
    rows = _rows(timings, _audits(variants, step, data[-1]), recipe.train.global_batch_size)
    return {**_settings(recipe, precision), 'warmup': warmup, 'batches': batches, 'rows': rows}


def _settings(recipe: Recipe, precision: str) -> dict[str, Any]:
    """What the comparison ran on: the recipe, model, machine, precision, batch, crop and loader workers."""
    return {
        'recipe': recipe.name,
        'model': recipe.model.name,
        'machine': describe_machine(),
        'precision': precision,
        'batch_size': recipe.train.global_batch_size,
        'image_size': recipe.data.train_crop,
        'data_workers': recipe.data.workers,
        'loader_workers': loader_workers(recipe),
        'confidence': _CONFIDENCE,
    }


def _variant_steps(
    recipe: Recipe, device: torch.device, precision: str
) -> tuple[dict[str, tuple[torch.nn.Module, bool, Callable[[Any], Any]]], Callable[[str, Any], None]]:
    """Each variant (:func:`_variants`) of the recipe's model on ``device``, and one training step of a variant by
    name on a batch of :func:`_batches`: the recipe's optimizer, label smoothing and precision."""
    smoothing = float(recipe.enabled_algorithms().get('label_smoothing', {}).get('smoothing', 0.0))
    variants = _variants(_model(recipe).to(device))
    optimizers = {name: build_optimizer(recipe, model.parameters()) for name, (model, _, _) in variants.items()}

    def step(name: str, batch: dict[bool, tuple[torch.Tensor, torch.Tensor]]) -> None:
        model, nhwc, prepare = variants[name]
        images, labels = prepare(batch[nhwc])
        with torch.autocast(device.type, dtype=_AUTOCAST.get(precision, torch.float32), enabled=precision in _AUTOCAST):
            loss = torch.nn.functional.cross_entropy(model(images), labels, label_smoothing=smoothing)
        loss.backward()
        optimizers[name].step()
        optimizers[name].zero_grad(set_to_none=True)

    return variants, step


def _audits(variants: dict[str, Any], step: Callable[[str, Any], None], batch: Any) -> dict[str, Any]:
    """The layout audit of one more ``step`` of each variant on ``batch``, by variant name."""
    audits = {}
    for name, (model, _, _) in variants.items():
        with LayoutAudit(model) as audit:
            step(name, batch)
        audits[name] = audit.report
    return audits


def _speedups(timings: Any, name: str) -> dict[str, Any]:
    """``name``'s speedups over each reference (medians of the per-round ratios) and their intervals; a
    variant against itself is 1.0, with no interval."""
    speedups = {}
    for column, reference in _REFERENCES.items():
        ratio = None if name == reference else timings.ratio(reference, name, _CONFIDENCE)
        speedups[f'speedup_{column}'] = 1.0 if ratio is None else ratio.median
        speedups[f'speedup_{column}_interval'] = None if ratio is None else ratio.interval
    return speedups


def _rows(timings: Any, audits: dict[str, Any], batch_size: int) -> list[dict[str, Any]]:
    """One row per variant: its step times, images/s, speedups with their intervals, and audit."""
    medians = {name: statistics.median(samples) for name, samples in timings.seconds.items()}
    return [
        {
            'variant': name,
            'min_s': min(samples),
            'median_s': medians[name],
            'images_per_s': batch_size / medians[name],
            **_speedups(timings, name),
            'layout_breaks': len(audits[name].breaks),
            'break_bytes': audits[name].break_bytes,
        }
        for name, samples in timings.seconds.items()
    ]


def _speedup_cell(row: dict[str, Any], column: str) -> str:
    """A speedup with its interval, marked ``tie`` where the interval holds 1.0."""
    interval = row[f'speedup_{column}_interval']
    cell = f'{row[f"speedup_{column}"]:.2f}x'
    if interval is None:
        return cell
    return f'{cell} ({interval_span(interval)})' + (' tie' if is_tie(interval) else '')


def format_comparison(result: dict[str, Any]) -> str:
    """The comparison as a readable table, then what its intervals say and how to get a number to trust."""
    confidence = f'{result["confidence"]:.0%} interval'
    lines = [
        f'{result["recipe"]}: {result["model"]}, batch {result["batch_size"]} x {result["image_size"]}px, '
        f'{result["precision"]}, {machine_label(result["machine"])}',
        f'{result["batches"]} timed training steps per variant after {result["warmup"]} warm-up, interleaved',
        f'data: {workers_words(result["data_workers"], result["loader_workers"])}, all batches loaded first',
        '',
        f'{"variant":<21} {"min ms":>8} {"median ms":>10} {"images/s":>9}  {f"vs NCHW ({confidence})":<26} '
        f'{f"vs Composer ({confidence})":<26} {"breaks":>6}',
    ]
    for row in result['rows']:
        lines.append(
            f'{row["variant"]:<21} {row["min_s"] * 1e3:8.1f} {row["median_s"] * 1e3:10.1f} '
            f'{row["images_per_s"]:9.1f}  {_speedup_cell(row, "vs_nchw"):<26} {_speedup_cell(row, "vs_composer"):<26} '
            f'{row["layout_breaks"]:6d}'
        )
    lines.append('')
    intervals = [row[f'speedup_{column}_interval'] for row in result['rows'] for column in _REFERENCES]
    if any(is_tie(interval) for interval in intervals):
        lines.append(f'tie: the {confidence} holds 1.0, a tie at this noise')
    if not any(intervals):
        lines.append(interval_words(None, '--batches', result['confidence']))
    lines.append(_TRUST)
    return '\n'.join(lines)
