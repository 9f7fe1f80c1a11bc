"""Hostile run folders, checkpoints and failures at run time of ``channels-last train``: each is refused or
reported in one line that names the path or the place and the fix, with exit code 2, no traceback, and
every file that was there left as it was.

The tiny run of :mod:`recipe_runs` is trained once for the module; each case works on a copy of its
folder (``ep0-ba2``, ``ep0-ba4``, ``ep1-ba6`` and the ``latest`` link). The cases refused before any
work fail if the data or the model are built.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import socket
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytest.importorskip('composer')

import torch  # noqa: E402
from recipe_runs import train_args  # noqa: E402

from channels_last_algo.app.cli.entry import main  # noqa: E402
from channels_last_algo.app.recipes import models  # noqa: E402
from channels_last_algo.app.runs import train, trainer  # noqa: E402
from channels_last_algo.app.runs.checkpoint_files import read_state  # noqa: E402
from channels_last_algo.app.runs.demo import TinyResNet  # noqa: E402
from channels_last_algo.app.runs.folder import RunFolder  # noqa: E402

NEW = 'give this run another folder (--set train.save_folder=PATH)'
NEWER = ('--resume', '--set', 'train.max_duration=8ba')  # resuming the run with batches left to train
HOST = socket.gethostname()
ROOT = os.geteuid() == 0


# --- helpers -----------------------------------------------------------------------------------------


@pytest.fixture(scope='module')
def trained(tmp_path_factory) -> Path:
    """The folder of the tiny run, trained once for the module: never changed."""
    folder = tmp_path_factory.mktemp('trained') / 'run'
    assert main(train_args(folder)) == 0
    return folder


@pytest.fixture
def run(trained, tmp_path) -> Path:
    """A copy of the trained run's folder, for one case to turn hostile."""
    copy = tmp_path / 'run'
    shutil.copytree(trained, copy, symlinks=True)
    return copy


def forbid_work(monkeypatch) -> None:
    """Fail the test if the run builds its data (for --check-data too) or its model."""

    def must_not_run(*args, **kwargs):
        pytest.fail('the run built its data or model before refusing')

    for module, name in ((trainer, 'build_datasets'), (train, 'build_datasets'), (models, 'build_model')):
        monkeypatch.setattr(module, name, must_not_run)


