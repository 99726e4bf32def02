"""Subprocesses that tests wait for, started when collection ends.

Some tests run a fresh interpreter (the examples, as a user runs them; the Triton interpreter
suite, which needs TRITON_INTERPRET=1 before Triton is imported; the two gloo ranks of
test_distributed.py). Run one after another, each keeps one core busy while the other
idles; started together beside the suite on a 2-core machine, `.ci/run`'s tests took 1,014 s
instead of 1,157 s. A test module lists such subprocesses in `EARLY_SUBPROCESSES` (test
function name -> Subprocess); conftest.py starts those of the selected tests as soon as
collection ends, so they run beside the rest of the suite, and runs the tests that wait for
them after all others (a wait in the middle of the suite left this process idle while the
subprocesses ran). Under pytest-xdist each subprocess starts when its test first asks for it
instead. test_beside_the_suite.py uses the same mechanism for whole test modules.
"""
import subprocess
import tempfile


class Subprocess:
    """A command run once, in the background from `start()` on; `result()` waits for it."""

    def __init__(self, command, *, env=None, cwd=None, timeout=600):
        self.command, self.env, self.cwd, self.timeout = command, env, cwd, timeout
        self.process = None

    def start(self):
        if self.process is None:
            # files, not pipes: nobody reads a pipe until the test runs, and a full pipe
            # would stall the subprocess
            self.stdout = tempfile.TemporaryFile(mode="w+")
            self.stderr = tempfile.TemporaryFile(mode="w+")
            command = self.command() if callable(self.command) else self.command
            self.process = subprocess.Popen(command, env=self.env, cwd=self.cwd, text=True,
                                            stdout=self.stdout, stderr=self.stderr)
        return self

    def result(self):
        """subprocess.CompletedProcess of the command (started now if it was not yet)."""
        self.start()
        try:
            self.process.wait(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise
        outputs = []
        for stream in (self.stdout, self.stderr):
            stream.seek(0)
            outputs.append(stream.read())
        return subprocess.CompletedProcess(self.process.args, self.process.returncode, *outputs)

    def stop(self):
        """Kill it if it still runs (a test deselected or failed before waiting)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def start_selected(items):
    """Start the early subprocesses of the selected tests; return them all (to stop later)."""
    started = []
    for item in items:
        wanted = getattr(item.module, "EARLY_SUBPROCESSES", {}).get(item.originalname)
        if wanted is not None and wanted.process is None:
            started.append(wanted.start())
    return started
