"""Run model-written Python against tests in a separate, locked-down process: the code
grader behind GRPO's `code` reward (linnet.rl.rewards).

    from linnet.rl.sandbox import run_tests
    run_tests("def add(a, b):\n    return a + b", ["assert add(1, 2) == 3", {"call": "add(2, 2)", "expect": 4}])
    # Outcome(passed=2, total=2, status='ok', ...); .share == 1.0

Tests come as a list, each counted on its own (an assert statement, or a case
{"call": "add(1, 2)", "expect": 3} meaning `assert (add(1, 2)) == 3`), or as one block of
test code (one test). They run one after another after the code, in its namespace; one
that fails or raises counts 0 and the next still runs.

The code never runs in the caller's process. Each run starts a fresh `python -I -B` (no
user site, no PYTHON* variables, no bytecode written) from an empty environment (PATH,
LANG, TMPDIR its directory, one thread for numerical libraries), in a new session and a
fresh temporary directory removed afterwards, and kills its whole process group at the
wall-clock timeout. Before the code runs, the child locks itself in, in layers, each where
the machine allows it (docs/objectives.md has what each stops, measured):

  uid       as root: becomes nobody (65534) keeping only CAP_DAC_READ_SEARCH, so that it
            still imports from an interpreter nobody may not read (pyenv under /root) but
            owns nothing outside its directory, cannot signal or read the trainer's /proc
            entries, and counts against RLIMIT_NPROC (which root ignores)
  netns     a network namespace of its own (root makes it directly, anyone else inside a
            user namespace): nothing to connect to, not even the trainer's loopback
  landlock  Linux 5.13+: no writes outside its directory, no exec; 6.7+ (ABI 4): no TCP
            bind or connect; 6.12+ (ABI 6): no signals or abstract unix sockets beyond it
  rlimits   CPU seconds, address space, file size, processes, open files, no core files
  hook      an audit hook (PEP 578), which Python cannot remove: refuses non-unix sockets
            and name lookups, signals to other processes, fork/exec/spawn/subprocess/
            os.system, ctypes calls and native code from outside the interpreter, sub-
            interpreters, raising its limits, writes outside its directory, reads outside it
            and the interpreter's folders (the trainer's /proc/<pid>/environ); and hides
            what could reach the grader's own state (frames, gc referrers, tracing)

A run that tries a refused operation scores 0 (status "refused"); modules the sandbox
withholds (ctypes, cffi) raise ImportError, frames ValueError or AttributeError, as the
stdlib expects of them. `Outcome.layers` names the kernel layers that held. An audit hook is
no boundary on its own (PEP 578): it is the last layer, and the only one left to a non-root
user on a kernel without Landlock and without unprivileged user namespaces. Linux only.
"""

from __future__ import annotations

import ast
import json
import os
import re
import secrets
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass

NOBODY = 65534
ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8",
       # numerical libraries start a thread a core, which the process limit refuses (OpenBLAS then aborts)
       "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
OPEN_FILES = 64
OUTPUT_CHARS = 4000


@dataclass(frozen=True)
class Outcome:
    """How a run of code against its tests ended.

    passed, total  the tests that passed, of all (none pass in a refused run)
    status   "ok": every test passed; "failed": it ran to the end and some failed (or the
             code itself raised); "timeout": the wall clock or the CPU limit stopped it;
             "crashed": it died before the end otherwise (a signal, os._exit, the file
             size limit); "refused": it tried an operation the sandbox refuses
    stderr   the end of what it wrote to stderr: why tests failed, what was refused
    layers   the kernel layers that held in this run ("uid", "netns", "landlock<ABI>")
    output   the end of what the code printed (its last OUTPUT_CHARS characters)
    """

    passed: int
    total: int
    status: str
    stderr: str = ""
    layers: tuple[str, ...] = ()
    output: str = ""

    @property
    def share(self) -> float:
        """The reward: the share of the tests that passed."""
        return self.passed / self.total


