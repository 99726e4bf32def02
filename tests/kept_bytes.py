"""What the compiled orders keep for their backwards, read from the reports' lines
("<order>: forward half N ops, backward half M ops, keeping B for the backward", checked
against autograd's packed tensors in tests/training/test_training_route.py)."""
import re

from bob_compile.backend import recent_reports

FIRST = "forward and backward"
SECOND = r"the VJP as a differentiable function \(second order\)"
UNITS = {"bytes": 1, "KiB": 2 ** 10, "MiB": 2 ** 20, "GiB": 2 ** 30}


def kept_bytes(order):
    """The bytes the compiled `order` (FIRST or SECOND) keeps for its backward, over every
    graph reported since recent_reports was last cleared; a region's code that N others
    run too ("region 1 (h.0) and N alike, ...") counts N + 1 times."""
    return sum((1 + int(alike or 0)) * float(number) * UNITS[unit]
               for report in recent_reports
               for alike, number, unit in re.findall(
                   rf"(?:and (\d+) alike, )?{order}: forward half \d+ ops, backward half "
                   r"\d+ ops, keeping ([\d.]+) (bytes|KiB|MiB|GiB)", report.text()))
