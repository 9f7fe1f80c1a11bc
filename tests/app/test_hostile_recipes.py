"""Hostile recipes, --set values, command arguments and Python API calls: each is refused before any
work with exit code 2 (or a TypeError for the API) and one line naming the file, key or argument and
the fix; never a traceback, never a run folder written."""

from __future__ import annotations

import importlib.util
import os
import textwrap
from pathlib import Path

import pytest
import torch
from recipe_runs import RECIPE, TINY, sets

import channels_last_algo
from channels_last_algo.app.cli.entry import main

HAS_COMPOSER = importlib.util.find_spec('composer') is not None
BASE = Path(RECIPE).read_text()
LAUGHS = 'a: &a [x, x, x, x, x, x, x, x, x, x]\n' + ''.join(
    f'{chr(98 + i)}: &{chr(98 + i)} [{", ".join(["*" + chr(97 + i)] * 10)}]\n' for i in range(8)
)


def _refused(capsys, argv: list[str], fragment: str, folder: Path) -> str:
    """Run the CLI; assert exit 2, one error line holding ``fragment``, no traceback and no run folder."""
    try:
        code = main(argv)
    except SystemExit as exit:  # argparse's refusal of an argument
        code = exit.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert 'Traceback' not in err
    lines = [line for line in err.splitlines() if 'error:' in line]
    assert len(lines) == 1 and fragment in lines[0], err
    assert not folder.exists(), f'{folder} was written'
    return lines[0]


def _train(recipe: str, folder: Path, *overrides: str) -> list[str]:
    return ['train', recipe, *sets([*TINY, f'train.save_folder={folder}', *overrides])]


# --- the recipe file --------------------------------------------------------------------------------------

RECIPE_FILES = {
    'a section given twice': (
        BASE + '\ntrain:\n  max_duration: 2ep\n',
        "the key 'train' is given twice (first on line",
    ),
    'a key given twice in a section': (
        BASE.replace('optimizer:\n', 'optimizer:\n  lr: 0.5\n', 1),
        "the key 'lr' is given twice",
    ),
    'billion laughs': (BASE + '\nlaughs:\n' + textwrap.indent(LAUGHS, '  '), 'aliases'),
    'an alias that contains itself': (BASE + '\nextra: &loop [*loop]\n', 'expands (through its aliases'),
    'nesting deeper than Python recurses': (BASE + '\nextra: ' + '[' * 20000 + ']' * 20000 + '\n', 'nests too deeply'),
    'a Python object tag': (BASE + '\nextra: !!python/object/apply:os.system [echo]\n', 'not valid YAML at line'),
    'a tab indent': (BASE + '\nextra:\n\tseed: 1\n', 'not valid YAML at line'),
    'an unclosed bracket': (BASE + '\nextra: [1, 2\n', 'not valid YAML at line'),
    'an empty file': ('', 'expected a mapping of recipe sections at the top, got NoneType'),
    'a list at the top': ('- name: r\n', 'expected a mapping of recipe sections at the top, got list'),
    'a scalar at the top': ('just text\n', 'expected a mapping of recipe sections at the top, got str'),
    'a misspelt section': (BASE + '\ntrian: {seed: 1}\n', "trian: unknown key; did you mean 'train'?"),
    'a number as a key': (BASE + '\n1: x\n', '1: unknown key'),
    'lr written 1e-3': (BASE.replace('lr: 2.048', 'lr: 1e-3'), "optimizer.lr: expected float, got str '1e-3'"),
    'lr quoted': (BASE.replace('lr: 2.048', "lr: '0.5'"), 'it is quoted: write 0.5 without quotes'),
    'a section that is a list': (
        BASE.replace('optimizer:\n  name: decoupled_sgdw\n', 'optimizer: [sgd]\nx:\n  name: decoupled_sgdw\n'),
        "optimizer: expected a mapping of OptimizerConfig keys, got list ['sgd']",
    ),
    'no name': (BASE.replace('name: resnet50_imagenet', ''), 'name: required key is missing'),
}


