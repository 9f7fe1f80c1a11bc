"""The application, one subpackage per subject; it builds on the core and the integrations, and nothing
below imports from here.

- :mod:`~channels_last_algo.app.data`: the NHWC data path (decode, crop, batch, the data sets, the
  loaders). It knows nothing of recipes.
- :mod:`~channels_last_algo.app.recipes`: YAML recipes and what they name: the schema and its rules,
  the algorithms, the model, optimizer and data sets, where a step runs and whether it fits in memory.
  It checks and builds parts; it trains nothing.
- :mod:`~channels_last_algo.app.runs`: what trains or times a model: a recipe's training run (its folder,
  checkpoints, Trainer and the run itself), the side-by-side comparison, and the demo.
- :mod:`~channels_last_algo.app.cli`: the ``channels-last`` command, one module per group of commands.

The rule: a subject imports only from itself and the subjects before it in the order
``data <- recipes <- runs <- cli``, at a module's top and inside its functions alike, and no two
modules import each other, directly or around a circle (``tests/app/test_package.py`` checks both). A
module that needs Composer imports it inside the function that uses it, or is imported there, so that
everything but training runs without Composer.

Example:
    >>> from channels_last_algo.app.recipes.loading import load_recipe
    >>> from channels_last_algo.app.recipes.training_data import build_datasets
    >>> train, val = build_datasets(load_recipe('recipes/resnet50_imagenet.yaml'))  # no data.path: synthetic
    >>> type(train).__name__, len(val)
    ('SyntheticImageNet', 50000)
"""