def snapshot(root: Path) -> dict[str, str]:
    """Every entry under ``root``: a file's sha256, a link's target, 'folder' or 'other'."""
    found = {}
    for folder, subfolders, files in os.walk(root):
        for path in (Path(folder) / name for name in subfolders + files):
            if path.is_symlink():
                found[str(path)] = '-> ' + os.readlink(path)
            elif path.is_file():
                found[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
            else:
                found[str(path)] = 'folder' if path.is_dir() else 'other'
    return found


def assert_kept(before: dict[str, str], after: dict[str, str], written: bool = True) -> None:
    """Every entry of ``before`` as it was; unless ``written``, nothing new but an empty run folder."""
    assert {key: after.get(key) for key in before} == before
    assert written or all(after[key] == 'folder' for key in after.keys() - before.keys()), after.keys() - before.keys()


def error_message(capfd) -> str:
    """The message of the one error line the command ended with; no traceback anywhere."""
    err = capfd.readouterr().err
    assert 'Traceback' not in err and err.count('error: ') == 1, err[-3000:]
    line = err.strip().splitlines()[-1]
    assert 'channels-last train: error: ' in line, err[-3000:]
    return line.split('channels-last train: error: ', 1)[1]


def assert_refused(message: str, head: str, tail: str) -> None:
    assert message.startswith(head) and message.endswith(tail), message


def checkpoint_copy(source: Path, target: Path, batch: int, classes: int = 10) -> Path:
    """``source`` written to ``target`` as a checkpoint after ``batch`` batches of a ``classes``-way head."""
    checkpoint = torch.load(source, map_location='cpu', weights_only=False)
    state = checkpoint['state']
    state['model']['module.head.weight'] = torch.zeros(classes, 32)
    state['model']['module.head.bias'] = torch.zeros(classes)
    state['timestamp']['Timestamp']['batch'] = batch
    torch.save(checkpoint, target)
    return target


def zip_archive(path: Path) -> None:
    with zipfile.ZipFile(path, 'w') as archive:
        archive.writestr('notes.txt', 'a zip archive, not a checkpoint')


def truncated(source: Path, path: Path) -> Path:
    path.write_bytes(source.read_bytes()[: source.stat().st_size // 2])
    return path


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, '-c', 'pass'])
    process.wait()
    return process.pid


# --- refused before any work ------------------------------------------------------------------------


@pytest.fixture
def refused(tmp_path, capfd, monkeypatch):
    """``refused(folder, extra, head, tail)``: training in ``folder`` with ``extra`` ends with exit code 2 and one
    line from ``head`` to ``tail``, with nothing built, lost or written."""

    def check(folder: Path, extra: tuple[str, ...], head: str, tail: str) -> None:
        forbid_work(monkeypatch)
        before = snapshot(tmp_path)
        assert main(train_args(folder, *extra)) == 2
        assert_refused(error_message(capfd), head, tail)
        assert_kept(before, snapshot(tmp_path), written=False)

    return check


def _linking(target: str):
    return lambda path: path.symlink_to(target)


NO_FILE = 'give --resume a checkpoint file, or --resume alone for the newest one'
CORRUPT = 'delete the file and use --resume for the newest readable one'
TRAINING = 'resume from a checkpoint that channels-last train wrote'


@pytest.mark.parametrize(
    'make, problem, fix',
    [
        (None, 'does not exist', NO_FILE),
        (Path.mkdir, 'is a folder', NO_FILE),
        (os.mkfifo, 'is not a regular file', NO_FILE),
        (_linking('y.pt'), 'is a link to y.pt, which does not exist', NO_FILE),
        (Path.touch, 'is truncated or corrupt: not a whole checkpoint (File is not a zip file)', CORRUPT),
        (lambda path: truncated(path.parent / 'run' / 'ep1-ba6-rank0.pt', path), 'is truncated or corrupt: ', CORRUPT),
        (zip_archive, 'cannot be read as a checkpoint (', 'resume another with --resume PATH'),
        (lambda path: torch.save(torch.zeros(3), path), 'is not a Composer training checkpoint (no state.', TRAINING),
        (lambda path: torch.save({'state': {'model': {}}}, path), 'is not a Composer training checkpoint', TRAINING),
    ],
    ids=['none', 'a folder', 'a pipe', 'a link to nowhere', 'empty', 'truncated', 'a zip', 'a tensor', 'no time'],
)
def test_a_checkpoint_to_resume_that_is_none_is_refused(make, problem, fix, run, refused):
    path = run.parent / 'x.pt'
    if make is not None:
        make(path)
    refused(run, (*NEWER, '--resume', str(path)), f'{path} {problem}', fix)


NAMED = 'is named as a checkpoint but is '
LOCK = 'must be the lock file of a run, but is '
MOVE = 'move it out of {run}, or ' + NEW
DELETE = 'delete it (a run makes its own), or ' + NEW


@pytest.mark.parametrize(
    'name, make, extra, problem, fix',
    [
        ('ep2-ba8-rank0.pt', Path.mkdir, NEWER, NAMED + 'a folder', MOVE),
        ('ep2-ba8-rank0.pt', _linking('x'), ('--overwrite',), NAMED + 'a link to x, which does not exist', MOVE),
        ('ep2-ba8-rank0.pt', _linking('ep0-ba2-rank0.pt'), NEWER, NAMED + 'a link to ep0-ba2-rank0.pt', MOVE),
        ('ep2-ba8-rank0.pt', os.mkfifo, (), NAMED + 'not a regular file', MOVE),
        ('latest-rank0.pt', lambda path: (path.unlink(), path.mkdir()), NEWER, NAMED + 'a folder', MOVE),
        ('.run.lock', Path.mkdir, NEWER, LOCK + 'a folder', DELETE),
        ('.run.lock', _linking('ep0-ba2-rank0.pt'), NEWER, LOCK + 'a link to ep0-ba2-rank0.pt', DELETE),
        ('.run.lock', os.mkfifo, (), LOCK + 'not a regular file', DELETE),
    ],
    ids=['a folder', 'a link to nowhere, --overwrite', 'a link', 'a pipe', 'latest a folder', 'lock a folder']
    + ['lock a link to a checkpoint', 'lock a pipe'],
)
def test_an_entry_of_the_folder_that_is_no_file_of_its_kind_is_refused(name, make, extra, problem, fix, run, refused):
    make(run / name)
    refused(run, extra, f'{run / name} {problem}', fix.format(run=run))


def _write(path: Path, text: str = 'not a folder') -> Path:
    path.write_text(text)
    return path


def _link(path: Path, target: Path) -> Path:
    path.symlink_to(target)
    return path


def _unwritable(run: Path, request) -> Path:
    run.chmod(0o555)
    request.addfinalizer(lambda: run.chmod(0o755))
    return run


def _held_by_this_process(run: Path, request) -> Path:
    holder = RunFolder(run)
    holder.lock()
    request.addfinalizer(holder.unlock)
    return run


def _held_by_a_live_process(run: Path, request) -> Path:
    process = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])
    request.addfinalizer(lambda: (process.kill(), process.wait()))
    return _write(run / '.run.lock', f'{process.pid} {HOST}\n').parent


