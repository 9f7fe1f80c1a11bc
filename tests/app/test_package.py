"""The package's layers: the core imports without any trainer, integrations load on first use
and say what to install when their trainer is missing, and arrows point down only."""

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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


def _module_name(path: Path) -> str:
    """``channels_last_algo.app.data.loaders`` for ``.../channels_last_algo/app/data/loaders.py``."""
    parts = path.relative_to(PACKAGE.parent).with_suffix('').parts
    return '.'.join(parts[:-1] if parts[-1] == '__init__' else parts)


def _is_module(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split('.'))
    return path.with_suffix('.py').is_file() or (path / '__init__.py').is_file()


def _imported_modules(path: Path) -> set[str]:
    """The package's modules that the module at ``path`` imports, at its top or inside a function,
    relative imports resolved (``from package import module`` counts the module)."""
    package = _module_name(path).split('.')[: -1 if path.name != '__init__.py' else None]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            anchor = package[: len(package) - node.level + 1] if node.level else []
            base = '.'.join([*anchor, *([node.module] if node.module else [])])
            names = [base, *(f'{base}.{alias.name}' for alias in node.names)]
        else:
            continue
        found.update(name for name in names if name.startswith('channels_last_algo.') and _is_module(name))
    return found


def _imported_layers(path: Path) -> set[str]:
    """The package's layers (``core``, ``integrations``, ``app``) that the module at ``path`` imports."""
    return {name.split('.')[1] for name in _imported_modules(path) if name.count('.') and name.split('.')[1] in LAYERS}


@pytest.mark.parametrize('layer', LAYERS)
def test_imports_point_down_only(layer):
    allowed = set(LAYERS[: LAYERS.index(layer) + 1])
    upward = {
        str(path.relative_to(PACKAGE)): sorted(_imported_layers(path) - allowed)
        for path in (PACKAGE / layer).rglob('*.py')
        if _imported_layers(path) - allowed
    }
    assert upward == {}


# What only the core may do, so each trainer adapter stays a mapping of its trainer's events: auto mode's
# timing (core.auto) is reached through the guard's AutoMode, fused inference (core.fuse) only by the
# fused-evaluation adapters, and every channels_last/... key a logger receives is written in the core.
CORE_ONLY = {'channels_last_algo.core.auto': '', 'channels_last_algo.core.fuse': '_fused_eval.py'}


@pytest.mark.parametrize('path', sorted((PACKAGE / 'integrations').glob('*.py')), ids=lambda path: path.name)
def test_integrations_map_events_onto_the_guard_only(path):
    tree = ast.parse(path.read_text())
    imported = _imported_modules(path)
    keys = [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith('channels_last/')
    ]
    reached = [
        name
        for name in imported
        for module, allowed_in in CORE_ONLY.items()
        if (name == module or name.startswith(f'{module}.')) and not (allowed_in and path.name.endswith(allowed_in))
    ]
    assert reached == []
    assert keys == []


# Inside the application, lowest first: a subject imports only from itself and those before it
# (channels_last_algo/app/__init__.py states the rule).
APP = PACKAGE / 'app'
APP_SUBJECTS = ('data', 'recipes', 'runs', 'cli')


def _app_modules_imported(path: Path) -> set[str]:
    return {name for name in _imported_modules(path) if name.startswith('channels_last_algo.app.')}


@pytest.mark.parametrize('subject', APP_SUBJECTS)
def test_app_subjects_import_only_themselves_and_those_before(subject):
    allowed = set(APP_SUBJECTS[: APP_SUBJECTS.index(subject) + 1])
    later = {}
    for path in sorted((APP / subject).rglob('*.py')):
        subjects = {name.split('.')[2] for name in _app_modules_imported(path)}
        if subjects - allowed:
            later[str(path.relative_to(PACKAGE))] = sorted(subjects - allowed)
    assert later == {}


