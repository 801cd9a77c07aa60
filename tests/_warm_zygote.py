"""The warm interpreter behind ``tests/_warm.py``: imports what every training script imports (torch, Dynamo,
Hydra, matplotlib; ~3 CPU-s), then forks one child per request and runs the requested script, ``-m`` module or
``-c`` code in it as ``python`` would have. Not imported by the tests: ``_warm.py`` runs this file with
``python -c`` in a namespace of its own, so that a child can give ``__main__`` to the script it runs.

Protocol, one Unix-socket connection per child: the client sends a 4-byte length and a JSON request
(argv, cwd, env, new session) with its stdin, stdout and stderr attached (SCM_RIGHTS); the zygote answers
``{"pid": N}`` once forked and ``{"code": C, "cpu": S}`` when the child has ended (``C`` as
``Popen.returncode``: negative for a signal; ``S`` the child's CPU seconds, its waited children included).
"""
import json
import os
import select
import signal
import socket
import struct
import sys

#: what the scripts the tests run import before they do anything (``python -X importtime``): ~3 CPU-s
PRELOAD = ("torch", "torch._dynamo", "torch.optim", "numpy", "omegaconf", "hydra", "hydra.main",
           "hydra.core.hydra_config", "matplotlib", "matplotlib.figure")


def _preload() -> list[str]:
    import importlib

    base = [p for p in sys.path if p]  # '' (``-c``'s directory) is the child's to set
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a module this venv lacks is imported (and fails) in the child
            pass
    return base


def _recv_request(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _flags, _addr = socket.recv_fds(conn, 1 << 16, 3)
    while len(data) < 4 or len(data) < 4 + struct.unpack(">I", data[:4])[0]:
        more = conn.recv(1 << 16)
        if not more:
            raise EOFError("request cut short")
        data += more
    return json.loads(data[4:4 + struct.unpack(">I", data[:4])[0]]), list(fds)


def _answer(conn: socket.socket, msg: dict) -> None:
    try:
        conn.sendall(json.dumps(msg).encode() + b"\n")
    except OSError:  # the client went away (its test timed out, or ended)
        pass


def _child(req: dict, fds: list[int], base: list[str]) -> None:
    """In the forked child: become the process ``python <argv>`` would have started, then run it."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    if req.get("new_session"):
        os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    argv = req["argv"]
    pythonpath = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if argv[0] == "-c":
        first, code, sys.argv = "", compile(argv[1], "<string>", "exec"), ["-c", *argv[2:]]
    elif argv[0] == "-m":
        first, code, sys.argv = os.getcwd(), None, ["-m", *argv[2:]]
    else:
        path = os.path.abspath(argv[0])
        first, sys.argv = os.path.dirname(os.path.realpath(path)), list(argv)
        try:
            with open(path, "rb") as f:
                code = compile(f.read(), path, "exec")  # __main__.__file__ is absolute (Python >= 3.9)
        except OSError as exc:  # as ``python missing.py`` says it
            sys.stderr.write(f"{sys.executable}: can't open file {path!r}: [Errno {exc.errno}] {exc.strerror}\n")
            sys.exit(2)
    sys.path[:] = [first, *[os.path.abspath(p) for p in pythonpath], *base]
    import __main__
    import builtins
    import importlib.machinery

    if argv[0] == "-m":
        import runpy

        runpy._run_module_as_main(argv[1], alter_argv=True)
        return
    main = __main__.__dict__
    main.clear()
    main.update(__name__="__main__", __doc__=None, __package__=None, __spec__=None, __builtins__=builtins,
                __annotations__={})
    if argv[0] != "-c":
        main.update(__file__=os.path.abspath(argv[0]), __cached__=None,
                    __loader__=importlib.machinery.SourceFileLoader("__main__", argv[0]))
    else:
        main["__loader__"] = importlib.machinery.BuiltinImporter
    exec(code, main)


def serve(path: str) -> tuple | None:
    """Answer requests until the parent (the pytest worker) is gone; in a forked child, return what it must run.
    Started without ``PYTHONPATH``: ``sys.path`` is then the interpreter's own, and each child puts its own in front."""
    parent = os.getppid()
    base = _preload()
    import gc

    gc.collect()
    gc.freeze()  # the children's collections leave the preloaded heap alone (no copy-on-write of its pages)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(64)
    waiting: dict[int, socket.socket] = {}
    while os.getppid() == parent:
        ready, _, _ = select.select([server, wake_r], [], [], 1.0)
        if wake_r in ready:
            os.read(wake_r, 4096)
        while waiting:
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                _answer(conn, {"code": os.waitstatus_to_exitcode(status), "cpu": usage.ru_utime + usage.ru_stime})
                conn.close()
        if server in ready:
            conn, _ = server.accept()
            try:
                req, fds = _recv_request(conn)
            except (OSError, EOFError, ValueError):
                conn.close()
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                server.close()
                conn.close()
                for other in waiting.values():
                    other.close()
                os.close(wake_r)
                os.close(wake_w)
                return req, fds, base
            for fd in fds:
                os.close(fd)
            waiting[pid] = conn
            _answer(conn, {"pid": pid})
    return None


_work = serve(sys.argv[1])
if _work is not None:
    _child(*_work)
