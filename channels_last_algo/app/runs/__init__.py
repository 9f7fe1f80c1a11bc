"""What trains or times a model: a recipe's training run, the side-by-side comparison, and the demo.

- :mod:`~channels_last_algo.app.runs.checkpoint_files`, :mod:`~channels_last_algo.app.runs.folder`,
  :mod:`~channels_last_algo.app.runs.run_lock`: a run's checkpoint files, the folder that holds them and its lock;
- :mod:`~channels_last_algo.app.runs.run_checkpoints`: the Composer callback that writes them, and a model from one;
- :mod:`~channels_last_algo.app.runs.trainer`: Composer's Trainer for a recipe;
- :mod:`~channels_last_algo.app.runs.train`: one training run, from the pre-flight checks to the last checkpoint;
- :mod:`~channels_last_algo.app.runs.compare`: a recipe's steps timed with channels last off and on;
- :mod:`~channels_last_algo.app.runs.demo`: a small conv net trained in both layouts.

Example::

    train_recipe(load_recipe('recipes/resnet50_imagenet.yaml'), data_path='/data/imagenet', resume=True)
"""