def check_platform() -> None:
    """Refuse where the sandbox cannot hold: it needs Linux's resource limits, sessions and namespaces."""
    if not sys.platform.startswith("linux"):
        raise RuntimeError(f"linnet.rl.sandbox runs model-written code on Linux only (this is {sys.platform}): "
                           "grade code on a Linux machine or in a Linux container")


def as_tests(tests) -> list[str]:
    """The tests as Python sources, one a test: a list of assert statements or of
    {"call": ..., "expect": ...} cases, or one block of test code. Each must parse and
    assert something (a test without an assert could never fail)."""
    if isinstance(tests, str):
        tests = [tests]
    if not isinstance(tests, (list, tuple)) or not tests:
        raise ValueError(f"tests are {type(tests).__name__} {json.dumps(tests, default=str)[:80]}; give a list of "
                         "assert statements, a list of {\"call\": ..., \"expect\": ...} cases, or a block of test code")
    sources = []
    for i, test in enumerate(tests):
        if isinstance(test, dict) and set(test) == {"call", "expect"} and isinstance(test["call"], str):
            test = f"assert ({test['call']}) == {test['expect']!r}"
        if not isinstance(test, str):
            raise ValueError(f"test {i} is {json.dumps(test, default=str)[:80]}; give an assert statement or "
                             "{\"call\": \"f(1)\", \"expect\": 2}")
        try:
            tree = ast.parse(test)
            compile(tree, f"<test {i}>", "exec")
        except SyntaxError as e:
            raise ValueError(f"test {i} is not Python ({e.msg}, line {e.lineno}): {test[:80]!r}") from None
        if not any(isinstance(node, ast.Assert) for node in ast.walk(tree)):
            raise ValueError(f"test {i} asserts nothing, so it could never fail: {test[:80]!r}")
        sources.append(test)
    return sources


def run_tests(code: str, tests, *, timeout: float = 10.0, cpu_seconds: int = 5, memory_mb: int = 1024,
              file_mb: int = 16, processes: int = 1) -> Outcome:
    """Run `code`, then each of `tests` (see `as_tests`), in a sandboxed child process.

    timeout      wall-clock seconds before the child and its process group are killed
    cpu_seconds  RLIMIT_CPU
    memory_mb    RLIMIT_AS: its address space, so a large allocation raises MemoryError
    file_mb      RLIMIT_FSIZE: the largest file it may write (its output included)
    processes    RLIMIT_NPROC, which counts every process and thread of the child's user
                 (nobody's, or yours when not root): 1 lets it start none
    """
    return _run(code, as_tests(tests), dict(timeout=timeout, cpu_seconds=cpu_seconds, memory_mb=memory_mb,
                                            file_mb=file_mb, processes=processes), "run_tests")


def run_code(code: str, *, timeout: float = 10.0, cpu_seconds: int = 5, memory_mb: int = 1024, file_mb: int = 16,
             processes: int = 1) -> Outcome:
    """Run `code` alone in the sandbox (the limits of `run_tests`): what it printed is the
    Outcome's `output` (the python tool's result); status "ok" when it ran to its end."""
    return _run(code, [], dict(timeout=timeout, cpu_seconds=cpu_seconds, memory_mb=memory_mb, file_mb=file_mb,
                               processes=processes), "run_code")


