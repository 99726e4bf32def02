"""The flashbob backend: options, registration, routing, fallbacks, dumps, logs, counters,
recompilation. Numerics of the model × scenario matrix are in test_backend_scenarios.py."""
import collections
import os
import re
import subprocess
import sys
import textwrap
import warnings
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from expecttest import assert_expected_inline
from torch.func import grad
from torch.nn.attention import SDPBackend, sdpa_kernel

import bob_compile.backend as backend
import bob_compile
from bob_compile import ops, options
from bob_compile.kernels.reference import sdpa_math
from bob_compile.backend import flashbob, recent_reports
from bob_compile.passes import counters
from attention_patterns import PATTERNS
from models import CASES, NanoGPTBlock, exact_twin, loss_of

FAST = {"compiler": "aot_eager", "fallback": False}


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def nanogpt_inputs(seq=8):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, seq, 4, generator=g, dtype=torch.float64) for _ in range(3))
    return q, k, v, torch.tril(torch.ones(16, 16, dtype=torch.float64)).view(1, 1, 16, 16)


def hvp(model, x):
    params = list(model.parameters())
    grads = torch.autograd.grad(loss_of(model(x)), params, create_graph=True)
    return torch.autograd.grad(grads, params, grad_outputs=[torch.ones_like(p) for p in params])


def max_error(actual, expected):
    return max((a - e).abs().max().item() for a, e in zip(actual, expected, strict=True))


# ---------------------------------------------------------------------------- options
def test_unknown_option_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['dumpdir'\]; valid options are "
                                         r"\['dump_dir', 'compiler', 'fallback', 'regions', 'kernels', "):
        options.parse({"dumpdir": "/tmp"})
    with pytest.raises(Exception, match="unknown option"):  # through torch.compile too
        torch.compile(lambda x: x + 1, backend="flashbob", options={"dumpdir": "/tmp"})(torch.ones(2))


@pytest.mark.parametrize("bad,error", [
    ({"compiler": "tvm"}, "expected one of \\['inductor', 'aot_eager', 'eager'\\]"),
    ({"fallback": "yes"}, "must be True or False"),
    ({"dump_dir": 3}, "must be a path"),
])
def test_bad_option_values(bad, error):
    with pytest.raises((ValueError, TypeError), match=error):
        options.parse(bad)


def test_mode_is_checked_and_passed_to_inductor():
    assert dict(options.parse(mode="max-autotune-no-cudagraphs").inductor_config)["max_autotune"]
    with pytest.raises(ValueError, match="unknown mode='fastest'.*'max-autotune'"):
        options.parse(mode="fastest")


def test_dump_dir_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("BOB_COMPILE_DUMP_DIR", str(tmp_path))
    assert options.parse().dump_dir == str(tmp_path)
    assert options.parse({"dump_dir": "elsewhere"}).dump_dir == "elsewhere"


# ---------------------------------------------------------------------------- registration
# A fresh interpreter, as a user's program starts: the backend resolves by name alone.
_ENTRY_POINT_SCRIPT = textwrap.dedent("""
    import torch, bob_compile
    from torch._dynamo.backends import registry
    assert "flashbob" not in registry._COMPILER_FNS, "importing bob_compile registered it"
    import bob_compile.backend
    bob_compile.backend.register()          # a no-op: the entry point provides the name
    bob_compile.backend.register()
    f = torch.compile(lambda q: torch.nn.functional.scaled_dot_product_attention(q, q, q),
                      backend="flashbob", options={"compiler": "eager", "fallback": False})
    f(torch.randn(1, 1, 4, 2))
    assert len(bob_compile.backend.recent_reports[-1].replaced) == 1
    print("ok")
""")
@pytest.mark.spawns
def test_entry_point_registration_in_a_fresh_process():
    result = subprocess.run([sys.executable, "-c", _ENTRY_POINT_SCRIPT], capture_output=True,
                            text=True, timeout=300)
    assert result.stdout.strip().endswith("ok"), result.stderr[-3000:]


# ---------------------------------------------------------------------------- routing
def test_routes():
    model = NanoGPTBlock().double()
    x = torch.randn(2, 8, 16, dtype=torch.float64)
    compiled = torch.compile(model, backend=flashbob, options=FAST)
    compiled(x)
    with torch.no_grad():
        compiled(x)
    torch._dynamo.reset()
    torch.compile(model, backend=flashbob, options={"compiler": "eager"})(x)
    assert [r.route for r in recent_reports] == ["training", "inference", "eager"]
    assert "may be differentiated twice" in recent_reports[0].route_reason
    assert "grad mode is off" in recent_reports[1].route_reason


