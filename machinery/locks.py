"""
Locks: the one helper that takes a lock of an open file (lock), a path held by this process while inside (holding:
files.py's directory writer holds its temporary directory so), and a path held by its readers against the process that
deletes or moves it (ReadLock, without_readers): --eval-only, --sample and --export-hf read checkpoints while the
training that writes them goes on. The kernel drops a process's locks when it ends, even by SIGKILL. It imports
nothing of the product: files.py's lock files take their locks here too.
"""

import contextlib
import errno
import os

try:
    import fcntl
except ImportError:  # Windows: nothing is locked there
    fcntl = None

NO_LOCKS = (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP)  # a file system that has no such locks (some network ones)


def lock(f, exclusive=True, wait=True, record=False):
    """Locks the open file f (a descriptor or a file object): True once taken; False at once where another process
    holds it and not wait; None where this system or its file system has no such locks, and the caller goes on
    unguarded. record: a POSIX record lock (lockf), which the processes this one forks do not hold and which closing
    any descriptor of the file drops; else flock, the open file's, which survives the file opened again (torch.load)."""
    if fcntl is None:
        return None
    operation = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | (0 if wait else fcntl.LOCK_NB)
    try:
        (fcntl.lockf if record else fcntl.flock)(f, operation)
    except OSError as e:
        if e.errno in NO_LOCKS:
            return None
        if not wait and e.errno in (errno.EAGAIN, errno.EACCES):  # lockf says EACCES where another process holds it
            return False
        raise
    return True


@contextlib.contextmanager
def holding(path, wait=True):
    """An exclusive flock of path (a directory too) while inside: yields True if taken; False where another process
    holds it and not wait, or where none can be taken (Windows, which opens no directory; a file system that cannot
    lock a directory opened to read, NFS), and the caller goes on unguarded."""
    if fcntl is None:
        yield False
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        try:
            taken = bool(lock(fd, wait=wait))
        except OSError:  # NFS's exclusive locks need a descriptor opened to write, which a directory has not
            taken = False
        yield taken
    finally:
        os.close(fd)


class Gone(ValueError):
    """No file at the path (any more): the process that writes such files deleted or replaced it while a reader was
    choosing it."""


class ReadLock:
    """A shared flock on path (a file, or a directory), held until release: the process that writes such files deletes
    or moves none that a reader holds (without_readers). flock, not lockf: POSIX record locks are dropped when any
    descriptor of the file closes, and torch.load opens it again. Raises Gone where path is no more."""

    def __init__(self, path):
        self.fd = None
        if fcntl is None:  # Windows: no flock, and no descriptors of directories
            return
        try:
            self.fd = os.open(path, os.O_RDONLY)  # a directory too
        except FileNotFoundError as e:
            if os.path.lexists(path):  # a broken symbolic link: unreadable, not gone
                raise
            raise Gone(f"{type(e).__name__}: {e}") from None
        try:
            lock(self.fd, exclusive=False)  # waits only while the writer deletes or moves it
            locked, named = os.fstat(self.fd), os.stat(path)
            if (locked.st_dev, locked.st_ino) != (named.st_dev, named.st_ino):
                raise FileNotFoundError
        except FileNotFoundError:
            self.release()
            raise Gone(f"{path} was deleted or replaced as it was opened") from None
        except BaseException:
            self.release()
            raise

    def release(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    __del__ = release


@contextlib.contextmanager
def without_readers(path, wait):
    """An exclusive flock on path while inside, so that it can be deleted or moved: no reader is loading it
    (ReadLock). Yields True; or at once False if a reader holds it and not wait. Where no lock can be taken, it yields
    True unguarded: a reader whose file goes says so, and the training that deletes it goes on."""
    if fcntl is None:
        yield True
        return
    fd, taken = exclusive_try(path)
    try:
        if taken is False:
            if not wait:
                yield False
                return
            print(f"waiting for a process that is loading {path} (--eval-only, --sample, --export-hf) to finish")
            lock(fd)
        yield True
    finally:
        if fd is not None:
            os.close(fd)


def exclusive_try(path):
    """(a descriptor of path, what lock(descriptor, wait=False) returned), or (None, None) where no exclusive lock
    can be taken. Linux's NFS client runs flock as a lock of the whole file that, exclusive, needs the file opened to
    write (EBADF otherwise); a directory's flock stays local there."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return fd, lock(fd, wait=False)
    except OSError as e:
        os.close(fd)
        if e.errno != errno.EBADF:
            raise
    try:
        fd = os.open(path, os.O_WRONLY)  # neither truncates nor writes: a descriptor NFS will lock
    except OSError:  # not ours to open so (read-only, or a directory): deleting it needs only its folder's rights
        return None, None
    try:
        return fd, lock(fd, wait=False)
    except OSError:
        os.close(fd)
        raise