def test_no_import_cycle_between_app_modules():
    graph = {_module_name(path): _app_modules_imported(path) for path in APP.rglob('*.py')}
    cycles, state = [], {}

    def visit(module: str, trail: list[str]) -> None:
        state[module] = 'open'
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 'open':
                cycles.append(trail[trail.index(target) :] + [target])
            elif target not in state:
                visit(target, [*trail, target])
        state[module] = 'done'

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert cycles == []


# Size limits that keep each piece readable in one screen: a function (from `def` through its last
# line, docstring included) and a module of the package and of the benchmarks; tables are data, not
# functions, and are not counted.
MAX_FUNCTION_LINES = 40
MAX_MODULE_LINES = 400
SOURCES = sorted([*PACKAGE.rglob('*.py'), *(PACKAGE.parent / 'benchmarks').rglob('*.py')])


@pytest.mark.parametrize('path', SOURCES, ids=lambda path: str(path.relative_to(PACKAGE.parent)))
def test_functions_and_modules_stay_short(path):
    text = path.read_text()
    long_functions = [
        f'{node.name} (line {node.lineno}): {node.end_lineno - node.lineno + 1} lines'
        for node in ast.walk(ast.parse(text))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert long_functions == []
    assert len(text.splitlines()) <= MAX_MODULE_LINES


# inside the core: one swap engine below the tables that use it


def test_swapped_layers_import_nothing_from_safety():
    """``core/layers/`` holds the swapped layers (repairs and safe paths); the bug table in
    ``core/safety/`` names them, never the other way round."""
    upward = {
        str(path.relative_to(PACKAGE)): sorted(
            m for m in _imported_modules(path) if m.startswith('channels_last_algo.core.safety')
        )
        for path in (PACKAGE / 'core' / 'layers').rglob('*.py')
    }
    assert {path: modules for path, modules in upward.items() if modules} == {}


def test_swap_engine_and_runtime_sit_below_the_tables():
    """The engine, its records and the runtime description import nothing of the package but each other."""
    below = {'channels_last_algo.core.swap', 'channels_last_algo.core.swap_records', 'channels_last_algo.core.runtime'}
    for name in below:
        path = PACKAGE.parent / (name.replace('.', '/') + '.py')
        assert _imported_modules(path) <= below, path


def _assigns_class(path: Path) -> bool:
    """True when ``path``'s code (not its docstrings) assigns some object's ``__class__``."""
    for node in ast.walk(ast.parse(path.read_text())):
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AugAssign) else []
        )
        if any(isinstance(t, ast.Attribute) and t.attr == '__class__' for t in targets):
            return True
    return False


def test_only_the_swap_engine_reassigns_a_module_class():
    swappers = sorted(str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob('*.py') if _assigns_class(path))
    assert swappers == ['core/swap.py']


# The tests' folders: tests/core tests the core alone, so it imports nothing of the application nor of the
# benchmarks, directly or through a helper of the tests it imports (conftest, core/guarded_runs.py, ...).
TESTS = Path(__file__).resolve().parents[1]
CORE_TESTS = TESTS / 'core'
APART_FROM_CORE = ('channels_last_algo.app', 'benchmarks')