def _only_a_dangling_latest(run: Path, request) -> Path:
    (run.parent / 'lone').mkdir()
    return _link(run.parent / 'lone' / 'latest-rank0.pt', Path('a.pt')).parent


def _truncated_all(run: Path, request) -> Path:
    for checkpoint in run.glob('ep*.pt'):
        truncated(checkpoint, checkpoint)
    return run


SETUPS = {  # by case: turn the copy ``run`` hostile and return the save folder to train in (else ``run``)
    'a file': lambda run, request: _write(run.parent / 'file'),
    'a file, --check-data': lambda run, request: _write(run.parent / 'file'),
    'under a file': lambda run, request: _write(run.parent / 'file') / 'run',
    'a link to nowhere': lambda run, request: _link(run.parent / 'gone', run.parent / 'nowhere'),
    'not writable': _unwritable,
    'in use here, --overwrite': _held_by_this_process,
    'in use by a live pid': _held_by_a_live_process,
    'an earlier run, a stale lock': lambda run, request: _write(run / '.run.lock', f'{dead_pid()} {HOST}\n').parent,
    'an earlier run, a partial folder': lambda run, request: (run / '.ep1-ba8-rank0.pt.1.partial').mkdir() or run,
    'resume an empty folder': lambda run, request: run.parent / 'new',
    'resume truncated checkpoints': _truncated_all,
    'resume a link to nowhere only': _only_a_dangling_latest,
}
EARLIER = '{run} holds the checkpoints of an earlier run (ep0-ba2-rank0.pt, ep0-ba4-rank0.pt, ep1-ba6-rank0.pt)'
OVER = 'give this run a new folder (--set train.save_folder=PATH), or replace them with --overwrite'
END = 'or start afresh in a new folder (--set train.save_folder=PATH)'
NONE_READABLE = 'resume one from elsewhere with --resume PATH, or start afresh with --overwrite instead of --resume'
FINISHED = '{run}/ep1-ba6-rank0.pt is the end of a finished run ('
OLDER = '{run}/ep0-ba2-rank0.pt is older than ep0-ba4-rank0.pt, ep1-ba6-rank0.pt in the same folder'
TRUNCATED = '--resume: no readable checkpoint in {run} (the newest: {run}/ep1-ba6-rank0.pt is truncated or corrupt'
OTHER = 'resume {trained}/ep0-ba4-rank0.pt into a new folder (--set train.save_folder=PATH), or replace them with '
OTHER += '--overwrite'
LONE = '--resume: no readable checkpoint in {parent}/lone (the newest: {parent}/lone/latest-rank0.pt is a link to a.pt'
IN_USE = '{run} is in use by another run (pid'
CASES = [
    ('a file', (), '{parent}/file is a file, not a folder', 'move the file away, or ' + NEW),
    ('a file, --check-data', ('--check-data',), '{parent}/file is a file, not a folder', NEW),
    ('under a file', (), '{parent}/file/run cannot be made: {parent}/file is a file, not a folder', NEW),
    ('a link to nowhere', (), '{parent}/gone is a link to {parent}/nowhere, which does not exist', NEW),
    ('not writable', NEWER, '{run} is not writable for this user', 'make it writable (chmod u+rwx), or ' + NEW),
    ('in use here, --overwrite', ('--overwrite',), IN_USE, 'wait for it to finish, or ' + NEW),
    ('in use by a live pid', ('--resume',), IN_USE, 'If no run uses it, delete {run}/.run.lock'),
    ('an earlier run', (), EARLIER, OVER),
    ('an earlier run, a stale lock', (), EARLIER, OVER),
    ('an earlier run, a partial folder', (), EARLIER, OVER),
    ('resume a finished run', ('--resume',), FINISHED + '6ba of train.max_duration 6ba)', END),
    ('resume a finished run in epochs', ('--resume', '--set', 'train.max_duration=1ep'), FINISHED + '1ep of', END),
    ('resume a longer run', ('--resume', '--set', 'train.max_duration=4ba'), '{run}/ep1-ba6-rank0.pt is past the', END),
    ('resume an older checkpoint', (*NEWER, '--resume', '{run}/ep0-ba2-rank0.pt'), OLDER, 'from ep0-ba2-rank0.pt'),
    ('resume another run into this one', (*NEWER, '--resume', '{trained}/ep0-ba4-rank0.pt'), '{run} holds', OTHER),
    ('resume an empty folder', ('--resume',), '--resume: {parent}/new holds no checkpoint', 'to the run to resume'),
    ('resume truncated checkpoints', NEWER, TRUNCATED, NONE_READABLE),
    ('resume a link to nowhere only', ('--resume',), LONE, NONE_READABLE),
]


