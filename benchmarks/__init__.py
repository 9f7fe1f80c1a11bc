"""The benchmarks: side-by-side measurements, their reports and committed results, and the model
zoos the tests share. Not part of the installed package.

Each measuring script runs from the repository root and imports its neighbours by their own
names (the script's folder is on ``sys.path``); the tests import this folder as a package.

Example:
    >>> from benchmarks import zoo_models
    >>> zoo_models.by_name('resnet18').source
    'torchvision'
"""