def _names_imported(path: Path) -> list[tuple[int, str]]:
    """(line, module) for each import in ``path``, at its top or inside a function: ``from a import b``
    gives ``a`` and ``a.b``; ``importlib.import_module('a')`` and ``pytest.importorskip('a')`` give ``a``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found += [(node.lineno, node.module), *((node.lineno, f'{node.module}.{a.name}') for a in node.names)]
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, 'attr', getattr(node.func, 'id', None)) in ('import_module', 'importorskip')
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append((node.lineno, node.args[0].value))
    return found


def _test_helper(name: str, folder: Path) -> Path | None:
    """The tests' module that a test in ``folder`` imports as ``name``: one beside it, or at tests/ (conftest);
    one of another folder (say app/recipe_runs.py) is not on its path and counts as itself."""
    top = name.split('.')[0]
    for place in (folder, TESTS, *(path for path in TESTS.iterdir() if path.is_dir() and path != folder)):
        if (place / f'{top}.py').is_file():
            return place / f'{top}.py'
    return None


def _imports_apart_from_core(path: Path, seen: set[Path] | None = None) -> list[str]:
    """``'core/test_x.py:12 imports benchmarks.zoo_models'`` for each import of the application or of the
    benchmarks by ``path`` or by the tests' modules it imports (``'... through conftest.py:30'``)."""
    seen = seen if seen is not None else {path}
    where = path.relative_to(TESTS)
    found = []
    for line, name in _names_imported(path):
        if any(name == banned or name.startswith(f'{banned}.') for banned in APART_FROM_CORE):
            found.append(f'{where}:{line} imports {name}')
        helper = _test_helper(name, path.parent)
        if helper is None or helper in seen:
            continue
        seen.add(helper)
        if helper.parent not in (path.parent, TESTS):
            found.append(f'{where}:{line} imports {name}, a helper of {helper.parent.relative_to(TESTS)}/ tests')
        deeper = _imports_apart_from_core(helper, seen)
        found += [f'{where}:{line} imports {name}, which: {problem}' for problem in deeper]
    return found


@pytest.mark.parametrize('path', sorted(CORE_TESTS.rglob('*.py')), ids=lambda path: path.name)
def test_core_tests_import_neither_the_application_nor_the_benchmarks(path):
    assert _imports_apart_from_core(path) == []


def test_the_check_of_the_core_tests_names_each_import_apart_from_the_core(tmp_path, monkeypatch):
    tests = tmp_path / 'tests'
    (tests / 'core').mkdir(parents=True)
    (tests / 'app').mkdir()
    (tests / 'conftest.py').write_text('import benchmarks.zoo_models\n')
    (tests / 'app' / 'recipe_runs.py').write_text('RECIPE = 1\n')
    (tests / 'core' / 'helper.py').write_text('def f():\n    from channels_last_algo import app\n')
    core_test = tests / 'core' / 'test_x.py'
    core_test.write_text(
        'import importlib\nfrom channels_last_algo.app.cli import entry\nfrom conftest import small_net\n'
        'import helper\nfrom recipe_runs import RECIPE\nimportlib.import_module("benchmarks")\n'
    )
    monkeypatch.setattr(sys.modules[__name__], 'TESTS', tests)
    assert _imports_apart_from_core(core_test) == [
        'core/test_x.py:2 imports channels_last_algo.app.cli',
        'core/test_x.py:2 imports channels_last_algo.app.cli.entry',
        'core/test_x.py:3 imports conftest, which: conftest.py:1 imports benchmarks.zoo_models',
        'core/test_x.py:4 imports helper, which: core/helper.py:2 imports channels_last_algo.app',
        'core/test_x.py:5 imports recipe_runs, a helper of app/ tests',
        'core/test_x.py:6 imports benchmarks',
    ]


def test_test_modules_have_names_unique_across_the_folders():
    """pytest's default import mode imports a test module by its file name, with its folder on ``sys.path``."""
    names = [path.name for path in TESTS.rglob('*.py') if '__pycache__' not in path.parts]
    assert sorted({name for name in names if names.count(name) > 1}) == []


def test_the_core_tests_tiny_resnet_is_the_demos():
    """conftest.TinyResNet (for core/ tests) and the demo's: the same modules, parameters and numbers."""
    from channels_last_algo.app.runs.demo import TinyResNet as DemoResNet
    from conftest import TinyResNet

    for kwargs in ({}, {'width': 16}, {'num_classes': 4, 'in_channels': 1}):
        torch.manual_seed(0)
        ours = TinyResNet(**kwargs)
        torch.manual_seed(0)
        demos = DemoResNet(**kwargs)
        assert str(ours) == str(demos)
        assert ours.state_dict().keys() == demos.state_dict().keys()
        assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), demos.state_dict().values()))
        x = torch.randn(2, kwargs.get('in_channels', 3), 16, 16)
        torch.testing.assert_close(ours(x), demos(x), rtol=0, atol=0)
