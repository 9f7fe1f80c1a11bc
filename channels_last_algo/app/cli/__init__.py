"""The ``channels-last`` command, one module per subject: the entry point and its parser
(:mod:`~channels_last_algo.app.cli.entry`), what every command shares
(:mod:`~channels_last_algo.app.cli.shared_arguments`), MODEL and ``--input``
(:mod:`~channels_last_algo.app.cli.model_arguments`), and the commands: ``audit`` and ``doctor``
(:mod:`~channels_last_algo.app.cli.model_commands`), ``export``
(:mod:`~channels_last_algo.app.cli.export_command`), ``train`` and ``compare``
(:mod:`~channels_last_algo.app.cli.recipe_commands`), and ``demo``
(:mod:`~channels_last_algo.app.cli.demo_command`).

Example::

    $ channels-last audit resnet50 --strict
    $ python -m channels_last_algo.app.cli.entry train recipes/resnet50_imagenet.yaml --smoke
"""
