"""Run a function in a killable worker process, under a limit of the worker's own CPU time.

`Pool(size)` keeps up to `size` persistent workers, started lazily. Each worker is a fresh interpreter
started with `subprocess.Popen([sys.executable, "-c", ...])`: nothing of the caller is forked (it may hold
torch/CUDA threads and locks), and unlike multiprocessing's spawn/forkserver the caller's `__main__` script
is not re-imported in the worker (a training script would drag torch into every worker). The parent's
`sys.path` is passed on through PYTHONPATH. Calls `(fn, args, kwargs)` go pickled (functions by reference,
so `fn` must be importable) over the worker's stdin, results come back over its stdout, framed by
`multiprocessing.connection.Connection`; the worker points its own fd 1 at stderr, so stray prints cannot
corrupt the channel.

Limits of one call (`run(fn, ..., timeout=, cpu_time=)`):
  - `cpu_time`: seconds of CPU time the worker may spend on this call, counted by the kernel for the worker
    alone (ITIMER_PROF, armed when the call arrives): how busy the machine is, or what other calls do, does not
    change when it runs out. Past it the kernel ends the worker (SIGPROF's default action, so in C code and
    in sympy too) and the caller gets SandboxTimeout. RLIMIT_CPU a few seconds later is a second backstop.
  - `timeout`: wall-clock seconds from sending the call to its reply, a backstop against a worker that hangs
    without computing (it is then SIGKILLed: SandboxTimeout). Give it generously where `cpu_time` is the rule.
Waiting for a free worker, or for one to start (interpreter, imports and `init`: bounded by START_TIMEOUT),
counts against neither. A worker that was killed or died (segfault, OOM kill: EOF -> SandboxError) is
replaced at once in the background; an exception raised by `fn` is re-raised in the caller. The caller waits
with `Connection.poll`: no signals in the caller, so any thread may call. `warm()` starts workers ahead of time.

Other backstops inside the worker: an address-space limit (`memory_mb`, MemoryError instead of swapping the
host), and a watchdog thread that exits when the parent dies. After each reply the worker collects garbage
(outside any call's CPU time). Workers are killed at interpreter exit.
"""
from __future__ import annotations

import atexit
import gc
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection

START_TIMEOUT = 300.0  # wall seconds for a new worker to import and report ready (generous: a loaded host)
# exit codes of a worker ended by its CPU limit (ITIMER_PROF, or the RLIMIT_CPU backstop)
_CPU_SIGNALS = {-getattr(signal, name) for name in ("SIGPROF", "SIGXCPU") if hasattr(signal, name)}
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

    def _acquire(self, deadline: float) -> _Worker:
        with self._cond:
            while not self._idle and self._count >= self.size:
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    raise SandboxTimeout("no worker became free in time")
                self._cond.wait(left)
            if self._idle:
                return self._idle.pop()
            self._count += 1
        try:
            return _Worker(self.init, self.memory_mb)
        except BaseException:
            self._release(None, False)
            raise

    def _release(self, worker: _Worker | None, healthy: bool) -> None:
        with self._cond:
            keep = healthy and not self._closed
            replace = worker is not None and not keep and not self._closed  # its slot goes to the replacement,
            if keep:  # so that no caller starts one of its own meanwhile
                self._idle.append(worker)
            elif not replace:
                self._count -= 1
            self._cond.notify()
        if worker is not None and not keep:
            worker.kill()
        if replace:
            threading.Thread(target=self._replace, name="sandbox-replace", daemon=True).start()

    def _replace(self) -> None:
        """Start a worker in the background for one that was killed or died (callers may wait for it)."""
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
        started = [self._acquire(time.monotonic() + START_TIMEOUT) for _ in range(min(n or self.size, self.size))]
        for w in started:
            self._release(w, True)

    def run(self, fn, *args, timeout: float, cpu_time: float | None = None, **kwargs):
        """fn(*args, **kwargs) in a worker. Raises SandboxTimeout past `cpu_time` s of the worker's CPU time or
        `timeout` s of wall time after the call was sent (see the module docstring), SandboxError if it dies."""
        name = getattr(fn, "__name__", fn)
        data = pickle.dumps((fn, args, kwargs, cpu_time, timeout), protocol=pickle.HIGHEST_PROTOCOL)
        for attempt in (0, 1):  # an idle worker that died meanwhile (OOM killer...) gets one replacement
            # waiting for a worker is not the call's time: busy ones end by their own limits, starts by START_TIMEOUT
            worker = self._acquire(time.monotonic() + timeout + START_TIMEOUT)
            try:
                worker.tx.send_bytes(data)
                break
            except OSError:
                self._release(worker, False)
                if attempt:
                    raise SandboxError("worker died before the call") from None
        healthy = False
        try:
            if not worker.rx.poll(timeout):
                raise SandboxTimeout(f"{name} gave no reply within {timeout:g} s (wall clock): worker hung")
            status, value = worker.rx.recv()
            healthy = not isinstance(value, MemoryError)  # the worker exits after a MemoryError
        except SandboxTimeout:
            raise
        except Exception as e:
            try:
                code = worker.proc.wait(timeout=5)  # EOF: it is exiting; its exit code says why
            except subprocess.TimeoutExpired:
                code = None
            if code in _CPU_SIGNALS:
                raise SandboxTimeout(f"{name} exceeded {cpu_time or timeout:g} s of CPU time") from None
            raise SandboxError(f"worker died ({e!r}, exit code {code})") from None
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


def run(fn, *args, timeout: float, cpu_time: float | None = None, **kwargs):
    """fn(*args, **kwargs) in the shared default pool (2 workers); see Pool.run."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Pool()
    return _default.run(fn, *args, timeout=timeout, cpu_time=cpu_time, **kwargs)


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
    profiling = hasattr(signal, "setitimer") and hasattr(signal, "SIGPROF")
    if profiling:  # an ignored SIGPROF would be inherited over exec: the timer must end the process
        signal.signal(signal.SIGPROF, signal.SIG_DFL)
    if init is not None:
        init()
    if resource is not None and memory_mb:
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, resource.getrlimit(resource.RLIMIT_AS)[1]))
    try:
        tx.send("ready")
    except OSError:  # the parent closed the pool while this worker started (at its exit)
        return
    while True:
        try:
            fn, args, kwargs, cpu_time, timeout = rx.recv()
        except (EOFError, OSError):
            return
        if resource is not None:  # backstop: the kernel ends a worker that computes a few seconds past the limit
            used = resource.getrusage(resource.RUSAGE_SELF)
            soft = int(used.ru_utime + used.ru_stime + (cpu_time or timeout)) + 3
            hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
            if hard == resource.RLIM_INFINITY or soft <= hard:
                resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))
        if cpu_time is not None and profiling:  # this call's CPU time, whatever the load of the host
            signal.setitimer(signal.ITIMER_PROF, max(cpu_time, 1e-6))
        try:
            reply = ("ok", fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - everything goes back to the caller
            reply = ("raise", e)
        finally:
            if cpu_time is not None and profiling:
                signal.setitimer(signal.ITIMER_PROF, 0)
        try:
            tx.send(reply)
        except Exception as e:  # unpicklable result or exception
            tx.send(("raise", SandboxError(f"unpicklable reply: {e!r}")))
        if isinstance(reply[1], MemoryError):
            return
        del reply
        gc.collect()  # the garbage of this call is not the next call's CPU time
