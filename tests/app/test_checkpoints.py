"""Run folders and checkpoints: the lock, atomic writes, refusals, the choice of where to resume, and
recipe runs that are interrupted, run twice at once, resumed from the wrong checkpoint, or whose
checkpoint write fails."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import pytest
import torch
from recipe_runs import assert_same_run, final_state, train_args

from channels_last_algo.app.runs.checkpoint_files import RunFolderError, read_state
from channels_last_algo.app.runs.folder import RunFolder

TESTS = Path(__file__).resolve().parent


def _fake_state(batch: int) -> dict:
    """What resume_point reads of a Composer checkpoint written after ``batch`` batches."""
    return {'state': {'model': {}, 'timestamp': {'Timestamp': {'epoch': 0, 'batch': batch, 'sample': 4 * batch}}}}


def _fake_checkpoint(path: Path, batch: int) -> Path:
    torch.save(_fake_state(batch), path)
    return path


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, '-c', 'pass'])
    process.wait()
    return process.pid


# --- the run folder on its own ------------------------------------------------------------------------


def test_lock_refuses_a_second_holder_and_takes_over_a_dead_ones(tmp_path, caplog):
    first = RunFolder(tmp_path / 'run')
    first.lock()
    with pytest.raises(RunFolderError, match=rf'{tmp_path}/run is in use by another run \(pid {os.getpid()} on '):
        RunFolder(tmp_path / 'run').lock()
    first.unlock()
    assert not (tmp_path / 'run' / '.run.lock').exists()
    (tmp_path / 'run' / '.run.lock').write_text(f'{_dead_pid()} {socket.gethostname()}\n')  # a killed run's
    second = RunFolder(tmp_path / 'run')
    second.lock()
    assert 'which is gone' in caplog.text
    assert (tmp_path / 'run' / '.run.lock').read_text().split()[0] == str(os.getpid())
    second.unlock()


def test_an_interrupted_write_leaves_the_earlier_checkpoints_whole(tmp_path):
    folder = RunFolder(tmp_path)
    folder.write('ep0-ba2-rank0.pt', lambda file: file.write(b'first'))

    def save_and_stop(file):
        file.write(b'half of the seco')
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        folder.write('ep0-ba4-rank0.pt', save_and_stop)
    assert sorted(p.name for p in tmp_path.iterdir()) == ['ep0-ba2-rank0.pt', 'latest-rank0.pt']
    assert folder.latest().read_bytes() == b'first'


def test_a_write_that_fails_in_the_file_system_names_the_checkpoint_the_cause_and_the_newest_whole_one(tmp_path):
    folder = RunFolder(tmp_path)
    folder.write('ep0-ba2-rank0.pt', lambda file: file.write(b'first'))

    def fill_the_disk(file):
        file.write(b'half of the seco')
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(RunFolderError) as refused:
        folder.write('ep0-ba4-rank0.pt', fill_the_disk)
    assert str(refused.value) == (
        f'cannot write checkpoint ep0-ba4-rank0.pt in {tmp_path}: No space left on device (nothing is lost: the '
        f'newest whole checkpoint is {tmp_path}/ep0-ba2-rank0.pt); free space on its disk, then continue with --resume'
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ['ep0-ba2-rank0.pt', 'latest-rank0.pt']
    assert folder.latest().read_bytes() == b'first'


def test_a_folder_with_an_earlier_run_is_refused_unless_resumed_or_overwritten(tmp_path):
    folder = RunFolder(tmp_path)
    for batch in (2, 4):
        folder.write(f'ep0-ba{batch}-rank0.pt', lambda file, b=batch: torch.save(_fake_state(b), file))
    (tmp_path / '.ep0-ba6-rank0.pt.123.partial').write_bytes(b'left by a kill')
    (tmp_path / 'notes.txt').write_text('not a checkpoint')
    with pytest.raises(
        RunFolderError, match='holds the checkpoints of an earlier run .*--resume.*new folder.*--overwrite'
    ):
        with folder.open():
            pass
    with pytest.raises(RunFolderError, match=r'ep0-ba2-rank0.pt is older than ep0-ba4-rank0.pt in the same folder'):
        with folder.open(resume=tmp_path / 'ep0-ba2-rank0.pt', max_duration='8ba'):
            pass
    with folder.open(resume=True, max_duration='8ba') as start:
        assert start == tmp_path / 'ep0-ba4-rank0.pt'
    assert not (tmp_path / '.ep0-ba6-rank0.pt.123.partial').exists()
    with folder.open(overwrite=True) as start:
        assert start is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ['notes.txt']


def test_resume_takes_the_newest_readable_checkpoint_and_names_every_unusable_one(tmp_path, caplog):
    folder = RunFolder(tmp_path)
    _fake_checkpoint(tmp_path / 'ep0-ba2-rank0.pt', 2)
    newest = _fake_checkpoint(tmp_path / 'ep0-ba4-rank0.pt', 4)
    newest.write_bytes(newest.read_bytes()[:-100])  # truncated
    assert folder.resume_point(True, '8ba') == tmp_path / 'ep0-ba2-rank0.pt'
    assert f'--resume: skipping an unusable checkpoint: {newest} is truncated or corrupt' in caplog.text
    with pytest.raises(RunFolderError, match=rf'^{newest} is truncated or corrupt: .*--resume PATH'):
        folder.resume_point(newest, '8ba')
    with pytest.raises(
        RunFolderError,
        match=r'ep0-ba2-rank0.pt is the end of a finished run \(2ba of '
        r'train.max_duration 2ba\); to train on, raise it',
    ):
        folder.resume_point(True, '2ba')
    (tmp_path / 'latest-rank0.pt').symlink_to('ep0-ba9-rank0.pt')
    with pytest.raises(RunFolderError, match=r'latest-rank0.pt is a link to ep0-ba9-rank0.pt, which does not exist'):
        folder.resume_point(tmp_path / 'latest-rank0.pt', '8ba')
    empty = RunFolder(tmp_path / 'empty')
    with pytest.raises(RunFolderError, match='holds no checkpoint to resume from'):
        empty.resume_point(True, '8ba')
    (tmp_path / 'other.pt').write_bytes(b'PK not a zip')
    with pytest.raises(RunFolderError, match='other.pt is truncated or corrupt'):
        folder.resume_point(tmp_path / 'other.pt', '8ba')
    torch.save({'weights': torch.zeros(1)}, tmp_path / 'weights.pt')
    with pytest.raises(RunFolderError, match='weights.pt is not a Composer training checkpoint'):
        folder.resume_point(tmp_path / 'weights.pt', '8ba')


# --- recipe runs (Composer) ---------------------------------------------------------------------------


@pytest.fixture(scope='module')
def composer_main():
    pytest.importorskip('composer')
    from channels_last_algo.app.cli.entry import main

    return main


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
    return tmp_path_factory.mktemp('runs')


# A child process that trains the tiny recipe once per moment, each in its own folder, stopping
# the second checkpoint write (after 4 batches) at that moment: SIGINT in the middle of writing
# the file, just before its rename, or just before the `latest` link moves; the last moment
# SIGKILLs the process in the middle of writing, so nothing of it can clean up.
_INTERRUPTED = textwrap.dedent("""
    import io, os, signal, sys
    from pathlib import Path
    import torch
    sys.path.insert(0, {tests!r})
    from channels_last_algo.app.cli.entry import main
    from recipe_runs import train_args

    real_save, real_replace = torch.save, os.replace

    def arm(moment):
        calls = {{'save': 0, 'replace': 0}}
        signum = signal.SIGKILL if moment == 'killed mid-write' else signal.SIGINT

        def save(obj, file, *args, **kwargs):
            calls['save'] += 1
            if calls['save'] == 2 and moment.endswith('mid-write'):
                buffer = io.BytesIO()
                real_save(obj, buffer)
                file.write(buffer.getvalue()[:buffer.tell() // 2])
                file.flush()
                os.kill(os.getpid(), signum)
            return real_save(obj, file, *args, **kwargs)

        def replace(source, target):
            calls['replace'] += 1  # each checkpoint renames its file, then its `latest` link
            if (moment, calls['replace']) in (('before rename', 3), ('before link', 4)):
                os.kill(os.getpid(), signum)
            return real_replace(source, target)

        torch.save, os.replace = save, replace

    for moment in sys.argv[2:]:
        arm(moment)
        try:
            code = main(train_args(Path(sys.argv[1]) / moment))
        except SystemExit as stop:  # Composer turns SIGINT into SystemExit(130)
            code = stop.code
        print(f'{{moment}}: exit {{code}}', flush=True)
""").format(tests=str(TESTS))
_MOMENTS = ['mid-write', 'before rename', 'before link', 'killed mid-write']


@pytest.fixture(scope='module')
def interrupted(runs, composer_main):
    """The child's runs, started at once so that they overlap the in-process runs."""
    child = subprocess.Popen(
        [sys.executable, '-c', _INTERRUPTED, str(runs / 'interrupted'), *_MOMENTS],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    yield child
    if child.poll() is None:
        child.kill()


@pytest.fixture(scope='module')
def uninterrupted(runs, composer_main, interrupted):
    assert composer_main(train_args(runs / 'full')) == 0
    return runs / 'full'


def test_interrupted_checkpoint_writes_resume_to_the_uninterrupted_run(runs, composer_main, interrupted, uninterrupted):
    out, err = interrupted.communicate(timeout=300)
    assert interrupted.returncode == -signal.SIGKILL, err[-3000:]
    assert out.splitlines() == ['mid-write: exit 130', 'before rename: exit 130', 'before link: exit 130'], err[-3000:]
    assert 'channels-last train: stopped; the training up to ' in err
    want = final_state(uninterrupted)
    for moment in _MOMENTS:
        folder = runs / 'interrupted' / moment
        names = sorted(p.name for p in folder.iterdir())
        expected = {
            'before link': ['ep0-ba2-rank0.pt', 'ep0-ba4-rank0.pt', 'latest-rank0.pt'],
            'killed mid-write': ['.ep0-ba4-rank0.pt.{}.partial', '.run.lock', 'ep0-ba2-rank0.pt', 'latest-rank0.pt'],
        }.get(moment, ['ep0-ba2-rank0.pt', 'latest-rank0.pt'])
        assert names == [name.format(interrupted.pid) for name in expected], moment
        assert (folder / 'latest-rank0.pt').resolve().name == 'ep0-ba2-rank0.pt', moment
        assert composer_main(train_args(folder, '--resume')) == 0, moment
        assert_same_run(final_state(folder), want)
        assert not [p for p in folder.iterdir() if p.name.startswith('.')], moment


def test_a_checkpoint_copied_into_a_new_folder_resumes_there(tmp_path, capfd, composer_main, uninterrupted):
    folder = tmp_path / 'run'
    assert composer_main(train_args(folder, '--resume')) == 2
    assert (
        capfd.readouterr()
        .err.strip()
        .splitlines()[-1]
        .endswith(
            f'--resume: {folder} holds no checkpoint to resume from; train once without --resume first, or set '
            'train.save_folder to the run to resume'
        )
    )
    assert not folder.exists()  # refused before anything was written
    folder.mkdir()
    shutil.copy(uninterrupted / 'ep0-ba2-rank0.pt', folder / 'latest-rank0.pt')  # all that survived of a run
    assert composer_main(train_args(folder, '--resume')) == 0
    assert_same_run(final_state(folder), final_state(uninterrupted))


# A child that trains the tiny recipe and, half-way through writing its second checkpoint,
# waits for the file `go` next to its folder.
_PAUSED = textwrap.dedent("""
    import io, sys, time
    from pathlib import Path
    import torch
    sys.path.insert(0, {tests!r})
    from channels_last_algo.app.cli.entry import main
    from recipe_runs import train_args

    folder = Path(sys.argv[1])
    real_save, calls = torch.save, []

    def save(obj, file, *args, **kwargs):
        calls.append(1)
        if len(calls) != 2:
            return real_save(obj, file, *args, **kwargs)
        buffer = io.BytesIO()
        real_save(obj, buffer)
        data = buffer.getvalue()
        file.write(data[:len(data) // 2])
        file.flush()
        (folder.parent / 'paused').touch()
        while not (folder.parent / 'go').exists():
            time.sleep(0.05)
        file.write(data[len(data) // 2:])

    torch.save = save
    sys.exit(main(train_args(folder)))
""").format(tests=str(TESTS))


def test_a_second_run_on_a_folder_in_use_is_refused_and_the_first_finishes_intact(
    tmp_path, capfd, composer_main, uninterrupted
):
    folder = tmp_path / 'run'
    first = subprocess.Popen([sys.executable, '-c', _PAUSED, str(folder)], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not (tmp_path / 'paused').exists():
            assert first.poll() is None and time.monotonic() < deadline, first.stderr.read()[-3000:]
            time.sleep(0.1)
        for extra in ([], ['--resume'], ['--overwrite']):
            assert composer_main(train_args(folder, *extra)) == 2
            err = capfd.readouterr().err.strip().splitlines()[-1]
            assert err.endswith(
                f'error: {folder} is in use by another run (pid {first.pid} on '
                f'{socket.gethostname()}); wait for it to finish, or give this run another folder '
                '(--set train.save_folder=PATH)'
            )
        (tmp_path / 'go').touch()
        assert first.wait(timeout=240) == 0, first.stderr.read()[-3000:]
    finally:
        first.kill()
    assert_same_run(final_state(folder), final_state(uninterrupted))


def test_resume_refuses_a_finished_run_another_model_and_broken_files_in_one_line(
    tmp_path, capfd, composer_main, uninterrupted
):
    folder = tmp_path / 'run'
    shutil.copytree(uninterrupted, folder, symlinks=True)
    newest = folder / 'ep1-ba6-rank0.pt'

    def refused(*extra, overrides=()):
        assert composer_main(train_args(folder, *extra, overrides=overrides)) == 2
        return capfd.readouterr().err.strip().splitlines()[-1]

    assert refused('--resume').endswith(
        f'{newest} is the end of a finished run (6ba of train.max_duration 6ba); to '
        'train on, raise it (--set train.max_duration=...) and resume, or start afresh '
        'in a new folder (--set train.save_folder=PATH)'
    )
    longer = ('train.max_duration=8ba',)
    assert refused('--resume', overrides=(*longer, 'model.num_classes=5')).endswith(
        f"error: {newest} holds another model than this recipe builds ('module.head.weight' is [10, 32] there and "
        f'[5, 32] here); {folder} holds the run of another recipe: give this run a new folder (--set '
        'train.save_folder=PATH), or replace that run with --overwrite (without --resume)'
    )
    assert f'{newest} holds another model' in refused('--resume', overrides=(*longer, 'algorithms.blurpool=false'))
    assert refused().endswith(
        f'{folder} holds the checkpoints of an earlier run (ep0-ba2-rank0.pt, ep0-ba4-rank0.pt, '
        'ep1-ba6-rank0.pt); continue it with --resume, give this run a new folder (--set '
        'train.save_folder=PATH), or replace them with --overwrite'
    )
    newest.write_bytes(newest.read_bytes()[:1000])
    assert f'{newest} is truncated or corrupt' in refused('--resume', str(newest), overrides=longer)
    (folder / 'latest-rank0.pt').unlink()
    (folder / 'latest-rank0.pt').symlink_to('ep9-ba99-rank0.pt')
    assert 'latest-rank0.pt is a link to ep9-ba99-rank0.pt, which does not exist' in refused(
        '--resume', str(folder / 'latest-rank0.pt'), overrides=longer
    )
    # --resume alone skips the truncated newest checkpoint and trains on from the one before it
    assert composer_main(train_args(folder, '--resume', overrides=longer)) == 0
    assert final_state(folder, batch=6)['timestamp']['Timestamp']['batch'] == 6  # whole again
    assert (folder / 'latest-rank0.pt').resolve() == next(folder.glob('ep*-ba8-rank0.pt'))


# A checkpoint write that fails in the file system: the `save`-th torch.save of the run writes into a file
# that takes 4 KiB, then fails as a full disk (or a file size limit) does.


def _filling(file, room: int, code: int) -> types.SimpleNamespace:
    """``file``, whose writes fail with ``code`` (ENOSPC: the disk is full) once ``room`` bytes are written."""
    written = []

    def write(data) -> int:
        if sum(written) + len(data) > room:
            raise OSError(code, os.strerror(code))
        written.append(len(data))
        return file.write(data)

    return types.SimpleNamespace(write=write, flush=file.flush)


@pytest.mark.parametrize(
    'save, code, written, fix',
    [
        (2, errno.ENOSPC, 'ep0-ba4-rank0.pt', 'free space on its disk, then continue with --resume'),
        (1, errno.ENOSPC, 'ep0-ba2-rank0.pt', 'free space on its disk, then run again'),
        (3, errno.EFBIG, 'ep1-ba6-rank0.pt', 'raise the file size limit (ulimit -f), then continue with --resume'),
    ],
    ids=['full disk at the second checkpoint', 'full disk at the first checkpoint', 'file size limit'],
)
def test_a_checkpoint_write_that_fails_names_it_the_cause_and_the_newest_whole_one(
    save, code, written, fix, tmp_path, capfd, monkeypatch, composer_main
):
    real, calls = torch.save, []

    def filling_save(obj, file, *args, **kwargs):
        calls.append(file)
        return real(obj, _filling(file, 4096, code) if len(calls) == save else file, *args, **kwargs)

    monkeypatch.setattr(torch, 'save', filling_save)
    folder = tmp_path / 'run'
    assert composer_main(train_args(folder)) == 2
    whole = sorted(folder.glob('ep*.pt'))
    kept = f'the newest whole checkpoint is {whole[-1]}' if whole else 'no whole checkpoint is in it yet'
    err = capfd.readouterr().err
    assert 'Traceback' not in err and err.strip().splitlines()[-1].endswith(
        f'error: cannot write checkpoint {written} in {folder}: {os.strerror(code)} (nothing is lost: {kept}); {fix}'
    )
    assert len(whole) == save - 1 and not [p for p in folder.iterdir() if p.name.endswith('.partial')]
    assert [read_state(path)['timestamp']['Timestamp']['batch'] for path in whole] == [2, 4][: save - 1]
    monkeypatch.setattr(torch, 'save', real)  # the space is freed: the advice finishes the run
    assert composer_main(train_args(folder, *(['--resume'] if '--resume' in fix else []))) == 0
    assert read_state(folder / 'latest-rank0.pt')['timestamp']['Timestamp']['batch'] == 6