@pytest.mark.parametrize(
    'case, extra, head, tail',
    [pytest.param(*row, marks=pytest.mark.skipif(ROOT and row[0] == 'not writable', reason='root')) for row in CASES],
)
def test_a_hostile_save_folder_or_resume_is_refused_in_one_line_before_any_work(
    case, extra, head, tail, run, trained, refused, request
):
    folder = SETUPS.get(case, lambda run, request: run)(run, request)
    names = {'run': run, 'parent': run.parent, 'trained': trained}
    extra = tuple(arg.format(**names) for arg in extra)
    refused(folder, extra, head.format(**names), tail.format(**names))


@pytest.mark.skipif(not ROOT or not os.path.ismount('/sys'), reason='needs root (past the mode check) and sysfs')
def test_a_folder_the_file_system_refuses_to_make_is_named_in_one_line_when_it_is_locked(capfd):
    folder = Path('/sys/channels-last-hostile-run')  # sysfs makes no folders, whatever the modes say
    assert main(train_args(folder)) == 2
    assert_refused(
        error_message(capfd),
        f'cannot lock {folder} for this run: Operation not permitted',
        f'make sure this user can create and write {folder}, or {NEW}',
    )
    assert not folder.exists()


def test_a_stale_lock_of_a_dead_process_is_taken_over_with_a_warning(run, caplog, capfd):
    pid = dead_pid()
    (run / '.run.lock').write_text(f'{pid} {HOST}\n')
    assert main(train_args(run, *NEWER)) == 0
    assert f'{run}: taking over the lock of pid {pid}, which is gone (a run that was stopped)' in caplog.text
    assert 'Traceback' not in capfd.readouterr().err
    assert not (run / '.run.lock').exists()
    assert read_state(run / 'latest-rank0.pt')['timestamp']['Timestamp']['batch'] == 8


