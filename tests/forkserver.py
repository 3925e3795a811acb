"""A fork server for the tests: `python SCRIPT ARGS` as a real process of its own, without paying for Python's start
and torch's import each time (2 to 5 s of CPU on the 2-core test machines, most of a tiny run's cost).

A server, started on first use in each pytest process (one for each set of the environment variables a process reads
as it starts: READ_AT_START), imports torch and numpy once, then forks a process per command.
That process becomes what `python SCRIPT ARGS` would be: the command's working directory, environment, standard
streams (the caller's own file descriptors, passed over a Unix socket), sys.argv and sys.path as Python sets them,
default signal handlers, and Python's normal exit (atexit, threads joined, the exit code of SystemExit or 1 after a
traceback). It is a process like any other: signals reach it by its pid, limits set inside it are its own, and it dies
on its own. Its parent, a small supervisor forked beside it, reports its exit status back; the server never runs torch
itself, so every fork starts from a process with no threads.

The project's own modules are not imported by the server: a test may run an edited copy of them.

    run(argv, cwd, env, timeout)  ->  a CompletedProcess, as subprocess.run(..., capture_output=True, text=True)
    Process(argv, cwd, env, stdout)  ->  .pid .poll() .wait() .send_signal() .kill() .returncode, as a Popen
"""
import atexit
import contextlib
import gc
import io
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading

HERE = os.path.abspath(__file__)


def forkable(argv):
    """Whether argv is `python SCRIPT ...` with this interpreter, which the server can run (not `python -m ...`)."""
    return len(argv) >= 2 and argv[0] == sys.executable and str(argv[1]).endswith(".py")


# -----------------------------------------------------------------------------
# The client: one server per process, and a process it forked, seen as a Popen


# what a process reads of its environment as it starts (the C library's allocator, OpenMP, Python, torch's import), so
# that a command forked from a server started with other values would not be the process it asks for: it gets a server
# of its own values (the tests that limit a process's address space set MALLOC_ARENA_MAX, say)
READ_AT_START = ("PYTHON", "MALLOC_", "LD_", "OMP_", "KMP_", "GOMP_", "MKL_", "TORCH")
SET_PER_COMMAND = ("PYTHONPATH", "PYTHONUNBUFFERED")  # become() applies these to each command


def read_at_start(env):
    return frozenset((key, value) for key, value in env.items()
                     if key.startswith(READ_AT_START) and key not in SET_PER_COMMAND)


class Server:
    lock = threading.Lock()
    started = {}  # read_at_start(env) -> the Server started with those values

    def __init__(self, env):
        self.directory = tempfile.mkdtemp(prefix="forkserver_")
        self.path = os.path.join(self.directory, "socket")
        self.process = subprocess.Popen([sys.executable, HERE, self.path], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, env=env)
        if self.process.stdout.readline() != b"ready\n":
            raise RuntimeError("the tests' fork server did not start")

    @classmethod
    def get(cls, env):
        """The server for a command of this environment, started with it if there is none yet."""
        key = read_at_start(env)
        with cls.lock:
            if key not in cls.started or cls.started[key].process.poll() is not None:
                cls.started[key] = Server(env)
            return cls.started[key]


