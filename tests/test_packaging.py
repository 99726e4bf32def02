"""The checkout's layout: everything importable lives under bob_compile/.

A folder at the repository root with Python modules is importable as a top-level package by
anything run from the root (python -m pytest, the examples, the benchmarks), and it shadows
the installed package of that name. `kernels/` did: transformers 5.25 imports Hugging Face's
`kernels` package, got ours, and every Hugging Face test failed at import.
"""
import configparser
import pathlib
import subprocess

ROOT = pathlib.Path(__file__).resolve().parent.parent
# folders of scripts run by path (their own folder goes on sys.path, not the root)
SCRIPT_FOLDERS = {"tests", "examples", "benchmarks"}


def _python_files():
    """The repository's Python files: those git tracks (a developer's untracked scratch
    folders are not the repository's), or every one where there is no git checkout."""
    try:
        listed = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True,
                                text=True, check=True).stdout.split()
        return [pathlib.PurePosixPath(f) for f in listed]
    except (OSError, subprocess.CalledProcessError):
        return [p.relative_to(ROOT) for p in ROOT.rglob("*.py")]


def test_no_top_level_package_but_bob_compile():
    importable = sorted({f.parts[0] for f in _python_files() if len(f.parts) > 1}
                        - SCRIPT_FOLDERS - {"bob_compile"})
    assert importable == [], (
        f"{importable} at the repository root would shadow installed packages of the same "
        "name for code run from the root; move them under bob_compile/")


def test_setup_cfg_lists_every_subpackage():
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    listed = set(config["options"]["packages"].split())
    found = {".".join(p.parent.relative_to(ROOT).parts)
             for p in (ROOT / "bob_compile").rglob("__init__.py")}
    assert listed == found