@pytest.mark.parametrize('case', sorted(RECIPE_FILES))
def test_a_hostile_recipe_file_is_refused_in_one_line(case, tmp_path, capsys):
    text, fragment = RECIPE_FILES[case]
    path = tmp_path / 'recipe.yaml'
    path.write_text(text)
    line = _refused(capsys, _train(str(path), tmp_path / 'run'), fragment, tmp_path / 'run')
    assert str(path) in line


@pytest.mark.parametrize(
    'data, fragment',
    [
        (BASE.encode().replace(b'# ', b'# \xe9 ', 1), 'is not UTF-8 text; save the recipe as UTF-8'),
        (BASE.encode('utf-16'), 'is not UTF-8 text'),
        (BASE.encode() + b'\n# ' + b'x' * (1 << 20), 'is too large for a recipe'),
    ],
    ids=['latin-1 byte', 'utf-16', 'larger than 1 MiB'],
)
def test_a_recipe_that_is_not_small_utf8_text_is_refused(data, fragment, tmp_path, capsys):
    path = tmp_path / 'recipe.yaml'
    path.write_bytes(data)
    _refused(capsys, _train(str(path), tmp_path / 'run'), fragment, tmp_path / 'run')


def test_a_byte_order_mark_and_merge_keys_are_valid_yaml(tmp_path):
    from channels_last_algo.app.recipes.loading import load_recipe

    path = tmp_path / 'recipe.yaml'
    text = 'x_defaults: &defaults {seed: 3}\n' + BASE
    path.write_bytes(b'\xef\xbb\xbf' + text.replace('train:\n', 'train:\n  <<: *defaults\n', 1).encode())
    with pytest.raises(channels_last_algo.app.recipes.schema.RecipeError, match='x_defaults: unknown key'):
        load_recipe(path)  # the BOM is read, the merge key is taken; only the extra section is refused


@pytest.mark.parametrize(
    'path, fragment',
    [('missing.yaml', 'no such recipe file'), ('.', 'no such recipe file (it is a folder)')],
)
def test_a_recipe_path_that_is_no_file_is_refused(path, fragment, tmp_path, capsys):
    _refused(capsys, _train(str(tmp_path / path), tmp_path / 'run'), fragment, tmp_path / 'run')


@pytest.mark.skipif(os.geteuid() == 0, reason='root reads files whatever their permissions')
def test_an_unreadable_recipe_is_refused(tmp_path, capsys):
    path = tmp_path / 'recipe.yaml'
    path.write_text(BASE)
    path.chmod(0)
    _refused(capsys, _train(str(path), tmp_path / 'run'), 'cannot be read (Permission denied)', tmp_path / 'run')


# --- --set values -----------------------------------------------------------------------------------------

