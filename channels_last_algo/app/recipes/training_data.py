"""The recipe's data: its train and eval sets from ``--data``, ``data.path`` or the synthetic ImageNet.

Example:
    >>> from channels_last_algo.app.recipes.loading import load_recipe
    >>> recipe = load_recipe('recipes/resnet50_imagenet.yaml')
    >>> train, val = build_datasets(recipe)
    >>> len(train), training_set_name(recipe, None), training_set_name(recipe, '/data/imagenet')
    (1281167, 'the synthetic ImageNet', '--data /data/imagenet')
"""

from __future__ import annotations

from typing import Optional

from channels_last_algo.app.data.image_folder import DataPathError
from channels_last_algo.app.data.imagenet import imagenet_dataset
from channels_last_algo.app.recipes.schema import Recipe, RecipeError

__all__ = ['build_datasets', 'training_set_name']


def build_datasets(recipe: Recipe, data_path: Optional[str] = None):
    """The recipe's train and eval datasets (NHWC uint8 samples): ``data_path`` (or
    ``data.path``) as an ImageNet folder, the synthetic set when neither is given. Both follow
    ``data.on_corrupt``; a corrupt image's error names that key."""
    data = recipe.data
    path = data_path if data_path is not None else data.path
    image_size = max(data.train_crop, data.eval_resize or data.eval_crop)
    hint = f'or set data.on_corrupt: skip in {recipe.source} (--set data.on_corrupt=skip) to skip corrupt files'
    common = dict(
        data_path=path,
        num_classes=recipe.model.num_classes,
        seed=recipe.train.seed,
        on_corrupt=data.on_corrupt,
        corrupt_hint=hint,
    )
    try:
        train = imagenet_dataset(
            'train',
            crop_size=data.train_crop,
            synthetic_samples=data.synthetic_train_samples,
            synthetic_image_size=image_size,
            **common,
        )
        val = imagenet_dataset(
            'val',
            crop_size=data.eval_crop,
            resize_size=data.eval_resize,
            synthetic_samples=data.synthetic_eval_samples,
            synthetic_image_size=image_size,
            **common,
        )
    except DataPathError as exc:
        key = 'data.path' if data_path is None else '--data'
        raise RecipeError(f'{recipe.source}: {key}: {exc}') from exc
    return train, val


def training_set_name(recipe: Recipe, data_path: Optional[str]) -> str:
    """Where the training images come from, as the recipe or the command line said it."""
    if data_path is not None:
        return f'--data {data_path}'
    if recipe.data.path is not None:
        return f'data.path {recipe.data.path}'
    return 'data.synthetic_train_samples' if recipe.data.synthetic_train_samples else 'the synthetic ImageNet'