def _run(code: str, sources: list[str], limits: dict, who: str) -> Outcome:
    import subprocess  # here, not at the top: the child runs this file and must not hold subprocess

    check_platform()
    if not isinstance(code, str):
        raise TypeError(f"{who}: code is {type(code).__name__}; give the program's text")
    for name, value in limits.items():
        if not value > 0:
            raise ValueError(f"{who}: {name}={value}; use a positive number")
    nonce = secrets.token_hex(16)
    root = os.path.realpath(tempfile.mkdtemp(prefix="linnet-sandbox-"))
    uid = NOBODY if os.geteuid() == 0 else None
    try:
        if uid is not None:
            try:
                os.chown(root, uid, uid)
            except OSError:  # root of a user namespace without nobody in it: the child stays root
                uid = None
        job = dict(nonce=nonce, code=code, tests=sources, root=root, uid=uid, limits=limits)
        with tempfile.TemporaryFile() as stdin, tempfile.TemporaryFile() as stdout, \
                tempfile.TemporaryFile() as stderr:
            stdin.write(json.dumps(job).encode())
            stdin.seek(0)
            child = subprocess.Popen([sys.executable, "-I", "-B", __file__], stdin=stdin, stdout=stdout, stderr=stderr,
                                     cwd=root, env={**ENV, "TMPDIR": root}, start_new_session=True)
            late = False
            try:
                child.wait(limits["timeout"])
            except subprocess.TimeoutExpired:
                late = True
            finally:
                try:  # whatever it left behind in its group
                    os.killpg(child.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                child.wait()
            stdout.seek(0)
            stderr.seek(max(0, stderr.seek(0, os.SEEK_END) - 2000))
            return _outcome(stdout.read().decode(errors="replace"), stderr.read().decode(errors="replace"),
                            nonce, len(sources), child.returncode, late)
    finally:
        _remove(root)


def _outcome(stdout: str, stderr: str, nonce: str, total: int, returncode: int, late: bool) -> Outcome:
    """The child's records: lines "<nonce> <kind> <detail>" that the code cannot forge (it
    never sees the nonce), among whatever else it printed."""
    records = re.findall(rf"^{nonce} (\w+) ?(.*)$", stdout, flags=re.MULTILINE)
    output = re.sub(rf"\n{nonce} [^\n]*\n", "", stdout)[-OUTPUT_CHARS:]
    kinds = {kind for kind, _ in records}
    layers = next((tuple(detail.split()) for kind, detail in records if kind == "ready"), ())
    passed = len({detail for kind, detail in records if kind == "pass"})
    if "refused" in kinds:
        status, passed = "refused", 0
    elif "done" in kinds:
        status = "ok" if passed == total and "raised" not in kinds else "failed"
    elif late or returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        status = "timeout"
    else:
        status = "crashed"
    return Outcome(passed, total, status, stderr.strip(), layers, output)


def _remove(root: str) -> None:
    """The sandbox directory and everything in it, whatever modes the code left on its folders."""
    os.chmod(root, 0o700)
    for folder, subfolders, _ in os.walk(root):
        for name in subfolders:
            path = os.path.join(folder, name)
            if not os.path.islink(path):
                os.chmod(path, 0o700)
    shutil.rmtree(root, ignore_errors=True)


# The child's side: this file run as `python -I -B sandbox.py`, the job on stdin.

CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
PR_SET_KEEPCAPS, PR_SET_NO_NEW_PRIVS = 8, 38
CAP_DAC_READ_SEARCH = 2
LANDLOCK_CREATE_RULESET, LANDLOCK_ADD_RULE, LANDLOCK_RESTRICT_SELF = 444, 445, 446  # the same on x86-64 and arm64


def _child() -> None:
    """The sandboxed interpreter: read the job, lock itself in, run the code and the tests."""
    import ctypes

    chunks = []
    while chunk := os.read(0, 1 << 20):
        chunks.append(chunk)
    os.close(0)
    job = json.loads(b"".join(chunks))
    libc = ctypes.CDLL(None, use_errno=True)
    layers = []
    if _unshare_network(libc, as_root=os.geteuid() == 0):
        layers.append("netns")
    if job["uid"] is not None and _drop_root(libc, job["uid"]):
        layers.append("uid")
    if abi := _landlock(libc, job["root"]):
        layers.append(f"landlock{abi}")
    _limit(job["limits"])
    for name in [m for m in sys.modules if m.split(".")[0] in ("ctypes", "_ctypes")]:
        del sys.modules[name]  # so that importing it again is an audited import, which the hook withholds
    _jail(job, layers)


def _unshare_network(libc, as_root: bool) -> bool:
    """A network namespace of its own, holding only a loopback that is down. Root makes it
    directly: in a user namespace it would lose its capabilities over the files it reads."""
    return libc.unshare(CLONE_NEWNET if as_root else CLONE_NEWUSER | CLONE_NEWNET) == 0


def _drop_root(libc, uid: int) -> bool:
    """Become `uid` for good, keeping only CAP_DAC_READ_SEARCH (to read and search any
    folder: the interpreter's may be closed to others), so that it owns nothing outside its
    directory, cannot signal root's processes or read their /proc entries, and counts
    against RLIMIT_NPROC."""
    import ctypes

    try:
        if libc.prctl(PR_SET_KEEPCAPS, 1, 0, 0, 0) != 0:
            return False
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    except OSError:  # no CAP_SETUID (a rootless container): stay as we are
        return False
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    kept = 1 << CAP_DAC_READ_SEARCH
    data = (ctypes.c_uint32 * 6)(kept, kept, 0, 0, 0, 0)  # effective, permitted, inheritable; low then high words
    libc.capset(header, data)  # on failure it has no capability at all: imports from a closed folder fail
    return True


def _landlock(libc, root: str) -> int:
    """Landlock's rules for the rest of the child's life: write only beneath `root`,
    execute nothing, and (as the kernel's ABI allows) no TCP, no signals or abstract unix
    sockets beyond the sandbox. Reading stays open (the hook narrows it). The ABI, 0 without Landlock."""
    import ctypes

    long = ctypes.c_long
    libc.syscall.restype = long
    abi = libc.syscall(long(LANDLOCK_CREATE_RULESET), None, long(0), long(1))  # 1: the ABI version
    if abi < 1:
        return 0
    # execute, write, and remove/make dir, file, char, sock, fifo, block, symlink; refer (2); truncate (3)
    fs = (1 << 0) | (1 << 1) | sum(1 << b for b in range(4, 13)) | (1 << 13) * (abi >= 2) | (1 << 14) * (abi >= 3)
    net = 0b11 if abi >= 4 else 0  # bind and connect TCP
    scoped = 0b11 if abi >= 6 else 0  # abstract unix sockets and signals

    class Beneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]

    attr = (ctypes.c_uint64 * 3)(fs, net, scoped)
    ruleset = libc.syscall(long(LANDLOCK_CREATE_RULESET), ctypes.byref(attr), long(ctypes.sizeof(attr)), long(0))
    if ruleset < 0:
        return 0
    folder = os.open(root, os.O_PATH | os.O_CLOEXEC)
    rule = Beneath(fs & ~1, folder)  # everything but execute, beneath its directory
    held = (libc.syscall(long(LANDLOCK_ADD_RULE), long(ruleset), long(1), ctypes.byref(rule), long(0)) == 0
            and libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0
            and libc.syscall(long(LANDLOCK_RESTRICT_SELF), long(ruleset), long(0)) == 0)
    os.close(folder)
    os.close(ruleset)
    return abi if held else 0


