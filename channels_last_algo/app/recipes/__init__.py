"""YAML recipes: what a recipe names and how each key is checked, before anything is built.

- :mod:`~channels_last_algo.app.recipes.yaml_reader`: YAML as a recipe takes it (no key twice, bounded aliases);
- :mod:`~channels_last_algo.app.recipes.value_rules`, :mod:`~channels_last_algo.app.recipes.schema`: the rule of each
  value and every key's type, rule and meaning; :mod:`~channels_last_algo.app.recipes.keys` prints them;
- :mod:`~channels_last_algo.app.recipes.loading`: read, override (``--set``) and check a recipe;
- :mod:`~channels_last_algo.app.recipes.algorithms`, :mod:`~channels_last_algo.app.recipes.algorithm_ranges`:
  the algorithms by name and the valid values of their options;
- :mod:`~channels_last_algo.app.recipes.models`, :mod:`~channels_last_algo.app.recipes.optimizers`,
  :mod:`~channels_last_algo.app.recipes.training_data`: the model, optimizer and data sets a recipe names;
- :mod:`~channels_last_algo.app.recipes.placement`, :mod:`~channels_last_algo.app.recipes.step_memory`: the
  device, batch split and microbatch a step runs with here, and whether that step fits in memory;
- :mod:`~channels_last_algo.app.recipes.footprints`: the peak memory of a model's passes, counted on ``meta``.

Example:
    >>> from channels_last_algo.app.recipes.loading import load_recipe
    >>> load_recipe('recipes/resnet50_imagenet.yaml', ['optimizer.lr=0.1']).optimizer.lr
    0.1
"""