# Each row: the overrides after the tiny run's (16 synthetic images in batches of 4, 6 batches), the message.
BAD_SETS = [
    (['optimizer.lr=1e-3'], 'YAML reads 1e-3 as text: write 1.0e-3'),
    (['train.global_batch_size=1e3'], 'YAML reads 1e3 as text: write 1000'),
    (["optimizer.lr='0.5'"], 'it is quoted: write 0.5 without quotes'),
    (['optimizer.lr=1.0e+400'], 'optimizer.lr: inf is out of range'),
    (['train.seed=' + '9' * 400], 'train.seed: an integer of 400 digits is out of range'),
    (['train.seed=' + '9' * 5000], 'a value YAML cannot read: Exceeds the limit (4300 digits)'),
    (['train.save_folder=runs/{name:>300}'], "'runs/{name:>300}' formats a placeholder"),
    (['data.path="/tmp/a\\0b"'], "data.path: '/tmp/a\\x00b' holds a NUL byte"),
    (['name=a b'], "name: 'a b' cannot name a run folder"),
    (['algorithms={1: true}'], 'algorithms: 1 is no algorithm name'),
    (
        ['model.num_classes=1000000'],
        'model.num_classes: 1000000 is out of range; expected an integer >= 1 and <= 100000',
    ),
    (['model.num_classes=' + '9' * 30], 'is out of range'),
    (['data.workers=1099511627776'], 'data.workers: 1099511627776 is out of range'),
    (['algorithms.ema={half_life: 10ba, half_life: 20ba}'], "the key 'half_life' is given twice"),
    (['name=[*undefined]'], "found undefined alias 'undefined'"),
    (['train=' + LAUGHS.replace('\n', ', ').rstrip(', ').join('{}')], 'aliases'),
    (['optimizer=5'], 'optimizer: expected a mapping of OptimizerConfig keys, got int 5'),
    (['optimizer.lr.value=1'], 'optimizer.lr is 2.048, not a mapping'),
    (['=5'], 'expected KEY.PATH=VALUE'),
    (['optimizer.lr'], 'expected KEY.PATH=VALUE'),
    (['name='], 'name: expected str, got NoneType None'),
    (['name=..'], "name: '..' cannot name a run folder"),
    (['algorithms=[ema]'], 'algorithms: expected a mapping, got list'),
    (['algorithms.channels_last=5'], 'algorithms.channels_last: expected a mapping of options, true or false'),
    (['algorithms.channels_last.inputs=5'], 'algorithms.channels_last.inputs'),
    (['algorithms.channels_last.mode=fast'], "algorithms.channels_last.mode: expected one of 'on', 'off', 'auto'"),
    (['scheduler.t_warmup=2ep'], "scheduler.t_warmup: '2ep' (32 samples) is not shorter than train.max_duration '6ba'"),
    (
        ['train.max_duration=64sp', 'scheduler.t_warmup=64sp'],
        "scheduler.t_warmup: '64sp' is not shorter than train.max_duration '64sp'",
    ),
    (['scheduler.t_warmup=1dur'], "scheduler.t_warmup: '1dur' is not shorter than train.max_duration"),
    (['scheduler.t_warmup=100sp'], "scheduler.t_warmup: '100sp' cannot be compared with train.max_duration"),
    (['data.synthetic_train_samples=3'], 'train.global_batch_size: 4 is more than the 3 samples'),
    (['model.name=os:system'], "model.name: 'os:system' does not take num_classes"),
    (['model.name=no_such_module_here:build'], "model.name: cannot load 'no_such_module_here:build'"),
    (['model.name=torch:no_such_builder'], "model.name: cannot load 'torch:no_such_builder'"),
    (['model.name=resnet5O'], "model.name: 'resnet5O' is no torchvision model name"),
    (['algorithms.randaugment=true'], 'algorithms.randaugment: cannot run in a recipe: it transforms PIL images'),
    (['algorithms.augmix={severity: 3}'], 'algorithms.augmix: cannot run in a recipe'),
    (['algorithms.selective_backprop=true'], 'algorithms.selective_backprop: cannot run in a recipe: it scores'),
]


@pytest.mark.parametrize('overrides, fragment', BAD_SETS, ids=[' '.join(o)[:50] for o, _ in BAD_SETS])
def test_a_hostile_set_value_is_refused_in_one_line(overrides, fragment, tmp_path, capsys):
    line = _refused(capsys, _train(RECIPE, tmp_path / 'run', *overrides), fragment, tmp_path / 'run')
    assert RECIPE in line


# --- the arguments of the commands -------------------------------------------------------------------------


@pytest.mark.parametrize(
    'out, fragment',
    [
        ('missing/model.pt2', 'its folder {tmp}/missing does not exist'),
        ('', 'is a folder; give a file name in it'),
        ('file/model.pt2', 'its folder {tmp}/file is a file'),
    ],
    ids=['folder missing', 'a folder', 'under a file'],
)
def test_export_refuses_an_output_it_cannot_write_before_building_anything(
    out, fragment, tmp_path, capsys, monkeypatch
):
    (tmp_path / 'file').write_text('x')
    built = []
    monkeypatch.setattr('channels_last_algo.app.cli.model_arguments._build', lambda *a, **k: built.append(a))
    _refused(capsys, ['export', 'resnet18', str(tmp_path / out)], fragment.format(tmp=tmp_path), tmp_path / 'run')
    assert not built


def test_compare_refuses_a_json_path_it_cannot_write_before_loading_the_recipe(tmp_path, capsys):
    argv = ['compare', RECIPE, '--json', str(tmp_path / 'missing' / 'out.json')]
    _refused(capsys, argv, '--json', tmp_path / 'run')


# --- the Python API -----------------------------------------------------------------------------------------


def _guard_on_init(model):
    return channels_last_algo.LayoutGuard().on_init(model)


