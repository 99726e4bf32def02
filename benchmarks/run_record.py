"""What every result file records about its run: the command, the date, the commit.

docs/results.md (benchmarks/results_page.py) shows these beside each file's numbers.
"""
import datetime
import pathlib
import shlex
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent


def git_commit():
    """The checkout's commit, or None (a copied tree may carry no usable .git)."""
    try:
        done = subprocess.run(["git", "rev-parse", "--verify", "--quiet", "HEAD"], cwd=REPO,
                              capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    sha = done.stdout.strip()
    return sha if done.returncode == 0 and len(sha) == 40 else None


def run_record():
    """{command, date, git_commit} of this process's run."""
    script = pathlib.Path(sys.argv[0])
    try:
        script = script.resolve().relative_to(REPO)
    except ValueError:
        pass
    return dict(command=shlex.join(["python", str(script), *sys.argv[1:]]),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                git_commit=git_commit())
