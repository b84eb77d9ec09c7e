"""Run a function in a killable worker process under a hard wall-clock limit.

`Pool(size)` keeps up to `size` persistent workers, started lazily. Each worker is a fresh interpreter
started with `subprocess.Popen([sys.executable, "-c", ...])`: nothing of the caller is forked (it may hold
torch/CUDA threads and locks), and unlike multiprocessing's spawn/forkserver the caller's `__main__` script
is not re-imported in the worker (a training script would drag torch into every worker). The parent's
`sys.path` is passed on through PYTHONPATH. Calls `(fn, args, kwargs)` go pickled (functions by reference,
so `fn` must be importable) over the worker's stdin, results come back over its stdout, framed by
`multiprocessing.connection.Connection`; the worker points its own fd 1 at stderr, so stray prints cannot
corrupt the channel.

The caller waits with `Connection.poll(remaining)`: no signals, so any thread may call. A worker past its
limit is SIGKILLed (the caller returns about a millisecond after the limit), however it is stuck (in C code,
in sympy), and a replacement starts at once in the background; a worker that dies (segfault, OOM kill) gives
EOF -> `SandboxError` and is replaced the same way; an exception raised by `fn` is re-raised in the caller.
Starting a worker on demand (interpreter, imports and `init`: slow next to a check) is not counted in `timeout` but is
bounded by START_TIMEOUT; `warm()` starts workers ahead of time. Waiting for a busy worker, or for a replacement
still starting, counts: so calls that share a deadline (math.verify_batch) end by it, stalled workers or not.

Backstops inside the worker: an address-space limit (`memory_mb`, MemoryError instead of swapping the host),
a CPU-time limit per call (the kernel kills a worker that computes for timeout + about 3 s even if the
parent is gone), and a watchdog thread that exits when the parent dies. Workers are killed at interpreter exit.
"""
from __future__ import annotations

import atexit
import os
import pickle
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection

START_TIMEOUT = 60.0  # seconds for a new worker to import and report ready
_MODULE = __name__ if __name__ != "__main__" else "bapo_vl.verifiers.sandbox"


class SandboxError(RuntimeError):
    """The worker died (crash, kill) or could not start."""


class SandboxTimeout(Exception):
    """The call did not finish within its limit; the worker was killed."""


