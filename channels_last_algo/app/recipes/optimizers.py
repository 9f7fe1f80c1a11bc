"""The recipe's optimizer and learning-rate schedule, built in one place for training and ``compare``.

``optimizer.lr`` is the learning rate for ``optimizer.reference_batch_size``; it is scaled
linearly to the global batch size (Goyal et al., 2017), as Composer's ResNet-50 recipes do.

Example:
    >>> from channels_last_algo.app.recipes.schema import OptimizerConfig
    >>> scaled_lr(OptimizerConfig(lr=2.048, reference_batch_size=2048), global_batch_size=256)
    0.256
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from channels_last_algo.app.recipes.schema import OptimizerConfig, Recipe

__all__ = ['build_optimizer', 'build_scheduler', 'scaled_lr']


def scaled_lr(optimizer: OptimizerConfig, global_batch_size: int) -> float:
    """``optimizer.lr`` scaled linearly from ``reference_batch_size`` to ``global_batch_size``."""
    return optimizer.lr * global_batch_size / optimizer.reference_batch_size


def build_optimizer(recipe: Recipe, parameters: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """Composer's DecoupledSGDW over ``parameters`` with the recipe's scaled learning rate,
    momentum and weight decay."""
    from composer.optim import DecoupledSGDW

    opt = recipe.optimizer
    return DecoupledSGDW(
        parameters,
        lr=scaled_lr(opt, recipe.train.global_batch_size),
        momentum=opt.momentum,
        weight_decay=opt.weight_decay,
    )


def build_scheduler(recipe: Recipe) -> Any:
    """Composer's cosine-with-warmup schedule of the recipe."""
    from composer.optim import CosineAnnealingWithWarmupScheduler

    return CosineAnnealingWithWarmupScheduler(t_warmup=recipe.scheduler.t_warmup, alpha_f=recipe.scheduler.alpha_f)