def test_inductor_inference_and_in_graph_grad_of_grad():
    model = CASES["nanogpt"].model()
    x, = CASES["nanogpt"].batch(0)
    with torch.no_grad():
        out = torch.compile(model, backend=flashbob, options={"fallback": False})(x)
        torch.testing.assert_close(out, model(x), atol=1e-9, rtol=0)
    torch._dynamo.reset()

    def loss(q):
        return (F.softmax((q @ q.transpose(-2, -1)) * 0.5, dim=-1) @ q).square().sum()

    def grad_of_grad(q):
        return grad(lambda q: grad(loss)(q).square().sum())(q)
    q = torch.randn(1, 2, 8, 4, dtype=torch.float64)
    out = torch.compile(grad_of_grad, backend=flashbob, options={"fallback": False})(q)
    torch.testing.assert_close(out, grad_of_grad(q), atol=1e-9, rtol=0)
    assert [(r.route, len(r.replaced)) for r in recent_reports] == [("inference", 1), ("aot", 1)]
    assert all("inductor" in r.route_reason for r in recent_reports)


def _count_op_calls(monkeypatch):
    """How often the fused ops' implementations run (through the op or the eager fast path)."""
    calls = collections.Counter()
    for name in ("call_forward", "call_forward_output", "call_backward"):
        real = getattr(ops, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)
        monkeypatch.setattr(ops, name, counted)
    return calls


@pytest.mark.parametrize("case", ["sdpa", "hf_eager", "checkpointed_sdpa"])
def test_inference_graphs_run_native_sdpa(case, monkeypatch):
    """Nothing differentiates an inference graph: its attention, SDPA or hand-written,
    runs PyTorch's fused SDPA (as stock compile does), the same function."""
    counters.clear()
    calls = _count_op_calls(monkeypatch)
    model = CASES[case].model()
    x, = CASES[case].batch(0)
    with torch.no_grad():
        out = torch.compile(model, backend=flashbob, options={"fallback": False})(x)
        expected = exact_twin(model)(x)
    torch.testing.assert_close(out, expected, atol=1e-9, rtol=0)
    report = recent_reports[-1]
    assert report.route == "inference" and len(report.replaced) == 1
    assert "run PyTorch's fused kernels" in report.route_reason
    assert counters["inference_native_sdpa"] == 1 and not calls


@pytest.mark.parametrize("kind", ["bool", "additive", "bool_and_causal"])
def test_inference_graphs_with_masks(kind, monkeypatch):
    """A boolean mask alone runs SDPA (the same function); an additive mask, or a mask
    with is_causal (SDPA takes one of them), keeps our op."""
    counters.clear()
    calls = _count_op_calls(monkeypatch)
    q, k, v = (torch.randn(2, 2, 5, 4, dtype=torch.float64) for _ in range(3))
    visible = torch.rand(2, 1, 5, 5, generator=torch.Generator().manual_seed(0)) > 0.3
    mask = visible if kind != "additive" else torch.zeros(2, 1, 5, 5, dtype=torch.float64
                                                          ).masked_fill(~visible, -torch.inf)
    causal = kind == "bool_and_causal"

    def f(q, k, v, mask):
        return bob_compile.attention(q, k, v, attn_mask=mask, is_causal=causal)
    with torch.no_grad():
        out = torch.compile(f, backend=flashbob, options={"fallback": False})(q, k, v, mask)
    expected_mask = visible & torch.ones(5, 5, dtype=torch.bool).tril() if causal else visible
    torch.testing.assert_close(out, sdpa_math(q, k, v, attn_mask=expected_mask), atol=1e-12, rtol=0)
    native = kind == "bool"
    assert counters["inference_native_sdpa"] == int(native) and bool(calls) is not native


def test_inference_graphs_keep_our_kernels_when_options_choose_them(monkeypatch):
    counters.clear()
    calls = _count_op_calls(monkeypatch)
    model = CASES["sdpa"].model()
    x, = CASES["sdpa"].batch(0)
    with torch.no_grad():
        compiled = torch.compile(model, backend=flashbob,
                                 options={"fallback": False, "kernels": "blockwise"})
        torch.testing.assert_close(compiled(x), model(x), atol=1e-9, rtol=0)
    assert counters["inference_native_sdpa"] == 0 and calls["call_forward"] == 1


