"""A fork server for the tests: `python SCRIPT ARGS` as a real process of its own, without paying for Python's start
and torch's import each time (2 to 5 s of CPU on the 2-core test machines, most of a tiny run's cost).

A server, started on first use in each pytest process (one for each set of the environment variables a process reads
as it starts: READ_AT_START), imports torch and numpy once, then forks a process per command: `python SCRIPT ARGS`,
`python -c CODE ARGS`, `python -m MODULE ARGS` (torchrun's launcher, whose workers it forks too), or a console script
of this environment. That process becomes what the command would be: the command's working directory, environment,
standard streams (the caller's own file descriptors, passed over a Unix socket), sys.argv and sys.path as Python sets
them, default signal handlers, no other open file, and Python's normal exit (atexit, threads joined, the exit code of
SystemExit or 1 after a traceback). It is a process like any other: signals reach it by its pid, limits set inside it
are its own, and it dies on its own. What a preexec_fn would do before the command runs is asked for by name: resource
limits, ignored signals, a session of its own. Its parent, a small supervisor forked beside it, reports its exit
status back; the server never runs torch itself, so every fork starts from a process with no threads.

The project's own modules are not imported by the server: a test may run an edited copy of them.

    run(argv, cwd, env, timeout, **how)  ->  a CompletedProcess, as subprocess.run(..., capture_output=True, text=True)
    Process(argv, cwd, env, stdout, stderr, **how)  ->  a Popen's pid, poll, wait, communicate, send_signal, kill,
        returncode, and stdout and stderr where they are PIPE
    popen(argv, **options)  ->  subprocess.Popen's stand-in: a Process where the server can run argv with options
    how: limits={"RLIMIT_NOFILE": (256, 256)}, ignore=("SIGXFSZ",), start_new_session=True (as Popen's),
        tmpfs={"mount": DIR, "options": "size=8k", "before": SHELL, "after": SHELL} (a private tmpfs)
        real_workers=True (torchrun's workers exec'd by its launcher, its children, not forked by the server)

TRAIN_GPT2_TESTS_FORKSERVER=0 switches the server off, for the day it breaks on a new torch or glibc: every command is
then a real process (subprocess.Popen), made as the server would make it (stdin /dev/null, stderr stdout's unless
given; signals and limits set by become()'s own preexec_fn, start_new_session by Popen's own, the tmpfs by `unshare
--map-root-user --mount` and `mount -t tmpfs` in a shell), and run, Process and popen take the same arguments and give
the same results. 1, or unset, leaves it on; any other value is refused, so that a misspelt "off" is not taken for on.
"""
import atexit
import contextlib
import functools
import gc
import io
import json
import os
import resource
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading

HERE = os.path.abspath(__file__)
SWITCH = "TRAIN_GPT2_TESTS_FORKSERVER"


def switched_on(value):
    """Whether SWITCH's value leaves the server on: "1" (its default) does, "0" does not, and nothing else is one."""
    if value not in ("0", "1"):
        raise ValueError(f"{SWITCH}={value!r}: 1 (or unset) forks each command from the tests' fork server, 0 starts "
                         "each as a real process")
    return value == "1"


FORK = switched_on(os.environ.get(SWITCH, "1"))


def forkable(argv):
    """Whether the server can run argv: `python SCRIPT ...`, `python -c CODE ...` or `python -m MODULE ...` with this
    interpreter, or a console script of its environment (its #! line names this interpreter)."""
    argv = [str(a) for a in argv]
    if len(argv) >= 2 and argv[0] == sys.executable:
        return argv[1].endswith(".py") or (argv[1] in ("-c", "-m") and len(argv) >= 3)
    return len(argv) >= 1 and runs_here(argv[0])


def runs_here(path):
    """Whether path is a console script of this environment: a file whose #! line names this interpreter in this
    environment's bin directory (pip may write python3 there for python)."""
    try:
        with open(path, "rb") as f:
            line = f.readline(4096).rstrip()
        named = os.fsdecode(line[2:])
        return (line.startswith(b"#!") and os.path.samefile(os.path.dirname(named), os.path.dirname(sys.executable))
                and os.path.samefile(named, sys.executable))
    except OSError:
        return False


