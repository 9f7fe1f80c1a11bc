"""The lock of a run folder, held by one run for its whole length: a lock file with the pid and host,
locked with ``flock``, so a lock left by a dead process is known to be stale and taken over.

:meth:`RunLock.check` makes every refusal of :meth:`RunLock.take` (a folder that cannot hold a run, a
live run holding it) without writing anything or keeping the lock.

Example:
    >>> import tempfile
    >>> lock = RunLock(Path(tempfile.mkdtemp()) / 'run')
    >>> lock.take()
    >>> RunLock(lock.folder).check()  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    channels_last_algo.app.runs.checkpoint_files.RunFolderError: .../run is in use by another run (pid ...
    >>> lock.release()
    >>> RunLock(lock.folder).check()
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import socket
from pathlib import Path
from typing import Optional

from channels_last_algo.app.runs.checkpoint_files import RunFolderError, not_a_file

__all__ = ['LOCK_NAME', 'NEW_FOLDER', 'RunLock']

log = logging.getLogger(__name__)

LOCK_NAME = '.run.lock'
NEW_FOLDER = 'give this run another folder (--set train.save_folder=PATH)'


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by another user
        return True
    return True


def _check_usable(folder: Path) -> None:
    """RunFolderError naming the path and the fix when ``folder`` is a file, lies under one, cannot be
    written, or has something else than a file for its lock; seen without writing anything."""
    if folder.is_symlink() and not folder.exists():
        raise RunFolderError(f'{folder} is {not_a_file(folder)}', f'create that folder, or {NEW_FOLDER}')
    existing = next(path for path in (folder, *folder.parents) if path.exists() or path.is_symlink())
    made = '' if existing == folder else f'{folder} cannot be made: '
    if not existing.is_dir():
        raise RunFolderError(f'{made}{existing} is a file, not a folder', f'move the file away, or {NEW_FOLDER}')
    if not os.access(existing, os.W_OK | os.X_OK | (os.R_OK if existing == folder else 0)):
        fix = f'make it writable (chmod u+rwx), or {NEW_FOLDER}'
        raise RunFolderError(f'{made}{existing} is not writable for this user', fix)
    kind = not_a_file(folder / LOCK_NAME)
    if kind is not None:
        fix = f'delete it (a run makes its own), or {NEW_FOLDER}'
        raise RunFolderError(f'{folder / LOCK_NAME} must be the lock file of a run, but is {kind}', fix)


class RunLock:
    """The lock of the run folder ``folder``. See the module docstring."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._descriptor: Optional[int] = None

    @property
    def path(self) -> Path:
        return self.folder / LOCK_NAME

    def check(self) -> None:
        """RunFolderError naming the path and the fix when the folder cannot hold a run, or naming the pid
        of another live run that holds it; found without writing anything or keeping the lock."""
        _check_usable(self.folder)
        try:
            with contextlib.suppress(FileNotFoundError):  # no lock file: no run holds the folder
                descriptor = self._take_lock(os.O_RDONLY)
                try:
                    self._gone_holder(descriptor)
                finally:
                    os.close(descriptor)  # and with it the flock
        except OSError as error:
            raise self._lock_error(error) from error

    def take(self) -> None:
        """Hold the folder for this process until :meth:`release` (or the process ends): the refusals of
        :meth:`check`, and the lock of a process that is gone taken over, with a log line."""
        if self._descriptor is not None:
            raise RuntimeError(f'{self.folder} is already locked by this RunFolder')
        _check_usable(self.folder)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            descriptor = self._take_lock(os.O_RDWR | os.O_CREAT)
            try:
                gone = self._gone_holder(descriptor)
                if gone is not None:
                    log.warning(
                        '%s: taking over the lock of pid %s, which is gone (a run that was stopped)', self.folder, gone
                    )
                os.ftruncate(descriptor, 0)
                os.pwrite(descriptor, f'{os.getpid()} {socket.gethostname()}\n'.encode(), 0)
                os.fsync(descriptor)
            except BaseException:
                os.close(descriptor)
                raise
        except OSError as error:
            raise self._lock_error(error) from error
        self._descriptor = descriptor

    def _lock_error(self, error: OSError) -> RunFolderError:
        return RunFolderError(
            f'cannot lock {error.filename or self.path} for this run: {error.strerror or error}; make sure '
            f'this user can create and write {self.folder}, or {NEW_FOLDER}'
        )

    def _in_use(self, then: str = '') -> RunFolderError:
        return RunFolderError(
            f'{self.folder} is in use by another run ({self._holder()}); wait for it to finish, or {NEW_FOLDER}{then}'
        )

    def _take_lock(self, flags: int) -> int:
        """A descriptor of the lock file opened with ``flags``, ``flock``-ed; RunFolderError if another
        process holds it."""
        while True:
            descriptor = os.open(self.path, flags | os.O_NOFOLLOW, 0o644)
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as error:
                os.close(descriptor)
                if error.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                raise self._in_use() from None
            with contextlib.suppress(FileNotFoundError):
                if os.stat(self.path).st_ino == os.fstat(descriptor).st_ino:
                    return descriptor  # locked the file that is there, not one its last holder just removed
            os.close(descriptor)

    def _gone_holder(self, descriptor: int) -> Optional[str]:
        """The pid in the locked lock file when it is another process that is gone; RunFolderError when
        it is a live one of this host (a file system whose locks do not reach across processes)."""
        owner = os.pread(descriptor, 200, 0).decode(errors='replace').split()
        if not owner or not owner[0].isdigit() or int(owner[0]) == os.getpid():
            return None
        if owner[1:2] == [socket.gethostname()] and _pid_alive(int(owner[0])):
            raise self._in_use(f'. If no run uses it, delete {self.path}')
        return owner[0]

    def _holder(self) -> str:
        try:
            pid, host = (self.path.read_text().split() + ['?', '?'])[:2]
        except OSError:
            return 'lock file unreadable'
        return f'pid {pid} on {host}'

    def release(self) -> None:
        """Release the lock and remove the lock file; nothing if not held."""
        if self._descriptor is None:
            return
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        os.close(self._descriptor)  # closing releases the flock
        self._descriptor = None