API_CALLS = {
    'apply_channels_last(int)': (lambda: channels_last_algo.apply_channels_last(42), 'model is int 42'),
    'apply_channels_last(None)': (lambda: channels_last_algo.apply_channels_last(None), 'model is NoneType None'),
    'apply_channels_last(class)': (
        lambda: channels_last_algo.apply_channels_last(torch.nn.Conv2d),
        'model is the class Conv2d, not a torch.nn.Module; pass an instance: Conv2d(...)',
    ),
    'apply_channels_last(state_dict)': (
        lambda: channels_last_algo.apply_channels_last(torch.nn.Conv2d(3, 3, 1).state_dict()),
        'that looks like a state_dict',
    ),
    'apply_channels_last(builder)': (
        lambda: channels_last_algo.apply_channels_last(lambda: torch.nn.Conv2d(3, 3, 1)),
        'call it to build the model',
    ),
    'apply_channels_first(str)': (lambda: channels_last_algo.apply_channels_first('resnet50'), 'apply_channels_first'),
    'LayoutGuard.on_init(str)': (lambda: _guard_on_init('resnet50'), 'LayoutGuard.on_init: model is str'),
    'audit_model(list, x)': (
        lambda: channels_last_algo.audit_model([torch.nn.Conv2d(3, 3, 1)], torch.zeros(1, 3, 4, 4)),
        'audit_model: model is a list',
    ),
    'audit_model(model, list)': (
        lambda: channels_last_algo.audit_model(torch.nn.Conv2d(3, 3, 1), [torch.zeros(1, 3, 4, 4)]),
        'audit_model: example_input is a list',
    ),
    'fuse_for_inference(None)': (lambda: channels_last_algo.fuse_for_inference(None), 'fuse_for_inference'),
    'export_for_inference(int)': (
        lambda: channels_last_algo.export_for_inference(3, 'x.pt2', torch.zeros(1, 3, 4, 4)),
        'export_for_inference: model is int 3',
    ),
    'repair_model(str)': (lambda: channels_last_algo.repair_model('x'), 'repair_model: model is str'),
    'doctor(int)': (lambda: channels_last_algo.doctor(5, (1, 3, 8, 8)), 'doctor: model is a int'),
    'apply_channels_last(optimizers=str)': (
        lambda: channels_last_algo.apply_channels_last(torch.nn.Conv2d(3, 3, 1), optimizers='sgd'),
        "optimizers must be a torch.optim.Optimizer or a list of them, got str 'sgd'",
    ),
    'LayoutGuard.on_init(optimizers=int)': (
        lambda: channels_last_algo.LayoutGuard().on_init(torch.nn.Conv2d(3, 3, 1), optimizers=5),
        'LayoutGuard.on_init: optimizers must be',
    ),
    'canonical_state(model)': (
        lambda: channels_last_algo.canonical_state(torch.nn.Conv2d(3, 3, 1)),
        'canonical_state: takes a state_dict, got a Conv2d: pass model.state_dict()',
    ),
    'canonical_state(int)': (lambda: channels_last_algo.canonical_state(5), 'canonical_state: takes a state_dict'),
    'export_for_inference(path=int)': (
        lambda: channels_last_algo.export_for_inference(torch.nn.Conv2d(3, 3, 1), 5, torch.zeros(2, 3, 4, 4)),
        'export_for_inference: path must be a file path, got int 5',
    ),
    'to_channels_last(list)': (
        lambda: channels_last_algo.to_channels_last([[1.0]]),
        'to_channels_last: expected a torch.Tensor, got a list',
    ),
    'weight_layout_for(None)': (lambda: channels_last_algo.weight_layout_for(None), 'weight_layout_for: model is'),
}


def _export_to(path):
    channels_last_algo.export_for_inference(torch.nn.Conv2d(3, 3, 1).eval(), path, torch.zeros(2, 3, 4, 4))