# -----------------------------------------------------------------------------
# The client: one server per process, and a process it forked, seen as a Popen


# what a process reads of its environment as it starts (the C library's allocator, OpenMP, Python, torch's import), so
# that a command forked from a server started with other values would not be the process it asks for: it gets a server
# of its own values (the tests that limit a process's address space set MALLOC_ARENA_MAX, say). Not KMP_: Intel's
# OpenMP reads those, which torch's Linux wheels do not use, and importing scikit-learn (lm_eval does) sets one in the
# tests' own environment, which would start a second server.
READ_AT_START = ("PYTHON", "MALLOC_", "LD_", "OMP_", "GOMP_", "MKL_", "TORCH")
# become() applies these to each command (OMP_NUM_THREADS: as torch's thread count, the one it decides), so commands
# with and without them share a server, started without them
SET_PER_COMMAND = ("PYTHONPATH", "PYTHONUNBUFFERED", "OMP_NUM_THREADS")


start_process = subprocess.Popen  # as it is before a test replaces it with popen
FORKED_OPTIONS = {"cwd", "env", "stdout", "stderr", "text", "start_new_session"}  # popen's, which Process takes


def read_at_start(env):
    return frozenset((key, value) for key, value in env.items()
                     if key.startswith(READ_AT_START) and key not in SET_PER_COMMAND)


class Server:
    lock = threading.Lock()
    started = {}  # read_at_start(env) -> the Server started with those values

    def __init__(self, env):
        self.directory = tempfile.mkdtemp(prefix="forkserver_")
        self.path = os.path.join(self.directory, "socket")
        self.process = start_process([sys.executable, HERE, self.path], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env={k: v for k, v in env.items() if k not in SET_PER_COMMAND})
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


def Process(argv, cwd, env, stdout=None, stderr=None, text=False, limits=None, ignore=(), start_new_session=False,
            tmpfs=None, real_workers=False):
    """argv in a process of its own, its stdin /dev/null, its stdout and stderr the given files or file descriptors,
    or PIPE (then read from .stdout and .stderr, text if text), or STDOUT for stderr (stdout None: this process's own;
    stderr None: stdout's); limits, ignore, start_new_session, tmpfs, real_workers: see become(). Forked by the server
    (a Forked), or with FORK off a subprocess.Popen (torchrun's workers are then real processes anyway)."""
    if FORK:
        return Forked(argv, cwd, env, stdout, stderr, text, limits, ignore, start_new_session, tmpfs, real_workers)
    argv = on_private_tmpfs(argv, **tmpfs) if tmpfs else [str(a) for a in argv]
    # a preexec_fn is safe beside the tests' threads here: it makes system calls only, taking no lock one of them held
    preexec = functools.partial(set_signals_and_limits, limits or {}, ignore)
    return start_process(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=stdout,
                         stderr=subprocess.STDOUT if stderr is None else stderr, text=text,
                         start_new_session=start_new_session, preexec_fn=preexec)


# the shell, run by `unshare --map-root-user --mount`, in which a real process gets the private tmpfs become() mounts
# and ends as a forked one does (an exit code over 128 is taken for the signal a shell would report by it)
TMPFS_SHELL = """mount -t tmpfs -o "$1" tmpfs "$2" || exit
[ -z "$3" ] || (cd "$2" && sh -c "$3") || exit
after=$4
shift 4
# the shell's own stderr is /dev/null, so that it adds no "Terminated" for a command a signal ended
exec 3>&2 2>/dev/null
(exec "$@" 2>&3 3>&-)
code=$?
# after, as a forked command's process runs it at its end: not when a signal other than SIGINT killed it
if [ "$code" -le 128 ] || [ "$code" -eq 130 ]; then [ -z "$after" ] || sh -c "$after" 2>&3 3>&-; fi
# the signal that ended the command ends the shell, for the caller to see it as the server reports it
[ "$code" -le 128 ] || kill -"$((code - 128))" $$
exit "$code"
"""


