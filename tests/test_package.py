"""The package's layers: the core imports without any trainer, integrations load on first use
and say what to install when their trainer is missing, and arrows point down only."""

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

import channels_last_algo
from channels_last_algo.integrations import INTEGRATIONS, integration_attribute

PACKAGE = Path(channels_last_algo.__file__).parent
LAYERS = ('core', 'integrations', 'app')  # lowest first: a layer may import only from itself and those before it


def test_import_needs_no_trainer():
    code = (
        'import sys, channels_last_algo; '
        'print(sorted(m for m in ("composer", "lightning", "accelerate", "timm") if m in sys.modules))'
    )
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == '[]'


@pytest.mark.parametrize('name', sorted(INTEGRATIONS))
def test_integration_loads_on_first_use_or_names_the_install_command(name):
    module, package, extra = INTEGRATIONS[name]
    if importlib.util.find_spec(package) is None:
        with pytest.raises(
            ImportError,
            match=rf'channels_last_algo.{name}: this needs the {package} package.*'
            rf"pip install 'channels-last-algo\[{extra}\]'",
        ):
            getattr(channels_last_algo, name)
    else:
        assert getattr(channels_last_algo, name) is getattr(importlib.import_module(module), name)


def test_unknown_attribute_is_an_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'NoSuchThing'"):
        integration_attribute('NoSuchThing', 'channels_last_algo')


def _imported_layers(path: Path) -> set[str]:
    layers = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = (
            [alias.name for alias in node.names]
            if isinstance(node, ast.Import)
            else [node.module or '']
            if isinstance(node, ast.ImportFrom) and node.level == 0
            else []
        )
        for name in names:
            parts = name.split('.')
            if parts[0] == 'channels_last_algo' and len(parts) > 1 and parts[1] in LAYERS:
                layers.add(parts[1])
    return layers


@pytest.mark.parametrize('layer', LAYERS)
def test_imports_point_down_only(layer):
    allowed = set(LAYERS[: LAYERS.index(layer) + 1])
    upward = {
        str(path.relative_to(PACKAGE)): sorted(_imported_layers(path) - allowed)
        for path in (PACKAGE / layer).rglob('*.py')
        if _imported_layers(path) - allowed
    }
    assert upward == {}