VALUE_CALLS = {
    'fuse_for_inference(rtol=-1)': (
        lambda tmp_path: channels_last_algo.fuse_for_inference(torch.nn.Conv2d(3, 3, 1).eval(), rtol=-1),
        'fuse_for_inference: rtol must be a number above 0, got -1',
    ),
    "fuse_for_inference(rtol='1e-3')": (
        lambda tmp_path: channels_last_algo.fuse_for_inference(torch.nn.Conv2d(3, 3, 1).eval(), rtol='1e-3'),
        "fuse_for_inference: rtol must be a number above 0, got '1e-3'",
    ),
    'export_for_inference(path=folder)': (
        lambda tmp_path: _export_to(tmp_path),
        'export_for_inference: path {tmp_path}: is a folder; give a file name in it',
    ),
    'export_for_inference(path=a recipe)': (
        lambda tmp_path: _export_to(tmp_path / 'recipe.yaml'),
        'recipe.yaml: exists and is no .pt2 file (it would be overwritten)',
    ),
    'audit_model(input of other channels)': (
        lambda tmp_path: channels_last_algo.audit_model(torch.nn.Conv2d(3, 3, 1), torch.zeros(1, 4, 4, 4)),
        'audit_model: Conv2d itself raises on example_input (RuntimeError: Given groups=1',
    ),
    'audit_model(two inputs to a one-input model)': (
        lambda tmp_path: channels_last_algo.audit_model(torch.nn.Conv2d(3, 3, 1), (torch.zeros(1, 3, 4, 4),) * 2),
        'audit_model: Conv2d itself raises on example_input (TypeError: ',
    ),
}

FLAG_CALLS = {
    "apply_channels_last(kernel_safety='no')": (
        lambda: channels_last_algo.apply_channels_last(torch.nn.Conv2d(3, 3, 1), kernel_safety='no'),
        "apply_channels_last: kernel_safety must be True or False, got str 'no'",
    ),
    'apply_channels_last(repair=None)': (
        lambda: channels_last_algo.apply_channels_last(torch.nn.Conv2d(3, 3, 1), repair=None),
        'apply_channels_last: repair must be True or False, got NoneType None',
    ),
    "audit_model(strict='yes')": (
        lambda: channels_last_algo.audit_model(torch.nn.Conv2d(3, 3, 1), torch.zeros(1, 3, 4, 4), strict='yes'),
        'audit_model: strict must be True or False',
    ),
    "export_for_inference(dynamic_batch='no')": (
        lambda: channels_last_algo.export_for_inference(
            torch.nn.Conv2d(3, 3, 1), 'x.pt2', torch.zeros(2, 3, 4, 4), dynamic_batch='no'
        ),
        'export_for_inference: dynamic_batch must be True or False',
    ),
    "fuse_for_inference(traceable='yes')": (
        lambda: channels_last_algo.fuse_for_inference(torch.nn.Conv2d(3, 3, 1), traceable='yes'),
        'fuse_for_inference: traceable must be True or False',
    ),
    'LayoutGuard(inputs=lambda: True)': (
        lambda: channels_last_algo.LayoutGuard(inputs=lambda: True),
        "inputs must be 'auto'",
    ),
}


@pytest.mark.parametrize('case', sorted(FLAG_CALLS))
def test_the_api_refuses_a_flag_that_is_not_a_bool_and_a_predicate_of_the_wrong_shape(case):
    call, fragment = FLAG_CALLS[case]
    with pytest.raises(ValueError) as raised:
        call()
    assert fragment in str(raised.value) and '\n' not in str(raised.value)


@pytest.mark.parametrize('case', sorted(API_CALLS))
def test_the_api_refuses_what_is_not_a_model_in_one_line(case):
    call, fragment = API_CALLS[case]
    with pytest.raises(TypeError) as raised:
        call()
    assert fragment in str(raised.value) and '\n' not in str(raised.value)


@pytest.mark.parametrize('case', sorted(VALUE_CALLS))
def test_the_api_refuses_a_value_it_cannot_use_in_one_line_and_overwrites_nothing(case, tmp_path):
    """Before any work: a tolerance that is no positive number, an export path that is a folder or another
    kind of file (left as it was), an example input the model itself refuses (named, with the model's error)."""
    (tmp_path / 'recipe.yaml').write_text('model: resnet50\n')
    call, fragment = VALUE_CALLS[case]
    with pytest.raises(ValueError) as raised:
        call(tmp_path)
    assert fragment.format(tmp_path=tmp_path) in str(raised.value) and '\n' not in str(raised.value)
    assert (tmp_path / 'recipe.yaml').read_text() == 'model: resnet50\n'


