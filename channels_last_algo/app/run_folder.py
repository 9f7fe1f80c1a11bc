"""A run folder that holds one run: its lock, atomic checkpoint files, and the choice of where to resume.

:class:`RunFolder` is the folder a training run writes its checkpoints to. Opening it for a
run (:meth:`RunFolder.open`) takes a lock held for the whole run (a lock file with the pid,
locked with ``flock``, so a lock left by a dead process is known to be stale) and refuses a
folder that holds another run's checkpoints unless the run resumes them or is told to
overwrite them. Checkpoints are written atomically (:meth:`RunFolder.write`: a temporary
file in the same folder, ``fsync``, ``os.replace``), so an interruption at any moment leaves
every earlier checkpoint whole. :meth:`RunFolder.resume_point` picks the newest readable
checkpoint, or checks a chosen one, and names the file and the fix when it cannot be used.
Nothing here needs Composer: checkpoints are read with ``torch.load``.

Example:
    >>> import tempfile
    >>> folder = RunFolder(Path(tempfile.mkdtemp()) / 'run')
    >>> with folder.open():
    ...     path = folder.write('ep0-ba2-rank0.pt', lambda file: file.write(b'weights'))
    >>> [c.path.name for c in folder.checkpoints()], folder.latest().resolve() == path
    (['ep0-ba2-rank0.pt'], True)
    >>> with folder.open():   # doctest: +ELLIPSIS
    ...     pass
    Traceback (most recent call last):
    ...
    channels_last_algo.app.run_folder.RunFolderError: .../run holds the checkpoints of an earlier run ...
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import logging
import os
import re
import socket
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO, Optional, Union

__all__ = ['Checkpoint', 'RunFolder', 'RunFolderError']

log = logging.getLogger(__name__)

_CHECKPOINT = re.compile(r'^ep(\d+)-ba(\d+)-rank0\.pt$')
_PARTIAL = '.partial'
LOCK_NAME = '.run.lock'
LATEST_NAME = 'latest-rank0.pt'
CHECKPOINT_NAME = 'ep{epoch}-ba{batch}-rank0.pt'


class RunFolderError(ValueError):
    """A run folder or checkpoint that cannot be used as asked; the message names the file and the fix."""


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A checkpoint file of the run folder and the training time it was written at."""

    path: Path
    epoch: int
    batch: int


def _fsync_folder(folder: Path) -> None:
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by another user
        return True
    return True


def check_readable(path: Path) -> None:
    """RunFolderError naming ``path`` unless it is a whole checkpoint: a zip archive (``torch.save``'s
    format) whose every member matches its CRC. Reads the file once; unpickles nothing."""
    if path.is_symlink() and not path.exists():
        raise RunFolderError(
            f'{path} is a link to {os.readlink(path)}, which does not exist; resume from an '
            'existing checkpoint with --resume (the newest readable one) or --resume PATH'
        )
    if not path.is_file():
        state = 'is a folder' if path.is_dir() else 'does not exist'
        raise RunFolderError(f'{path} {state}; give --resume a checkpoint file, or --resume alone for the newest one')
    try:
        with zipfile.ZipFile(path) as archive:
            damaged = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as error:
        damaged = f'not a whole checkpoint ({error})'
    else:
        damaged = None if damaged is None else f'member {damaged} fails its checksum'
    if damaged is not None:
        raise RunFolderError(
            f'{path} is truncated or corrupt: {damaged}; resume from an earlier checkpoint with '
            '--resume PATH, or delete the file and use --resume for the newest readable one'
        )


def read_state(path: Path) -> dict[str, Any]:
    """The ``state`` of the Composer checkpoint at ``path``, memory-mapped (tensors are read
    when touched). It unpickles the file: read only checkpoints you trust, such as your own runs'."""
    import torch

    try:
        checkpoint = torch.load(path, map_location='cpu', mmap=True, weights_only=False)
    except Exception as error:  # a file torch cannot unpickle: say which, whatever the cause
        raise RunFolderError(
            f'{path} cannot be read as a checkpoint ({str(error).splitlines()[0]}); resume from '
            'another checkpoint with --resume PATH'
        ) from error
    state = checkpoint.get('state') if isinstance(checkpoint, dict) else None
    if not isinstance(state, dict) or 'timestamp' not in state or 'model' not in state:
        raise RunFolderError(
            f'{path} is not a Composer training checkpoint (no state.model and state.timestamp); '
            'resume from a checkpoint that channels-last train wrote'
        )
    return state


def progress(state: dict[str, Any]) -> dict[str, int]:
    """The checkpoint's training time: epochs (``ep``), batches (``ba``) and samples (``sp``) done."""
    timestamp = state['timestamp']['Timestamp']
    return {'ep': int(timestamp['epoch']), 'ba': int(timestamp['batch']), 'sp': int(timestamp['sample'])}