# --- a checkpoint of another model ----------------------------------------------------------------


def _foreign_folder(run: Path) -> Path:
    for checkpoint in run.glob('ep*.pt'):
        checkpoint_copy(checkpoint, checkpoint, read_state(checkpoint)['timestamp']['Timestamp']['batch'], classes=5)
    return run / 'ep1-ba6-rank0.pt'


def _foreign_beside(run: Path) -> Path:
    foreign = checkpoint_copy(run / 'ep0-ba4-rank0.pt', run.parent / 'other.pt', 4, classes=5)
    shutil.rmtree(run)  # resumed into a new folder
    return foreign


OWN_FIX = "continue from this recipe's own newest checkpoint with --resume {run}/ep1-ba6-rank0.pt --overwrite "
OWN_FIX += '(which deletes it)'
FOLDER_FIX = '{run} holds the run of another recipe: give this run a new folder (--set train.save_folder=PATH), or '
FOLDER_FIX += 'replace that run with --overwrite (without --resume)'
FILE_FIX = 'resume it with the recipe (model, algorithms and --set overrides) that wrote it, or resume a checkpoint '
FILE_FIX += 'of this recipe'


@pytest.mark.parametrize(
    'make, fix',
    [
        (lambda run: checkpoint_copy(run / 'ep1-ba6-rank0.pt', run / 'ep2-ba8-rank0.pt', 8, classes=5), OWN_FIX),
        (_foreign_folder, FOLDER_FIX),
        (_foreign_beside, FILE_FIX),
    ],
    ids=['newest in the folder', 'the whole folder', 'given by --resume'],
)
def test_a_checkpoint_of_another_model_is_named_once_with_the_fix_that_fits(make, fix, run, tmp_path, capfd):
    foreign = make(run)
    before = snapshot(tmp_path)
    resume = ['--resume'] + ([] if foreign.parent == run else [str(foreign)])
    assert main(train_args(run, *resume, '--set', 'train.max_duration=10ba')) == 2
    message = error_message(capfd)
    head = f"{foreign} holds another model than this recipe builds ('module.head.weight' is [5, 32] there and [10, 32]"
    assert_refused(message, head + ' here); ', fix.format(run=run))
    assert message.count(foreign.name) == 1
    assert_kept(before, snapshot(tmp_path), written=False)


def test_the_fix_given_for_a_newer_checkpoint_of_another_model_trains_on(run, capfd):
    checkpoint_copy(run / 'ep1-ba6-rank0.pt', run / 'ep2-ba8-rank0.pt', 8, classes=5)
    assert main(train_args(run, '--resume', '--set', 'train.max_duration=10ba')) == 2
    advice = error_message(capfd).split(' with ')[-1].split(' (')[0].split()
    assert advice == ['--resume', str(run / 'ep1-ba6-rank0.pt'), '--overwrite']
    assert main(train_args(run, *advice, '--set', 'train.max_duration=10ba')) == 0
    assert not (run / 'ep2-ba8-rank0.pt').exists()
    newest = read_state(run / 'latest-rank0.pt')
    assert newest['timestamp']['Timestamp']['batch'] == 10 and newest['model']['module.head.weight'].shape == (10, 32)


# --- --resume skips what is not a whole checkpoint ---------------------------------------------------