def test_training_graphs_keep_the_op(monkeypatch):
    """Must not swap: a graph whose outputs may be differentiated (twice)."""
    counters.clear()
    calls = _count_op_calls(monkeypatch)
    model = CASES["sdpa"].model()
    x, = CASES["sdpa"].batch(0)
    torch.compile(model, backend=flashbob, options=FAST)(x)
    assert recent_reports[-1].route == "training"
    assert counters["inference_native_sdpa"] == 0 and calls["call_forward"] == 1


# ---------------------------------------------------------------------------- fallbacks
def test_backend_failure_warns_and_runs_the_untouched_graph():
    counters.clear()
    model = CASES["nanogpt"].model()
    x, = CASES["nanogpt"].batch(0)
    with mock.patch.object(backend, "_compile", side_effect=RuntimeError("boom")):
        with pytest.warns(UserWarning, match=r"flashbob could not compile graph 0/0 \(RuntimeError: boom\)"):
            out = torch.compile(model, backend=flashbob, options={"compiler": "aot_eager"})(x)
        torch.testing.assert_close(out, model(x), atol=0, rtol=0)
        assert recent_reports[-1].route == "untouched" and counters["fallback"] == 1
        torch._dynamo.reset()
        with pytest.raises(Exception, match="boom"):
            torch.compile(model, backend=flashbob, options=FAST)(x)


def test_backend_failure_warning_keeps_the_first_line_of_a_long_error():
    # inductor's errors carry whole IR dumps; the report keeps all of it
    model = CASES["nanogpt"].model()
    x, = CASES["nanogpt"].batch(0)
    error = RuntimeError("lowering failed\n" + "IR " * 5000)
    with mock.patch.object(backend, "_compile", side_effect=error):
        with pytest.warns(UserWarning) as caught:
            torch.compile(model, backend=flashbob, options={"compiler": "aot_eager"})(x)
    message = str(caught[0].message)
    assert "(RuntimeError: lowering failed ...)" in message and len(message) < 600
    assert recent_reports[-1].error == f"RuntimeError: {error}"


def test_restart_of_the_compile_is_not_a_failure():
    # Dynamo's own control flow (AOTAutograd asks it to trace again): raised through, the
    # attempt's counts taken back, no fallback
    model = CASES["sdpa"].model()
    x, = CASES["sdpa"].batch(0)
    real_compile, attempts = backend._compile, []

    def restart_once(*args, **kwargs):
        attempts.append(1)
        if len(attempts) == 1:
            raise torch._dynamo.exc.TensorifyScalarRestartAnalysis()
        return real_compile(*args, **kwargs)
    with mock.patch.object(backend, "_compile", side_effect=restart_once):
        out = torch.compile(model, backend=flashbob, options={"compiler": "aot_eager"})(x)
    torch.testing.assert_close(out, model(x))
    assert len(attempts) == 2 and counters["fallback"] == 0
    assert counters["graphs"] == 1 and counters["sdpa_replaced"] == 1


def test_changed_causal_buffer_runs_the_untouched_graph():
    model = CASES["nanogpt"].model()
    x, = CASES["nanogpt"].batch(0)
    compiled = torch.compile(model, backend=flashbob, options=FAST)
    with mock.patch.object(ops, "call_forward", wraps=ops.call_forward) as op:
        torch.testing.assert_close(compiled(x), model(x), atol=1e-12, rtol=0)
        assert op.call_count == 1
        bias = model.attn.bias
        bias.fill_(1.0)  # no longer causal: bidirectional attention
        with pytest.warns(UserWarning, match="no longer holds the causal mask"):
            out = compiled(x)
        torch.testing.assert_close(out, model(x), atol=1e-12, rtol=0)
        assert op.call_count == 1, "the changed mask must not reach the causal op"
        bias.copy_(torch.tril(torch.ones_like(bias)))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            torch.testing.assert_close(compiled(x), model(x), atol=1e-12, rtol=0)
        assert op.call_count == 2
    assert len(recent_reports) == 1, "buffer contents must not cause recompiles"


def _fill_data(bias):
    bias.data.fill_(1.0)


def _set_item_of_data(bias):
    bias.data[0, 0, 2, 5] = 1.0


def _assign_data(bias):
    bias.data = torch.ones_like(bias)


@pytest.mark.parametrize("change", [_fill_data, _set_item_of_data, _assign_data],
                         ids=lambda f: f.__name__.strip("_"))