class _Worker:
    def __init__(self, init, memory_mb):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p or os.getcwd() for p in sys.path))
        self.proc = subprocess.Popen([sys.executable, "-c", f"from {_MODULE} import _serve; _serve()"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, close_fds=True)
        self.tx = Connection(os.dup(self.proc.stdin.fileno()), readable=False)
        self.rx = Connection(os.dup(self.proc.stdout.fileno()), writable=False)
        self.proc.stdin.close()
        self.proc.stdout.close()
        try:
            self.tx.send((os.getpid(), init, memory_mb))
            if not self.rx.poll(START_TIMEOUT) or self.rx.recv() != "ready":
                raise SandboxError("worker did not start")
        except (EOFError, OSError) as e:
            self.kill()
            raise SandboxError(f"worker failed to start: {e!r}") from None
        except BaseException:
            self.kill()
            raise

    def kill(self):
        try:
            self.proc.kill()
            self.proc.wait(timeout=2)
        except Exception:
            pass
        for conn in (self.tx, self.rx):
            try:
                conn.close()
            except Exception:
                pass


class Pool:
    """Up to `size` workers; `init` (an importable function) runs once in each new worker."""

    def __init__(self, size: int = 2, init=None, memory_mb: int | None = None):
        self.size, self.init, self.memory_mb = size, init, memory_mb
        self._idle: list[_Worker] = []
        self._count = 0  # workers alive, idle or busy
        self._cond = threading.Condition()
        self._closed = False
        atexit.register(self.close)

    def _acquire(self, deadline: float) -> tuple[_Worker, float]:
        with self._cond:
            while not self._idle and self._count >= self.size:
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    raise SandboxTimeout("no worker became free in time")
                self._cond.wait(left)
            if self._idle:
                return self._idle.pop(), 0.0
            self._count += 1
        t0 = time.monotonic()
        try:
            return _Worker(self.init, self.memory_mb), time.monotonic() - t0
        except BaseException:
            self._release(None, False)
            raise

    def _release(self, worker: _Worker | None, healthy: bool) -> None:
        with self._cond:
            keep = healthy and not self._closed
            replace = worker is not None and not keep and not self._closed  # its slot goes to the replacement,
            if keep:  # so that no caller starts one of its own meanwhile (a start it would not count)
                self._idle.append(worker)
            elif not replace:
                self._count -= 1
            self._cond.notify()
        if worker is not None and not keep:
            worker.kill()
        if replace:
            threading.Thread(target=self._replace, name="sandbox-replace", daemon=True).start()

    def _replace(self) -> None:
        """Start a worker in the background for one that was killed or died (callers wait for it, counted)."""
        try:
            worker = _Worker(self.init, self.memory_mb)
        except BaseException:
            with self._cond:  # not _release: a worker that cannot start is not retried in a loop
                self._count -= 1
                self._cond.notify()
            return
        self._release(worker, True)

    def warm(self, n: int | None = None) -> None:
        """Start workers now (up to `n`, default `size`) so that the first calls don't pay the start."""
        started = [self._acquire(time.monotonic() + START_TIMEOUT)[0] for _ in range(min(n or self.size, self.size))]
        for w in started:
            self._release(w, True)

    def run(self, fn, *args, timeout: float, **kwargs):
        """fn(*args, **kwargs) in a worker; raises SandboxTimeout past `timeout` s, SandboxError if it dies."""
        data = pickle.dumps((fn, args, kwargs, timeout), protocol=pickle.HIGHEST_PROTOCOL)
        t0 = time.monotonic()
        for attempt in (0, 1):  # an idle worker that died meanwhile (OOM killer...) gets one replacement
            worker, start_s = self._acquire(t0 + timeout)
            try:
                worker.tx.send_bytes(data)
                break
            except OSError:
                self._release(worker, False)
                if attempt:
                    raise SandboxError("worker died before the call") from None
        deadline = t0 + timeout + start_s
        healthy = False
        try:
            if not worker.rx.poll(max(0.0, deadline - time.monotonic())):
                raise SandboxTimeout(f"{getattr(fn, '__name__', fn)} exceeded {timeout:g} s")
            status, value = worker.rx.recv()
            healthy = not isinstance(value, MemoryError)  # the worker exits after a MemoryError
        except SandboxTimeout:
            raise
        except Exception as e:
            raise SandboxError(f"worker died ({e!r}, exit code {worker.proc.poll()})") from None
        finally:
            self._release(worker, healthy)
        if status == "ok":
            return value
        raise value

    def close(self) -> None:
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._count -= len(idle)
            self._cond.notify_all()
        for w in idle:
            w.kill()


_default: Pool | None = None
_default_lock = threading.Lock()


def run(fn, *args, timeout: float, **kwargs):
    """fn(*args, **kwargs) in the shared default pool (2 workers); see Pool.run."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Pool()
    return _default.run(fn, *args, timeout=timeout, **kwargs)


def _serve() -> None:
    """Worker main loop (runs in the child)."""
    rx = Connection(os.dup(0), writable=False)
    tx = Connection(os.dup(1), readable=False)
    os.dup2(2, 1)  # prints go to stderr, not into the channel
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    parent, init, memory_mb = rx.recv()

    def watchdog():
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watchdog, daemon=True).start()
    try:
        import resource
    except ImportError:  # not POSIX: no rlimit backstops
        resource = None
    if init is not None:
        init()
    if resource is not None and memory_mb:
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, resource.getrlimit(resource.RLIMIT_AS)[1]))
    tx.send("ready")
    while True:
        try:
            fn, args, kwargs, timeout = rx.recv()
        except (EOFError, OSError):
            return
        if resource is not None:
            used = resource.getrusage(resource.RUSAGE_SELF)
            soft = int(used.ru_utime + used.ru_stime + timeout) + 3
            hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
            if hard == resource.RLIM_INFINITY or soft <= hard:
                resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))
        try:
            reply = ("ok", fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - everything goes back to the caller
            reply = ("raise", e)
        try:
            tx.send(reply)
        except Exception as e:  # unpicklable result or exception
            tx.send(("raise", SandboxError(f"unpicklable reply: {e!r}")))
        if isinstance(reply[1], MemoryError):
            return