@pytest.mark.parametrize(
    'make, reason',
    [
        (zip_archive, 'cannot be read as a checkpoint ('),
        (lambda path: torch.save(torch.zeros(3), path), 'is not a Composer training checkpoint'),
        (lambda path: truncated(path.parent / 'ep1-ba6-rank0.pt', path), 'is truncated or corrupt: '),
    ],
    ids=['a zip archive', 'a saved tensor', 'a truncated checkpoint'],
)
def test_resume_skips_a_newer_file_that_is_no_checkpoint_and_trains_on_from_the_newest_one(
    make, reason, run, capfd, caplog
):
    junk = run / 'ep3-ba12-rank0.pt'
    make(junk)
    kept = snapshot(run)
    assert main(train_args(run, *NEWER)) == 0
    assert 'Traceback' not in capfd.readouterr().err
    assert f'--resume: skipping an unusable checkpoint: {junk} {reason}' in caplog.text
    assert_kept({k: v for k, v in kept.items() if 'latest' not in k}, snapshot(run))
    assert read_state(run / 'latest-rank0.pt')['timestamp']['Timestamp']['batch'] == 8
    assert (run / 'latest-rank0.pt').resolve().name == 'ep1-ba8-rank0.pt'


# --- failures at run time ----------------------------------------------------------------------------


class BreaksInTraining(TinyResNet):
    """TinyResNet whose forward raises in training once it trained ``batches`` batches."""

    def __init__(self, num_classes: int = 10, batches: int = 0) -> None:
        super().__init__(num_classes=num_classes)
        self.batches = batches

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            if self.batches == 0:
                raise RuntimeError('the layer broke in training\nits second line')
            self.batches -= 1
        return super().forward(x)


breaks_after_two = functools.partial(BreaksInTraining, batches=2)


def _broken_optimizer_state(trained: Path, folder: Path) -> None:
    """The checkpoint after 4 batches, with its optimizer state garbled, to resume in ``folder``."""
    folder.mkdir()
    checkpoint = torch.load(trained / 'ep0-ba4-rank0.pt', map_location='cpu', weights_only=False)
    checkpoint['state']['optimizers'] = {name: {'state': 'garbled'} for name in checkpoint['state']['optimizers']}
    torch.save(checkpoint, folder / 'ep0-ba4-rank0.pt')


FORWARD = f'{__name__}.BreaksInTraining.forward: RuntimeError: the layer broke in training'
AT_ONCE = f'training after 0 batches (epoch 0) failed in {FORWARD}'
LATER = f'training after 2 batches (epoch 0) failed in {FORWARD}'
RESIZE = (
    'training after 0 batches (epoch 0) failed in composer.algorithms.progressive_resizing.progressive_resizing.'
    'resize_batch: RuntimeError: Input and output sizes should be greater than 0, but got input (H: 32, W: 32) '
    'output (H: 0, W: 0)'
)
RESIZING = ('--set', 'algorithms.progressive_resizing.initial_scale=0.01')
RESIZING += ('--set', 'algorithms.progressive_resizing.delay_fraction=0')
UNSAVED = 'no checkpoint was written by this run'
SAVED = 'the training up to {folder}/ep0-ba2-rank0.pt is saved: continue with --resume'
BUILDING = 'building the run failed in channels_last_algo.app.'


MODEL = f'model.name={__name__}:'