def on_private_tmpfs(argv, mount, options, before=None, after=None):
    """The command that runs argv in a tmpfs of its own, as become() does for a forked one (its signals and limits,
    set first, hold for the mount's own commands too, as there)."""
    return ["unshare", "--map-root-user", "--mount", "sh", "-c", TMPFS_SHELL, "sh", options, str(mount), before or "",
            after or "", *map(str, argv)]


class Forked:
    """Process's argv forked by the fork server, seen as a Popen."""

    def __init__(self, argv, cwd, env, stdout, stderr, text, limits, ignore, start_new_session, tmpfs,
                 real_workers=False, server_path=None):
        self.args, self.returncode, self.stdout, self.stderr = argv, None, None, None
        self.connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.connection.connect(server_path or Server.get(env).path)  # server_path: a forked launcher's own server
        request = json.dumps({"argv": [str(a) for a in argv], "cwd": str(cwd or os.getcwd()), "env": dict(env),
                              "umask": current_umask(), "limits": limits or {}, "ignore": list(ignore),
                              "new_session": start_new_session, "tmpfs": tmpfs,
                              "real_workers": real_workers}).encode()
        with contextlib.ExitStack() as sent:  # the descriptors the command gets, closed here once they are sent
            stdin = sent.enter_context(open(os.devnull))  # what a test's subprocess reads: nothing
            out = self._descriptor(stdout, 1, "stdout", text, sent)
            err = out if stderr in (None, subprocess.STDOUT) else self._descriptor(stderr, 2, "stderr", text, sent)
            socket.send_fds(self.connection, [request], [stdin.fileno(), out, err])
        self.pid = int(self.connection.recv(64))

    def _descriptor(self, stream, default, name, text, sent):
        """The descriptor to send for stream: a pipe's write end for PIPE, its read end kept as self.<name>."""
        if stream == subprocess.PIPE:
            read_end, write_end = os.pipe()
            setattr(self, name, open(read_end, "r" if text else "rb"))
            sent.callback(os.close, write_end)
            return write_end
        return default if stream is None else stream if isinstance(stream, int) else stream.fileno()

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

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._close_pipes()
        self.wait()

    def _close_pipes(self):
        for pipe in (self.stdout, self.stderr):
            if pipe is not None:
                pipe.close()

    def communicate(self, input=None, timeout=None):
        """(stdout, stderr) read to their ends, where they are pipes, once the process ended; as Popen's, it may be
        called again after its timeout expired. The process reads nothing: input must be None."""
        assert input is None, "a forked command's stdin is /dev/null"
        if not hasattr(self, "_readers"):
            self._read = {}
            self._readers = [threading.Thread(target=lambda pipe=pipe: self._read.update({pipe: pipe.read()}),
                                              daemon=True) for pipe in (self.stdout, self.stderr) if pipe is not None]
            for reader in self._readers:
                reader.start()
        self.wait(timeout)
        for reader in self._readers:
            reader.join()
        self._close_pipes()
        return self._read.get(self.stdout), self._read.get(self.stderr)

    def send_signal(self, sig):
        if self.returncode is None:
            os.kill(self.pid, sig)

    def terminate(self):
        self.send_signal(signal.SIGTERM)

    def kill(self):
        self.send_signal(signal.SIGKILL)


def popen(args, **options):
    """subprocess.Popen(args, **options), forked by the server where it can be: with FORK on, a python command with no
    options but FORKED_OPTIONS; any other command started as it is."""
    if not FORK or not forkable(args) or not set(options) <= FORKED_OPTIONS:
        return start_process(args, **options)
    cwd, env = options.pop("cwd", None), options.pop("env", None)
    return Process(args, cwd, dict(os.environ) if env is None else env, **options)