def test_causal_buffer_changed_behind_autograd_is_noticed(change):
    """Writes through .data bump no version counter and change no tensor identity: the
    guard compares contents, so a changed mask is never served the causal op."""
    model = CASES["nanogpt"].model()
    x, = CASES["nanogpt"].batch(0)
    compiled = torch.compile(model, backend=flashbob, options=FAST)
    assert max_error(hvp(compiled, x), hvp(model, x)) <= 1e-9
    bias = model.attn.bias
    version = bias._version
    change(bias)
    assert bias._version == version
    with pytest.warns(UserWarning, match="no longer holds the causal mask"):
        assert max_error(hvp(compiled, x), hvp(model, x)) <= 1e-9


# ---------------------------------------------------------------------------- recompilation
def test_recompilation_counts():
    model = CASES["nanogpt"].model()
    x, = CASES["nanogpt"].batch(0)
    compiled = torch.compile(model, backend=flashbob, options=FAST)
    for _ in range(3):
        hvp(compiled, x)
    assert len(recent_reports) == 1


def test_dynamic_shapes_one_graph_exact_hvp():
    model = CASES["nanogpt"].model()
    compiled = torch.compile(model, backend=flashbob, dynamic=True, options=FAST)
    for seq in (6, 8, 11):
        x, = CASES["nanogpt"].batch(seq, seq)
        with sdpa_kernel(SDPBackend.MATH):
            assert max_error(hvp(compiled, x), hvp(model, x)) <= 1e-9
    (report,) = recent_reports
    assert len(report.replaced) == 1 and re.search(r"q\[s\d+, 2, s\d+, 8\]", report.replaced[0].shapes)


# ---------------------------------------------------------------------------- dumps, logs, counters
def normalize(text):
    """Dump text without paths and line numbers, so goldens hold across checkouts; and in
    torch 2.13's spelling of `x == 0` (2.11 prints the node as x.__eq__(0))."""
    text = re.sub(r"# File: \S+:\d+ in (\w+), code:", r"# File: <file> in \1, code:", text)
    text = re.sub(r"\w+\.py:\d+:", "<file>:", text)
    text = re.sub(r"(\w+)\.__eq__\(([^()]*)\)", r"\1 == \2", text)
    return re.sub(r"@@ -\d+,\d+ \+\d+,\d+ @@", "@@ ... @@", text)


def test_dump_files(tmp_path):
    q, k, v, bias = nanogpt_inputs()
    compiled = torch.compile(PATTERNS["nanogpt"][0], backend=flashbob,
                             options={"dump_dir": str(tmp_path), "compiler": "eager"})
    compiled(q, k, v, bias)
    compiled(q[:, :, :4], k[:, :, :4], v[:, :, :4], bias)  # a recompile: a second folder
    assert sorted(os.listdir(tmp_path)) == ["0_0", "0_1"]
    folder = tmp_path / "0_0"
    assert sorted(os.listdir(folder)) == ["graph.diff", "graph_after.py", "graph_before.py", "report.txt"]
    assert "softmax" in (folder / "graph_before.py").read_text()
    assert "bob_compile_attention_attention" in (folder / "graph_after.py").read_text()
    assert_expected_inline(normalize((folder / "report.txt").read_text()), """\
flashbob graph 0/0: 1 attention site(s) replaced, 0 skipped
  replaced handwritten at att_2 (<file>: att = F.softmax(att, dim=-1)): q[2, 2, 8, 4] k[2, 2, 8, 4] v[2, 2, 8, 4] scale=0.5 causal=True (mask from l_bias_, checked at run time)
  run-time check: CausalTensorGuard(l_bias_: lower-triangular 1.0/0.0)
  route: eager (options['compiler'] is 'eager')
""")
    assert_expected_inline(normalize((folder / "graph.diff").read_text()), """\
--- graph_before.py
+++ graph_after.py
@@ ... @@
         l_bias_ = L_bias_
         l_v_ = L_v_
 
-        # File: <file> in nanogpt, code: att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
-        transpose: "f64[2, 2, 4, 8]" = l_k_.transpose(-2, -1);  l_k_ = None
-        matmul: "f64[2, 2, 8, 8]" = l_q_ @ transpose;  l_q_ = transpose = None
-        att: "f64[2, 2, 8, 8]" = matmul * 0.5;  matmul = None
-
-        # File: <file> in nanogpt, code: att = att.masked_fill(bias[:, :, :T, :T] == 0, float("-inf"))
-        getitem: "f64[1, 1, 8, 8]" = l_bias_[(slice(None, None, None), slice(None, None, None), slice(None, 8, None), slice(None, 8, None))];  l_bias_ = None
-        eq: "b8[1, 1, 8, 8]" = getitem == 0;  getitem = None
-        att_1: "f64[2, 2, 8, 8]" = att.masked_fill(eq, -inf);  att = eq = None
-
-        # File: <file> in nanogpt, code: att = F.softmax(att, dim=-1)
-        att_2: "f64[2, 2, 8, 8]" = torch.nn.functional.softmax(att_1, dim = -1);  att_1 = None
-
-        # File: <file> in nanogpt, code: att = F.dropout(att, p=0.0, training=True)  # self.attn_dropout with dropout=0.0
-        att_3: "f64[2, 2, 8, 8]" = torch.nn.functional.dropout(att_2, p = 0.0, training = True);  att_2 = None
-
         # File: <file> in nanogpt, code: return att @ v
-        matmul_1: "f64[2, 2, 8, 4]" = att_3 @ l_v_;  att_3 = l_v_ = None
+        matmul_1: "f64[2, 2, 8, 4]" = bob_compile_attention_attention(l_q_, l_k_, l_v_, is_causal = True, scale = 0.5, enable_gqa = False);  l_q_ = l_k_ = l_v_ = None
         return (matmul_1,)
""")


