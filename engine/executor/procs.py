"""Child processes (TP/PP workers, data-parallel replicas) that die with their parent and whose
deaths are noticed at once.

A child is a fresh `python -m engine.executor.procs` that reads what to run from its stdin.
Unlike multiprocessing's spawn it never re-imports the caller's main script, so
`LLM(tensor_parallel_size=2)` works in a script without an `if __name__ == "__main__"` guard.
The stdin pipe stays open as a lifeline: when the parent goes, however it went (SIGKILL
included), the child reads end-of-file and exits, so nothing outlives the engine that started
it. The parent waits on each child from a thread: a child that exits unexpectedly is recorded
at once (which one, which pid, what exit status), so the engine reports it even while idle, and
a collective that failed because of it names the culprit instead of a socket.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time

logger = logging.getLogger(__name__)

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class WorkerDiedError(RuntimeError):
    """A worker or replica process of the engine exited or stopped answering; the engine cannot go on."""


def describe_exit(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


class ChildProcesses:
    def __init__(self):
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self._failures: list[str] = []
        self._failed = threading.Event()
        self._closing = False

    def start(self, name: str, target, *args, pass_fds: tuple[int, ...] = ()) -> subprocess.Popen:
        """Run `target(*args)` (a module-level function; args picklable) in a new process, which
        inherits the file descriptors `pass_fds` under the same numbers."""
        path = os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH")) if p)
        # Detached from the terminal's process group (setsid): a Ctrl-C at the terminal reaches only us, and we
        # drain and stop the children in order, rather than every process dying mid-collective.
        proc = subprocess.Popen([sys.executable, "-m", "engine.executor.procs"], stdin=subprocess.PIPE,
                                env={**os.environ, "PYTHONPATH": path}, pass_fds=pass_fds, start_new_session=True)
        payload = pickle.dumps((name, target, args, logging.getLogger().getEffectiveLevel()))
        proc.stdin.write(len(payload).to_bytes(8, "little") + payload)
        proc.stdin.flush()
        self.procs.append((name, proc))
        threading.Thread(target=self._watch, args=(name, proc), name=f"watch-{name}", daemon=True).start()
        return proc

    def _watch(self, name: str, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if not self._closing:
            msg = f"{name} (pid {proc.pid}) {describe_exit(code)}"
            logger.error("%s", msg)
            self._failures.append(msg)
            self._failed.set()

    def failure(self, wait_s: float = 0.0) -> str | None:
        """What died, first death first; waits up to `wait_s` for one to be noticed."""
        self._failed.wait(wait_s)
        return "; ".join(self._failures) or None

    def check(self) -> None:
        failure = self.failure()
        if failure:
            raise WorkerDiedError(failure)

    def stop(self, timeout: float = 10.0) -> None:
        """Give the children up to `timeout` to leave on their own (they were told to), then cut
        their lifelines, then kill. Returns once every child has been reaped."""
        self._closing = True
        deadline = time.monotonic() + timeout
        for name, proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for name, proc in self.procs:
            if proc.poll() is None:
                logger.warning("%s (pid %d) did not stop in time; stopping it", name, proc.pid)
            proc.stdin.close()  # the child's watchdog exits on end-of-file
            try:
                proc.wait(2.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _read_exact(fd: int, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = os.read(fd, n - len(data))
        if not chunk:
            raise EOFError("the parent closed the pipe before sending what to run")
        data += chunk
    return data


def _child_main() -> None:
    # Raw reads of fd 0, not sys.stdin: a daemon thread blocked inside a buffered reader would
    # make the interpreter abort at exit.
    size = int.from_bytes(_read_exact(0, 8), "little")
    name, target, args, log_level = pickle.loads(_read_exact(0, size))
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s {name} %(name)s: %(message)s")

    def exit_with_parent():
        while os.read(0, 4096):  # returns b"" at end-of-file: the parent died or cut the lifeline
            pass
        os._exit(1)

    threading.Thread(target=exit_with_parent, name="pagewise-lifeline", daemon=True).start()
    try:
        target(*args)
    except BaseException:
        logging.getLogger(__name__).exception("%s failed", name)
        logging.shutdown()
        os._exit(1)  # not sys.exit: a half-torn-down process group must not block the exit


if __name__ == "__main__":
    _child_main()