def _limit(limits: dict) -> None:
    import resource

    mb = 1 << 20
    for name, soft, hard in [("RLIMIT_CPU", limits["cpu_seconds"], limits["cpu_seconds"] + 1),
                             ("RLIMIT_AS", limits["memory_mb"] * mb, None), ("RLIMIT_FSIZE", limits["file_mb"] * mb, None),
                             ("RLIMIT_NPROC", limits["processes"], None), ("RLIMIT_NOFILE", OPEN_FILES, None),
                             ("RLIMIT_CORE", 0, None)]:
        resource.setrlimit(getattr(resource, name), (int(soft), int(soft if hard is None else hard)))


# Events the hook refuses outright, by name or prefix.
REFUSED = frozenset({"os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system", "os.startfile",
                     "subprocess.Popen", "pty.spawn", "os.killpg", "signal.pthread_kill", "os.unshare", "os.setns",
                     "os.link", "os.symlink", "resource.setrlimit", "resource.prlimit", "sys.settrace",
                     "sys.setprofile", "sys._current_frames", "sys._current_exceptions", "gc.get_objects",
                     "gc.get_referrers", "gc.get_referents", "cpython.PyInterpreterState_New"})
REFUSED_PREFIXES = ("ctypes.", "syslog.", "_winapi.", "winreg.")
# Modules that call native code or start processes beneath the audit events.
REFUSED_IMPORTS = frozenset({"ctypes", "_ctypes", "_cffi_backend", "_posixsubprocess", "_xxsubinterpreters",
                             "_xxinterpchannels", "_interpreters", "_interpchannels", "_testcapi",
                             "_testinternalcapi"})