def current_umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def run(argv, cwd, env, timeout=None, **how):
    """subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout), forked; how: as
    Process's."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        process = Process(argv, cwd, env, stdout=out, stderr=err, **how)
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
            with contextlib.suppress(OSError):  # a client killed outright (a launcher, for its workers) hears nothing
                connection.send(str(pid).encode())
            status = os.waitpid(pid, 0)[1]
            with contextlib.suppress(OSError):
                connection.send(str(os.waitstatus_to_exitcode(status)).encode())
            os._exit(0)
        connection.close()
        for fd in fds:
            os.close(fd)


def become(request, fds, base_path, default_threads, server_path):
    """This process becomes the command request describes, as a preexec_fn would leave it: its signals and limits
    set (set_signals_and_limits), in a session of its own if start_new_session, on its tmpfs if tmpfs; torchrun's
    launcher forks its workers from this server (server_path) unless real_workers. Returns what to run: ("script",
    path), ("code", source) or ("module", name)."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.closerange(3, resource.getrlimit(resource.RLIMIT_NOFILE)[0])  # as subprocess's close_fds
    os.chdir(request["cwd"])
    os.umask(request["umask"])
    os.environ.clear()
    os.environ.update(request["env"])
    set_signals_and_limits(request["limits"], request["ignore"])
    if signal.getsignal(signal.SIGINT) == signal.SIG_DFL:  # as Python sets it as it starts: KeyboardInterrupt
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if request["new_session"]:
        os.setsid()
    tmpfs = request["tmpfs"] or {}
    if tmpfs:
        mount_private_tmpfs(tmpfs["mount"], tmpfs["options"], tmpfs.get("before"))
    argv = request["argv"]
    if argv[0] != sys.executable:  # a console script: python runs it as a script
        argv = [sys.executable, *argv]
    if argv[1] in ("-c", "-m"):
        kind, target = {"-c": "code", "-m": "module"}[argv[1]], argv[2]
        sys.argv = [argv[1], *argv[3:]]  # for -m, runpy puts the module's path in sys.argv[0]
        first = "" if kind == "code" else os.getcwd()  # sys.path[0], as python sets it
    else:
        kind, target = "script", argv[1]
        sys.argv = argv[1:]
        first = os.path.dirname(os.path.realpath(target))  # as python sets it: a link's target's directory
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [first, *extra, *base_path]
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.stdin = io.TextIOWrapper(io.open(0, "rb", closefd=False), encoding="utf-8")
    sys.stdout = io.TextIOWrapper(io.open(1, "wb", buffering=0 if unbuffered else -1, closefd=False),
                                  encoding="utf-8", write_through=unbuffered, line_buffering=os.isatty(1))
    sys.stderr = io.TextIOWrapper(io.open(2, "wb", buffering=0 if unbuffered else -1, closefd=False),
                                  encoding="utf-8", errors="backslashreplace", line_buffering=True,
                                  write_through=unbuffered)
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
    threads = os.environ.get("OMP_NUM_THREADS", "")
    torch.set_num_threads(int(threads) if threads.isdigit() and int(threads) > 0 else default_threads)
    if (kind, target) == ("module", "torch.distributed.run") and not request["real_workers"]:
        fork_workers_from(server_path)
    return kind, target, tmpfs.get("after")