class RunFolder:
    """The checkpoint folder of one run. See the module docstring."""

    def __init__(self, folder: Union[str, os.PathLike]) -> None:
        self.folder = Path(folder)
        self._lock: Optional[int] = None
        self._unreadable: set[Path] = set()  # checkpoints --resume skipped: this run may replace them

    def __repr__(self) -> str:
        return f'{type(self).__name__}({str(self.folder)!r})'

    # --- the lock ---------------------------------------------------------------------------------

    @property
    def lock_path(self) -> Path:
        return self.folder / LOCK_NAME

    def lock(self) -> None:
        """Hold the folder for this process until :meth:`unlock` (or the process ends).

        RunFolderError naming the folder and the pid if another live run holds it. A lock file
        whose process is gone (a run that was killed) is taken over, with a log line.
        """
        if self._lock is not None:
            raise RuntimeError(f'{self.folder} is already locked by this RunFolder')
        self.folder.mkdir(parents=True, exist_ok=True)
        while True:
            descriptor = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as error:
                os.close(descriptor)
                if error.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                raise RunFolderError(
                    f'{self.folder} is in use by another run ({self._holder()}); wait for it to '
                    'finish, or give this run another folder (--set train.save_folder=PATH)'
                ) from None
            with contextlib.suppress(FileNotFoundError):
                if os.stat(self.lock_path).st_ino == os.fstat(descriptor).st_ino:
                    break  # locked the file that is there, not one its last holder just removed
            os.close(descriptor)
        owner = os.read(descriptor, 200).decode(errors='replace').split()
        if owner and owner[0].isdigit() and int(owner[0]) != os.getpid():
            if owner[1:2] == [socket.gethostname()] and _pid_alive(int(owner[0])):
                os.close(descriptor)  # the file system does not lock across processes: trust the pid
                raise RunFolderError(
                    f'{self.folder} is in use by another run ({self._holder()}); wait for it to '
                    f'finish, or give this run another folder (--set train.save_folder=PATH). If no '
                    f'run uses it, delete {self.lock_path}'
                )
            log.warning(
                '%s: taking over the lock of pid %s, which is gone (a run that was stopped)', self.folder, owner[0]
            )
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, f'{os.getpid()} {socket.gethostname()}\n'.encode(), 0)
        os.fsync(descriptor)
        self._lock = descriptor

    def _holder(self) -> str:
        try:
            pid, host = (self.lock_path.read_text().split() + ['?', '?'])[:2]
        except OSError:
            return 'lock file unreadable'
        return f'pid {pid} on {host}'

    def unlock(self) -> None:
        """Release the lock and remove the lock file; nothing if not locked."""
        if self._lock is None:
            return
        with contextlib.suppress(FileNotFoundError):
            self.lock_path.unlink()
        os.close(self._lock)  # closing releases the flock
        self._lock = None

    @contextlib.contextmanager
    def open(
        self, resume: Union[bool, str, os.PathLike] = False, overwrite: bool = False, max_duration: Optional[str] = None
    ) -> Iterator[Optional[Path]]:
        """Lock the folder for a run, make it ready and yield the checkpoint to resume from
        (:meth:`prepare`); unlock at the end."""
        self.lock()
        try:
            yield self.prepare(resume, overwrite, max_duration)
        finally:
            self.unlock()

    def prepare(
        self, resume: Union[bool, str, os.PathLike] = False, overwrite: bool = False, max_duration: Optional[str] = None
    ) -> Optional[Path]:
        """With the lock held: remove what interrupted writes left, pick the checkpoint to resume
        from (:meth:`resume_point`), and refuse checkpoints this run would overwrite (another
        run's, or later ones than the resumed one) unless ``overwrite``, which deletes them."""
        for partial in self.folder.glob(f'.*{_PARTIAL}'):
            log.warning('%s: removing %s, left by a checkpoint write that was interrupted', self.folder, partial.name)
            partial.unlink()
        start, batches = self._resume_point(resume, max_duration)
        ours = start is not None and start.resolve().parent == self.folder.resolve()
        clashing = [c for c in self.checkpoints() if (not ours or c.batch > batches) and c.path not in self._unreadable]
        if clashing and overwrite:
            log.warning('%s: --overwrite: deleting %s', self.folder, ', '.join(c.path.name for c in clashing))
            for checkpoint in clashing:
                checkpoint.path.unlink()
            if not self.latest().exists():
                with contextlib.suppress(FileNotFoundError):
                    self.latest().unlink()
        elif clashing:
            shown = ', '.join(c.path.name for c in clashing[-3:]) + (', ...' if len(clashing) > 3 else '')
            if start is None:
                raise RunFolderError(
                    f'{self.folder} holds the checkpoints of an earlier run ({shown}); continue it '
                    'with --resume, give this run a new folder (--set train.save_folder=PATH), or '
                    'replace them with --overwrite'
                )
            if ours:
                raise RunFolderError(
                    f'{start} is older than {shown} in the same folder, which this run would '
                    'overwrite; resume the newest with --resume, or replace them with --overwrite'
                )
            raise RunFolderError(
                f'{self.folder} holds the checkpoints of another run ({shown}); resume {start} into '
                'a new folder (--set train.save_folder=PATH), or replace them with --overwrite'
            )
        return start

    # --- checkpoint files ------------------------------------------------------------------------

    def checkpoints(self) -> list[Checkpoint]:
        """The checkpoint files (``ep{E}-ba{B}-rank0.pt``), oldest first."""
        found = []
        if self.folder.is_dir():
            for path in self.folder.iterdir():
                match = _CHECKPOINT.match(path.name)
                if match and not path.is_symlink():
                    found.append(Checkpoint(path, int(match.group(1)), int(match.group(2))))
        return sorted(found, key=lambda c: (c.batch, c.epoch))

    def latest(self) -> Path:
        """The ``latest-rank0.pt`` link to the newest checkpoint (it may be missing or dangling)."""
        return self.folder / LATEST_NAME

    def write(self, name: str, save: Callable[[BinaryIO], Any]) -> Path:
        """Write a checkpoint atomically: ``save(file)`` into a temporary file of this folder, fsync,
        rename to ``name``, then point ``latest-rank0.pt`` at it. An interruption at any moment
        leaves either the old file set or the new one, never a partial ``name``."""
        target = self.folder / name
        partial = self.folder / f'.{name}.{os.getpid()}{_PARTIAL}'
        link = self.folder / f'.{LATEST_NAME}.{os.getpid()}{_PARTIAL}'
        try:
            with open(partial, 'wb') as file:
                save(file)
                file.flush()
                os.fsync(file.fileno())
            os.replace(partial, target)
            os.symlink(target.name, link)
            os.replace(link, self.latest())
        finally:  # after an interruption: nothing half-made stays behind
            for leftover in (partial, link):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(leftover)
        _fsync_folder(self.folder)
        return target

    def keep_newest(self, count: int) -> None:
        """Delete all but the ``count`` newest checkpoints (-1: keep all)."""
        if count > 0:
            for checkpoint in self.checkpoints()[:-count]:
                checkpoint.path.unlink()

    # --- resuming ---------------------------------------------------------------------------------

    def resume_point(self, resume: Union[bool, str, os.PathLike], max_duration: Optional[str] = None) -> Optional[Path]:
        """The checkpoint to resume from: None when ``resume`` is False; with True the newest
        readable checkpoint here (unreadable newer ones are named in a warning and skipped); with
        a path that checkpoint. RunFolderError naming the file and the fix when there is none,
        when the file is truncated or unreadable, or when its run already reached ``max_duration``."""
        return self._resume_point(resume, max_duration)[0]

    def _resume_point(
        self, resume: Union[bool, str, os.PathLike], max_duration: Optional[str]
    ) -> tuple[Optional[Path], int]:
        """:meth:`resume_point` and the batches trained up to it."""
        from channels_last_algo.app.recipe_schema import parse_time

        if resume is False:
            return None, 0
        if resume is True:
            path = self._newest_readable()
        else:
            path = Path(resume)
            check_readable(path)
        done = progress(read_state(path))
        if max_duration is not None:
            length, unit = parse_time(max_duration)
            if unit in done and done[unit] >= length:
                raise RunFolderError(
                    f'{path} is the end of a finished run ({done[unit]}{unit} of train.max_duration '
                    f'{max_duration}); to train on, raise it (--set train.max_duration=...) and '
                    'resume, or start afresh in a new folder (--set train.save_folder=PATH)'
                )
        return path, done['ba']

    def _newest_readable(self) -> Path:
        candidates = self.checkpoints()
        if not candidates:
            link = self.latest()
            if link.is_symlink() or link.exists():
                check_readable(link)  # names a dangling link or a broken file
                return link  # a checkpoint copied in under the name `latest`
            raise RunFolderError(
                f'--resume: {self.folder} holds no checkpoint to resume from; train once without '
                '--resume first, or set train.save_folder to the run to resume'
            )
        problems = []
        for checkpoint in reversed(candidates):
            try:
                check_readable(checkpoint.path)
            except RunFolderError as error:
                log.warning('skipping %s', error)
                problems.append(str(error))
                self._unreadable.add(checkpoint.path)
                continue
            return checkpoint.path
        raise RunFolderError(f'--resume: no readable checkpoint in {self.folder}: {problems[0]}')