@pytest.mark.parametrize(
    'setup, extra, head, kind, saved, files',
    [
        (None, ('--set', MODEL + 'BreaksInTraining'), AT_ONCE, 'RuntimeError', UNSAVED, []),
        (None, ('--set', MODEL + 'breaks_after_two'), LATER, 'RuntimeError', SAVED, ['ep0-ba2-rank0.pt']),
        (None, RESIZING, RESIZE, 'RuntimeError', UNSAVED, []),
        (
            _broken_optimizer_state,
            ('--resume',),
            BUILDING,
            'AttributeError',
            'nothing was trained',
            ['ep0-ba4-rank0.pt'],
        ),
    ],
    ids=['a model that fails at the first batch', 'a model that fails later', 'an algorithm option', 'a resume'],
)
def test_a_failure_at_run_time_says_what_where_and_the_newest_checkpoint_with_the_traceback_in_a_file(
    setup, extra, head, kind, saved, files, trained, tmp_path, capfd
):
    folder = tmp_path / 'run'
    if setup is not None:
        setup(trained, folder)
    before = snapshot(tmp_path)
    assert main(train_args(folder, *extra)) == 2
    message = error_message(capfd)
    log = Path(message.rsplit('; the full traceback is in ', 1)[-1])
    assert_refused(message, head, f'; {saved.format(folder=folder)}; the full traceback is in {log}')
    what = message.split(': ', 1)[1].split('; ')[0]  # the exception's type and the first line of its message
    assert what.startswith(f'{kind}: ') and log.parent == folder and log.name.startswith('error-')
    assert log.read_text().startswith('Traceback (most recent call last):') and what in log.read_text()
    assert sorted(p.name for p in folder.glob('ep*.pt')) == files and all(read_state(folder / f) for f in files)
    assert_kept(before, snapshot(tmp_path))


# --- checkpoints the run would have destroyed ------------------------------------------------------------


def test_a_checkpoint_copied_in_as_latest_is_an_earlier_run_not_a_link_to_replace(trained, tmp_path, capfd):
    folder = tmp_path / 'copied'
    folder.mkdir()
    shutil.copy(trained / 'ep1-ba6-rank0.pt', folder / 'latest-rank0.pt')
    before = snapshot(tmp_path)
    assert main(train_args(folder, overrides=('train.max_duration=4ba',))) == 2
    assert f'{folder} holds the checkpoints of an earlier run (latest-rank0.pt)' in error_message(capfd)
    assert_kept(before, snapshot(tmp_path))


def test_keeping_the_newest_checkpoints_never_counts_a_file_resume_skipped(run, caplog, capfd):
    torch.save(torch.zeros(3), run / 'ep3-ba12-rank0.pt')  # no training checkpoint, named newer than all
    extra = ('--resume',)
    overrides = ('train.max_duration=8ba', 'train.save_num_checkpoints_to_keep=1')
    assert main(train_args(run, *extra, overrides=overrides)) == 0
    assert sorted(p.name for p in run.glob('ep*.pt')) == ['ep1-ba8-rank0.pt', 'ep3-ba12-rank0.pt']
    assert (run / 'latest-rank0.pt').resolve().name == 'ep1-ba8-rank0.pt'


def test_a_checkpoint_named_for_another_batch_than_it_holds_is_refused_not_deleted(run, capfd):
    shutil.copy(run / 'ep0-ba2-rank0.pt', run / 'ep5-ba20-rank0.pt')
    before = snapshot(run)
    for extra in (('--resume',), ('--resume', '--overwrite')):
        assert main(train_args(run, *extra, overrides=('train.max_duration=30ba',))) == 2
        assert f'{run}/ep5-ba20-rank0.pt is named batch 20 but holds batch 2; rename it ep0-ba2-rank0.pt' in (
            error_message(capfd)
        )
        assert_kept(before, snapshot(run))


def test_a_loss_that_is_not_finite_stops_the_run_before_a_weight_turns_nan(tmp_path, capfd):
    folder = tmp_path / 'run'
    assert main(train_args(folder, overrides=('optimizer.lr=1.0e+30',))) == 2
    message = error_message(capfd)
    assert 'FloatingPointError: the training loss is not finite at batch ' in message
    assert 'lower optimizer.lr (it is 1e+30 at 2048 images)' in message
    for path in folder.glob('ep*.pt'):
        assert all(torch.isfinite(t).all() for t in read_state(path)['model'].values() if t.is_floating_point())