def fork_workers_from(server_path):
    """torchrun's launcher, in this process, forks its workers from the server at server_path, as it would start
    them: `python -u SCRIPT ARGS` in a session of their own, its stdout and stderr theirs unless it redirects them.
    They are not its children (helpers.ranks_of finds them), and /proc shows the server's environment for them:
    real_workers has the launcher start real ones."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

    start_for_real = subprocess_handler.SubprocessHandler._popen

    def start(handler, args, env):
        args = list(args)
        if args[1:2] == ["-u"]:  # python -u: its streams unbuffered, as PYTHONUNBUFFERED leaves them
            del args[1]
            env = dict(env, PYTHONUNBUFFERED="1")
        if not forkable(args):
            return start_for_real(handler, args, env)
        return Forked(args, None, env, handler._stdout or 1, handler._stderr or 2, False, None, (), True, None,
                      server_path=server_path)

    subprocess_handler.SubprocessHandler._popen = start


def set_signals_and_limits(limits, ignore):
    """Sets this process's signals and limits as a command starts with them: SIGINT, SIGTERM, SIGHUP, SIGUSR1 and
    SIGUSR2 at their defaults, the resource limits named in limits ({"RLIMIT_FSIZE": (soft, hard)}), the signals named
    in ignore ignored; become()'s, and a real process's preexec_fn."""
    # whatever the tests' process made of them: a shell's background job (CI's, maybe) ignores SIGINT, say
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)
    for name, (soft, hard) in limits.items():
        resource.setrlimit(getattr(resource, name), (soft, hard))
    for name in ignore:
        signal.signal(getattr(signal, name), signal.SIG_IGN)


def mount_private_tmpfs(mount, options, before=None):
    """A tmpfs mounted at mount (options: "ro", or "size=8k" say) that this process and its children alone see, as
    `unshare --map-root-user --mount` and `mount -t tmpfs -o OPTIONS tmpfs MOUNT` would make it: a user namespace
    where this process is root, and a mount namespace of its own. before: a shell command run in the mount first."""
    libc = ctypes.CDLL(None, use_errno=True)
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNS) != 0:  # a single thread may: this process has one
        raise OSError(ctypes.get_errno(), "unshare")
    for name, line in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(line)
    flags = MS_RDONLY if "ro" in options.split(",") else 0
    data = ",".join(option for option in options.split(",") if option != "ro")
    for source, target, kind, mount_flags, mount_data in ((b"none", b"/", None, MS_REC | MS_PRIVATE, None),
                                                          (b"tmpfs", os.fsencode(mount), b"tmpfs", flags,
                                                           data.encode() or None)):
        if libc.mount(source, target, kind, mount_flags, mount_data) != 0:
            raise OSError(ctypes.get_errno(), f"mount {target.decode()}")
    if before:
        subprocess.run(["sh", "-c", before], cwd=mount, check=True)


def run_as_main(kind, target):
    """The script, the source or the module run as __main__, as python's SCRIPT, -c and -m run them."""
    if kind == "script":
        runpy.run_path(target, run_name="__main__")
    elif kind == "module":
        runpy.run_module(target, run_name="__main__", alter_sys=True)  # sys.argv[0]: the module's file, as -m sets
    else:
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        exec(compile(target, "<string>", "exec"), main.__dict__)


def own_frames(traceback):
    """traceback from the command's own first frame on, as python shows it: without the server's and runpy's."""
    server_files = (HERE, runpy.run_path.__code__.co_filename)
    while traceback is not None and traceback.tb_frame.f_code.co_filename in server_files:
        traceback = traceback.tb_next
    return traceback


def run_then_exit(kind, target, after=None):
    """Runs the command as __main__, then ends the process as Python would, but for the teardown of every module it
    inherited: the exit code of SystemExit, or 1 after the traceback; the non-daemon threads waited for, the atexit
    functions run, the script's own garbage collected (its open files closed), the streams flushed. Tearing the
    inherited modules down would touch every page the process shares with the server, copying them all (1 to 2 s).
    after: a shell command run last (in the private tmpfs's namespace, which ends with the process)."""
    code = 0
    try:
        run_as_main(kind, target)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except KeyboardInterrupt:  # as Python does: it ends by the signal, for the shell to see
        code = -signal.SIGINT
    except BaseException as e:
        sys.excepthook(type(e), e.with_traceback(own_frames(e.__traceback__)), e.__traceback__)
        code = 1
    threading._shutdown()
    atexit._run_exitfuncs()
    gc.collect()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if after:
        subprocess.run(["sh", "-c", after])
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code & 0xFF)


if __name__ == "__main__":
    base_path = [p for p in sys.path[1:] if p not in os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    import ctypes
    import runpy
    import types

    CLONE_NEWNS, CLONE_NEWUSER = 0x00020000, 0x10000000  # <sched.h>
    MS_RDONLY, MS_REC, MS_PRIVATE = 1, 0x4000, 1 << 18  # <sys/mount.h>

    import numpy  # noqa: F401
    import requests  # noqa: F401 (machinery/downloads.py's)
    import tiktoken  # noqa: F401
    import torch  # what every command imports first, imported once
    import torch._dynamo  # noqa: F401 (imported by the first optimizer a run makes: seconds, on these machines)
    import torch.distributed.nn  # noqa: F401 (train_gpt2.py's, before any process group)

    default_threads = torch.get_num_threads()  # a command's without OMP_NUM_THREADS

    gc.freeze()  # what is imported stays out of every collection: a forked process's collector never touches it
    request, fds = serve(sys.argv[1])
    run_then_exit(*become(request, fds, base_path, default_threads, sys.argv[1]))