# --- what only Composer checks ----------------------------------------------------------------------------


@pytest.mark.skipif(not HAS_COMPOSER, reason='compare runs Composer ChannelsLast beside this project')
def test_compare_refuses_a_batch_it_cannot_hold_in_one_pass_before_building_anything(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr('channels_last_algo.app.runs.compare._batches', lambda *args: pytest.fail('data were built'))
    argv = ['compare', RECIPE, '--set', 'data.train_crop=176', '--set', 'train.global_batch_size=65536']
    _refused(capsys, argv, 'train.global_batch_size: compare trains the whole batch of 65536 images', tmp_path / 'x')


@pytest.mark.skipif(not HAS_COMPOSER, reason='the algorithms and the model are built with Composer')
@pytest.mark.parametrize(
    'override, fragment',
    [
        ('algorithms.gated_linear_units=true', 'algorithms.gated_linear_units: GatedLinearUnits refuses it'),
        ('algorithms.label_smoothing.smoothing=1.5', 'algorithms.label_smoothing.smoothing: 1.5 is out of range'),
        ('algorithms.ema.half_life=0ba', "algorithms.ema.half_life: '0ba' is out of range"),
        ('model.name=hostile_models:returns_an_int', "failed: ValueError: 'hostile_models:returns_an_int' built a int"),
        ('model.name=hostile_models:raises', 'failed: RuntimeError: the builder broke'),
        ('model.name=hostile_models:takes_nothing', "'hostile_models:takes_nothing' does not take num_classes"),
    ],
)
def test_what_composer_builds_is_refused_in_one_line(override, fragment, tmp_path, capsys, monkeypatch):
    (tmp_path / 'hostile_models.py').write_text(
        'def returns_an_int(num_classes):\n    return 42\n'
        'def raises(num_classes):\n    raise RuntimeError("the builder broke")\n'
        'def takes_nothing():\n    return None\n'
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    _refused(capsys, _train(RECIPE, tmp_path / 'run', override), fragment, tmp_path / 'not-written')
    assert not list((tmp_path / 'run').glob('*.pt'))


@pytest.mark.parametrize(
    'argv, fragment',
    [
        (['audit', 'resnet18', '--input', '64,3,2000,2000'], 'one training pass of resnet18 on it needs about'),
        (['audit', 'resnet18', '--eval', '--input', '2,3,90000,90000'], 'one forward pass of resnet18 on it'),
        (['doctor', 'resnet18', '--input', '64,3,2000,2000', '--device', 'cpu'], 'needs about'),
        (['export', 'resnet18', '{tmp}/out.pt2', '--input', '2,3,90000,90000'], 'give a smaller input'),
        (['audit', 'resnet18', '--input', '1,3,2,2'], 'fails on a random input of --input 1,3,2,2'),
        (['audit', 'resnet18', '--input', '2,1,32,32'], "resnet18's first convolution conv1 takes 3 channels"),
        (['demo', '--image-size', '100000', '--batch-size', '1'], '--batch-size 1 --image-size 100000: one training'),
        (['demo', '--image-size', '2', '--batch-size', '1', '--steps', '1'], 'Expected more than 1 value per channel'),
        (['doctor', 'resnet18', '--input', '2,3,32,32', '--timeout', 'inf'], "--timeout: 'inf' is not a positive"),
        (['doctor', 'resnet18', '--input', '2,3,32,32', '--timeout', '-1'], "--timeout: '-1' is not a positive"),
        (['doctor', 'resnet18', '--input', '2,3,32,32', '--device', 'tpu'], "device must be 'cpu', 'cuda' or 'cuda:N'"),
        (['doctor', 'resnet18', '--input', '2,3,32,32', '--device', 'cuda:99'], 'no such CUDA device is visible'),
    ],
    ids=[
        'audit too large',
        'eval too large',
        'doctor too large',
        'export too large',
        'one value a channel',
        'grey',
        'demo too large',
        'demo too small',
        'doctor timeout inf',
        'doctor timeout negative',
        'doctor device tpu',
        'doctor device missing',
    ],
)
def test_a_model_command_refuses_an_input_it_cannot_run_before_allocating_it(argv, fragment, tmp_path, capsys):
    _refused(capsys, [arg.format(tmp=tmp_path) for arg in argv], fragment, tmp_path / 'out.pt2')


def test_a_model_command_names_a_builder_that_fails(tmp_path, capsys, monkeypatch):
    (tmp_path / 'hostile_builders.py').write_text('def broken():\n    raise KeyError("no such layer")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    _refused(
        capsys,
        ['audit', 'hostile_builders:broken', '--input', '2,3,32,32'],
        "MODEL hostile_builders:broken: building it failed: KeyError: 'no such layer'",
        tmp_path / 'out.pt2',
    )


def _outputs(tmp_path: Path) -> None:
    (tmp_path / 'ep1-ba6-rank0.pt').write_bytes(b'a checkpoint')
    (tmp_path / 'link.pt2').symlink_to(tmp_path / 'ep1-ba6-rank0.pt')
    os.mkfifo(tmp_path / 'fifo.pt2')
    (tmp_path / 'recipe.yaml').write_text(BASE)
    torch.save(torch.nn.Linear(2, 2).state_dict(), tmp_path / 'linear.pt')


@pytest.mark.parametrize(
    'argv, fragment',
    [
        (['export', 'resnet18', '{tmp}/ep1-ba6-rank0.pt'], 'exists and is no .pt2 file (it would be overwritten)'),
        (['export', 'resnet18', '{tmp}/link.pt2'], 'is a link; writing would replace the file it points to'),
        (['export', 'resnet18', '{tmp}/fifo.pt2'], 'is a pipe, socket or device, not a regular file'),
        (['export', 'resnet18', '/dev/full'], 'is a pipe, socket or device'),
        (['export', 'resnet18', '{tmp}/' + 'a' * 300 + '.pt2'], 'cannot be looked at (File name too long)'),
        (['export', 'resnet18', '{tmp}/out.pt2', '--weights', '{tmp}/fifo.pt2'], 'it is no regular file'),
        (['export', 'resnet18', '{tmp}/linear.pt', '--weights', '{tmp}/linear.pt'], 'is one of the files this command'),
        (
            ['export', 'resnet18', '{tmp}/out.pt2', '--weights', '{tmp}/linear.pt', '--input', '2,3,32,32'],
            '--weights {tmp}/linear.pt: Missing key(s) in state_dict',
        ),
        (['compare', '{tmp}/recipe.yaml', '--json', '{tmp}/recipe.yaml'], 'is one of the files this command reads'),
        (['compare', RECIPE, '--json', '{tmp}/ep1-ba6-rank0.pt'], 'exists and is no .json file'),
    ],
    ids=[
        'export over a checkpoint',
        'export through a link',
        'export into a pipe',
        'export into a device',
        'a name too long',
        'weights from a pipe',
        'export over its weights',
        'weights of another model',
        'json over the recipe',
        'json over a checkpoint',
    ],
)
def test_an_output_that_would_destroy_a_file_or_hang_is_refused_first(argv, fragment, tmp_path, capsys):
    _outputs(tmp_path)
    before = {path.name: path.read_bytes() for path in tmp_path.iterdir() if path.is_file() and not path.is_symlink()}
    _refused(capsys, [arg.format(tmp=tmp_path) for arg in argv], fragment.format(tmp=tmp_path), tmp_path / 'run')
    assert {name: (tmp_path / name).read_bytes() for name in before} == before


def test_an_error_no_check_foresaw_is_one_line_with_its_traceback_in_a_file(tmp_path, capsys, monkeypatch):
    def broken(args):
        raise KeyError('an internal slip')

    monkeypatch.setattr('channels_last_algo.app.cli.model_commands._run_audit', broken)
    monkeypatch.setattr('tempfile.tempdir', str(tmp_path))
    line = _refused(capsys, ['audit', 'resnet18'], "KeyError: 'an internal slip' (in ", tmp_path / 'run')
    log = Path(line.rsplit('the full traceback is in ', 1)[1])
    assert log.parent == tmp_path and 'an internal slip' in log.read_text()