class Process:
    """argv run by the fork server, its stdout and stderr the given files or file descriptors (stderr None: stdout's;
    stdout None: this process's own)."""

    def __init__(self, argv, cwd, env, stdout=None, stderr=None):
        self.args, self.returncode = argv, None
        server = Server.get(env)
        self.connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.connection.connect(server.path)
        request = json.dumps({"argv": [str(a) for a in argv], "cwd": str(cwd or os.getcwd()), "env": dict(env),
                              "umask": current_umask()}).encode()
        out = descriptor(stdout, 1)
        with open(os.devnull) as stdin:  # what a test's subprocess reads: nothing
            socket.send_fds(self.connection, [request], [stdin.fileno(), out, descriptor(stderr, out)])
        self.pid = int(self.connection.recv(64))

    def poll(self):
        if self.returncode is None and select.select([self.connection], [], [], 0)[0]:
            self._read_status()
        return self.returncode

    def wait(self, timeout=None):
        if self.returncode is None:
            if not select.select([self.connection], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._read_status()
        return self.returncode

    def _read_status(self):
        self.returncode = int(self.connection.recv(64))
        self.connection.close()

    def send_signal(self, sig):
        if self.returncode is None:
            os.kill(self.pid, sig)

    def terminate(self):
        self.send_signal(signal.SIGTERM)

    def kill(self):
        self.send_signal(signal.SIGKILL)


def descriptor(stream, default):
    """A file's descriptor, or the descriptor itself, or default for None."""
    return default if stream is None else stream if isinstance(stream, int) else stream.fileno()


def current_umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def run(argv, cwd, env, timeout=None):
    """subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout), forked."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        process = Process(argv, cwd, env, stdout=out, stderr=err)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise
        out.seek(0), err.seek(0)
        return subprocess.CompletedProcess(argv, process.returncode, read_text(out), read_text(err))


def read_text(f):
    return f.read().decode("utf-8", errors="replace").replace("\r\n", "\n")


# -----------------------------------------------------------------------------
# The server, and the process a command becomes


def serve(path):
    """Forks a supervisor for each request, which forks the command's process and reports its pid, then its exit
    status. Returns only in a command's process: (request, file descriptors). Ends when its client's pipe closes."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(16)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the supervisors are reaped by the kernel
    os.write(1, b"ready\n")
    while True:
        ready = select.select([listener, sys.stdin], [], [])[0]
        if sys.stdin in ready:  # the client is gone
            os.remove(path)
            os.rmdir(os.path.dirname(path))
            os._exit(0)
        connection = listener.accept()[0]
        message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 3)
        if os.fork() == 0:
            listener.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            pid = os.fork()
            if pid == 0:
                connection.close()
                return json.loads(message), fds
            for fd in fds:
                os.close(fd)
            connection.send(str(pid).encode())
            status = os.waitpid(pid, 0)[1]
            connection.send(str(os.waitstatus_to_exitcode(status)).encode())
            os._exit(0)
        connection.close()
        for fd in fds:
            os.close(fd)


def become(request, fds, base_path):
    """This process becomes `python SCRIPT ARGS` as request describes it; returns the script's path."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.umask(request["umask"])
    os.environ.clear()
    os.environ.update(request["env"])
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as Python sets it: KeyboardInterrupt
    script, args = request["argv"][1], request["argv"][2:]
    sys.argv = [script, *args]
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [os.path.dirname(os.path.abspath(script)), *extra, *base_path]
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.stdin = io.TextIOWrapper(io.open(0, "rb", closefd=False), encoding="utf-8")
    sys.stdout = io.TextIOWrapper(io.open(1, "wb", buffering=0 if unbuffered else -1, closefd=False),
                                  encoding="utf-8", write_through=unbuffered, line_buffering=os.isatty(1))
    sys.stderr = io.TextIOWrapper(io.open(2, "wb", buffering=0 if unbuffered else -1, closefd=False),
                                  encoding="utf-8", errors="backslashreplace", line_buffering=True,
                                  write_through=unbuffered)
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    return script


def run_then_exit(script):
    """Runs the script as __main__, then ends the process as Python would, but for the teardown of every module it
    inherited: the exit code of SystemExit, or 1 after the traceback; the non-daemon threads waited for, the atexit
    functions run, the script's own garbage collected (its open files closed), the streams flushed. Tearing the
    inherited modules down would touch every page the process shares with the server, copying them all (1 to 2 s)."""
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except KeyboardInterrupt:  # as Python does: it ends by the signal, for the shell to see
        code = -signal.SIGINT
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    threading._shutdown()
    atexit._run_exitfuncs()
    gc.collect()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code & 0xFF)


if __name__ == "__main__":
    base_path = [p for p in sys.path[1:] if p not in os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    import runpy

    import numpy  # noqa: F401
    import requests  # noqa: F401 (plumbing.py's downloads)
    import tiktoken  # noqa: F401
    import torch  # what every command imports first, imported once
    import torch._dynamo  # noqa: F401 (imported by the first optimizer a run makes: seconds, on these machines)
    import torch.distributed.nn  # noqa: F401 (train_gpt2.py's, before any process group)

    gc.freeze()  # what is imported stays out of every collection: a forked process's collector never touches it
    request, fds = serve(sys.argv[1])
    run_then_exit(become(request, fds, base_path))
