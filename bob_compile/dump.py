"""What the backend did to each graph, for people: dump folders, logs, trace artifacts.

Per compiled graph, with options={"dump_dir": PATH} or BOB_COMPILE_DUMP_DIR=PATH:

    PATH/<compile id>/graph_before.py   the Dynamo graph as captured (print_readable)
    PATH/<compile id>/graph_after.py    after the rewrite
    PATH/<compile id>/graph.diff        unified diff of the two
    PATH/<compile id>/report.txt        one line per attention site, the route and what
                                        was compiled (per order: its ops, the bytes its
                                        forward keeps for the backward, its compile time;
                                        written again as each order compiles)
    PATH/<compile id>/<order>.forward.py, <order>.backward.py
                                        on the "training" route, the AOTAutograd graphs
                                        (aten level, our ops in them) of each compiled
                                        order: first_order at compile time, second_order
                                        when a second-order step first
                                        needs them

<compile id> is Dynamo's ("0_0" for frame 0, first compile; "1_2" for frame 1, third).
The same texts go to the "bob_compile" logger (report at INFO, graphs and diff at DEBUG:
TORCH_LOGS="+bob_compile" shows everything) and to torch._logging.trace_structured
artifacts flashbob_report, flashbob_graph_before, flashbob_graph_after and
flashbob_graph_diff, and flashbob_<order>_forward / _backward (TORCH_TRACE=DIR, then
tlparse).
"""
import difflib
import itertools
import logging
import os
import re

from . import _compat

log = logging.getLogger("bob_compile.dump")

FILES = ("graph_before.py", "graph_after.py", "graph.diff", "report.txt")
_folders_written = set()     # folders this process wrote: a repeated compile id gets a suffix
_anonymous = itertools.count()


def graph_text(gm):
    return gm.print_readable(print_output=False)


def unified_diff(before, after):
    return "".join(difflib.unified_diff(before.splitlines(True), after.splitlines(True),
                                        "graph_before.py", "graph_after.py"))


def make_folder(report, dump_dir):
    """Create the dump folder of this graph (before it compiles: the compiled graphs of
    every order are written into it as they compile)."""
    report.dump_folder = _folder(dump_dir, report.compile_id)


def emit(report, before, after):
    """Log, trace and (where report has a dump folder) write the texts of one graph."""
    text, diff = report.text(), unified_diff(before, after)
    log.info("%s", text.rstrip())
    log.debug("flashbob graph %s, diff:\n%s", report.compile_id, diff or "(unchanged)\n")
    for name, payload in (("flashbob_report", text), ("flashbob_graph_before", before),
                          ("flashbob_graph_after", after), ("flashbob_graph_diff", diff)):
        _compat.trace_artifact(name, payload)
    if report.dump_folder:
        for name, payload in zip(FILES, (before, after, diff, text)):
            with open(os.path.join(report.dump_folder, name), "w") as f:
                f.write(payload)
        log.info("flashbob graph %s dumped to %s", report.compile_id, report.dump_folder)


def emit_compiled(report, what, pair):
    """Log, trace and (where report has a dump folder) write the two graphs of one
    compiled AOTAutograd pair of a training graph."""
    log.info("flashbob graph %s compiled %s", report.compile_id, report.compiled[-1])
    if report.dump_folder:      # the report again, with this order's line
        with open(os.path.join(report.dump_folder, "report.txt"), "w") as f:
            f.write(report.text())
    for half, graph in (("forward", pair.forward_graph), ("backward", pair.backward_graph)):
        text = graph.print_readable(print_output=False)
        _compat.trace_artifact(f"flashbob_{what}_{half}", text)
        if report.dump_folder:
            with open(os.path.join(report.dump_folder, f"{what}.{half}.py"), "w") as f:
                f.write(text)


def _folder(dump_dir, compile_id):
    name = re.sub(r"[^0-9A-Za-z.-]+", "_", compile_id).strip("_") if compile_id else \
        f"graph_{next(_anonymous)}"
    folder = os.path.join(dump_dir, name)
    for n in itertools.count(2):
        if folder not in _folders_written:
            break
        folder = os.path.join(dump_dir, f"{name}-{n}")
    _folders_written.add(folder)
    os.makedirs(folder, exist_ok=True)
    return folder