FRAMES = frozenset({"tb_frame", "gi_frame", "cr_frame", "ag_frame"})  # the attributes that lead to frames
# Events whose path arguments must lie inside the sandbox directory.
WRITES = frozenset({"os.remove", "os.rmdir", "os.mkdir", "os.rename", "os.chmod", "os.chown", "os.lchown",
                    "os.truncate", "os.utime", "os.setxattr", "os.removexattr", "os.chflags", "os.lchflags",
                    "os.lchmod", "sqlite3.connect"})
UNIX_SOCKETS = frozenset({"socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg"})


def _jail(job: dict, layers: list) -> None:
    """Install the audit hook, then run the code and each test, reporting each on stdout
    as "<nonce> pass|fail <i>" and at the end "<nonce> done".

    Everything the hook and the loop use once the code runs is bound here, as locals of
    this call: the code may rebind builtins, module attributes and this module's globals,
    but cannot reach this frame (frames are withheld, gc's referrers refused), so it can
    neither learn the nonce nor change what the hook allows or the loop records."""
    nonce, root = job["nonce"], job["root"]
    write, getcwd, fspath, exit_, own_pid = os.write, os.getcwd, os.fspath, os._exit, os.getpid()
    printed = sys.stdout
    isinstance_, hasattr_, type_, int_, str_, bytes_ = isinstance, hasattr, type, int, str, bytes
    exec_, compile_ = exec, compile
    AttributeError_, BaseException_, ImportError_, OSError_, PermissionError_, ValueError_ = (  # noqa: N806
        AttributeError, BaseException, ImportError, OSError, PermissionError, ValueError)
    refused_events, refused_prefixes, refused_imports = REFUSED, REFUSED_PREFIXES, REFUSED_IMPORTS
    if any(layer.startswith("landlock") for layer in layers):  # exec is refused beneath: asyncio may import subprocess
        refused_imports = refused_imports - {"_posixsubprocess"}
    frames, writes, unix_sockets = FRAMES, WRITES, UNIX_SOCKETS
    o_write = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
    folders = [sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix, *sys.path]
    interpreter = tuple({f for p in folders if os.path.isabs(p) for f in (os.path.abspath(p), os.path.realpath(p))})
    readable = (root, "/dev/null", "/dev/urandom", *interpreter)
    refused: list[str] = []

    def emit(kind: str, detail: str = "") -> None:
        try:
            write(1, f"\n{nonce} {kind} {detail}\n".encode())
        except OSError_:  # the code closed its stdout: only its own score suffers
            pass

    def inside(path, within: tuple) -> bool:
        path = fspath(path)
        if isinstance_(path, bytes_):
            path = path.decode("utf-8", "surrogateescape")
        if not path.startswith("/"):
            path = getcwd() + "/" + path
        parts: list[str] = []
        for part in path.split("/"):  # normalised by hand: os.path's functions can be rebound
            if part == "..":
                if parts:
                    parts.pop()
            elif part and part != ".":
                parts.append(part)
        path = "/" + "/".join(parts)
        for folder in within:
            if path == folder or path.startswith(folder + "/"):
                return True
        return False

    def is_path(arg) -> bool:
        return isinstance_(arg, (str_, bytes_)) or hasattr_(arg, "__fspath__")

    def verdict(event: str, args: tuple) -> str | None:
        """Why `event` is refused, or None."""
        if event in refused_events or event.startswith(refused_prefixes):
            return event
        if event == "import":  # args: the name, and the file of an extension module
            return None if args[1] is None or inside(args[1], interpreter) else f"loading native code {args[1]!r}"
        if event == "os.kill":
            return None if args[0] == own_pid else f"os.kill of process {args[0]}"
        if event == "open":
            path, mode, flags = args
            if isinstance_(path, int_):  # a descriptor it holds already
                return None
            if mode is None or flags & o_write:  # os.open (it yields directory descriptors) or writing
                return None if inside(path, (root,)) else f"open {path!r} outside the sandbox directory"
            return None if inside(path, readable) else f"reading {path!r} outside the sandbox and the interpreter"
        if event in writes:
            for arg in args:
                if is_path(arg) and not inside(arg, (root,)):
                    return f"{event} {arg!r} outside the sandbox directory"
            return None
        if event == "socket.__new__":
            return None if args[1] == 1 else f"a socket of family {args[1]} (only unix sockets)"  # 1: AF_UNIX
        if event in unix_sockets:  # a unix socket's path inside the directory; no abstract names
            address = args[1]
            ok = is_path(address) and address[:1] not in ("\0", b"\0") and inside(address, (root,))
            return None if ok else f"{event} to {address!r}"
        if event.startswith("socket."):  # name lookups, host names
            return event
        return None

    def hook(event: str, args: tuple) -> None:
        # Withheld, not refused (the score stands): the stdlib and numpy cope with these errors
        if event == "sys._getframe":  # namedtuple, typing and logging fall back on ValueError
            raise ValueError_("frames are not available in the sandbox")
        if event == "object.__getattr__" and args[1] in frames:  # asyncio's reprs check with hasattr
            raise AttributeError_(f"{args[1]} is not available in the sandbox")
        if event == "import" and args[0] in refused_imports:  # numpy runs without ctypes
            raise ImportError_(f"{args[0]} is not available in the sandbox")
        why = verdict(event, args)
        if why is not None:
            refused.append(why)
            emit("refused", event)
            say(f"sandbox: refused {why}")
            raise PermissionError_(f"sandbox: refused {why}")

    def say(text: str) -> None:
        try:
            write(2, (text[:300] + "\n").encode())
        except OSError_:
            pass

    def failed(what: str, error) -> None:
        try:
            say(f"{what}: {type_(error).__name__}: {error}")
        except BaseException_:  # an exception whose text fails to render
            say(f"{what}: failed")

    emit("ready", " ".join(layers))
    checks = [(i, compile(test, f"<test {i}>", "exec")) for i, test in enumerate(job["tests"])]
    module = type(sys)("__main__")  # the code's own __main__ (dataclasses and pickle look it up)
    sys.modules["__main__"] = module
    namespace = module.__dict__
    sys.addaudithook(hook)
    try:
        exec_(compile_(job["code"], "<code>", "exec"), namespace)
        ran = True
    except BaseException_ as e:
        failed("the code", e)
        emit("raised")
        ran = False
    for i, check in checks:
        passed = False
        if ran and not refused:
            try:
                exec_(check, namespace)
                passed = True
            except BaseException_ as e:
                failed(f"test {i}", e)
        if refused:
            break
        emit("pass" if passed else "fail", f"{i}")
    try:  # what the code printed, before _exit drops the buffer
        printed.flush()
    except BaseException_:
        pass
    emit("refused" if refused else "done")
    exit_(0)


if __name__ == "__main__":
    _child()
