"""Holds a reader's lock (locks.ReadLock) on argv[2] as a process on an NFS mount would, until its standard input
closes; prints "held" once it holds it. argv[1]: the repository. nfs_flock is how Linux's NFS client runs flock, for a
test's own process to run so too."""
import fcntl
import os
import stat
import sys

LOCAL_FLOCK = fcntl.flock


def nfs_flock(fd, operation):
    """fcntl.flock as Linux's NFS client runs it on a file: a POSIX lock of the whole file (the kernel's lockf), which
    conflicts only with other processes' and, exclusive, needs a descriptor opened to write (EBADF otherwise). A
    directory's flock stays the local one."""
    fd = fd if isinstance(fd, int) else fd.fileno()
    if stat.S_ISDIR(os.fstat(fd).st_mode):
        return LOCAL_FLOCK(fd, operation)
    return fcntl.lockf(fd, operation)


if __name__ == "__main__":
    sys.path.insert(0, sys.argv[1])
    from machinery import locks

    fcntl.flock = nfs_flock
    held = locks.ReadLock(sys.argv[2])
    print("held", flush=True)
    sys.stdin.read()
    held.release()