def test_dump_of_skipped_site_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("BOB_COMPILE_DUMP_DIR", str(tmp_path))

    def returns_probabilities(q, k, v):
        p = F.softmax(q @ k.transpose(-2, -1), dim=-1)
        return p @ v, p
    q, k, v, _ = nanogpt_inputs()
    torch.compile(returns_probabilities, backend=flashbob, options={"compiler": "eager"})(q, k, v)
    report = normalize((tmp_path / "0_0" / "report.txt").read_text())
    # The line is the one Dynamo's stack trace names for the softmax node: its own line, or,
    # in some runs of the whole suite, the return that uses p (Dynamo's attribution, not ours)
    report = re.sub(r"\(<file>: (p = F\.softmax\(.*\)|return p @ v, p)\)", "(<file>: <line>)", report)
    assert_expected_inline(report, """\
flashbob graph 0/0: 0 attention site(s) replaced, 1 skipped
  skipped  handwritten at p (<file>: <line>): the attention probabilities p are used 2 times (matmul_1, output), not only by the attention
  route: eager (options['compiler'] is 'eager')
""")
    assert (tmp_path / "0_0" / "graph.diff").read_text() == ""


def test_logs_and_trace_artifacts(caplog):
    artifacts = []

    def record(kind, metadata_fn=dict, *, payload_fn=lambda: None, **kwargs):
        if kind == "artifact" and metadata_fn()["name"].startswith("flashbob"):
            artifacts.append((metadata_fn()["name"], payload_fn()))

    q, k, v, bias = nanogpt_inputs()
    with caplog.at_level("DEBUG", logger="bob_compile"), \
            mock.patch("torch._logging.trace_structured", side_effect=record):
        torch.compile(PATTERNS["nanogpt"][0], backend=flashbob, options={"compiler": "eager"})(q, k, v, bias)
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("bob_compile")]
    assert any("1 attention site(s) replaced" in m for m in messages)
    assert any("+        matmul_1: " in m and "bob_compile_attention_attention" in m for m in messages), \
        "the diff goes to DEBUG"
    assert [name for name, _ in artifacts] == [
        "flashbob_report", "flashbob_graph_before", "flashbob_graph_after", "flashbob_graph_diff"]
    assert "replaced handwritten" in artifacts[0][1]


def test_counters(monkeypatch):
    from torch._dynamo.utils import counters as dynamo_counters
    from bob_compile.passes import sdpa
    monkeypatch.setattr(sdpa, "dropout_problem", lambda p, training: "stays (test)")
    counters.clear()
    dynamo_counters["flashbob"].clear()
    q, k, v, bias = nanogpt_inputs()

    def two_sites(q, k, v, bias):
        return (PATTERNS["nanogpt"][0](q, k, v, bias),
                F.scaled_dot_product_attention(q, k, v, dropout_p=0.5))
    torch.compile(two_sites, backend=flashbob, options={"compiler": "eager"})(q, k, v, bias)
    expected = {"handwritten_replaced": 1, "sdpa_skipped": 1, "graphs": 1, "route_eager": 1}
    assert dict(counters) == expected
    assert dict(dynamo_counters["flashbob"]) == expected
