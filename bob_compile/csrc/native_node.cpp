// The attention op's first order, where PyTorch's fused kernels compute it, as a C++
// autograd node (docs/host-overhead.md).
//
// A Python autograd.Function costs ~25-50 us of host time per call beyond the kernels it
// launches (its apply, and a backward run under the GIL on the engine's device thread): at
// short lengths that is what the GPU waits for. This node calls the same fused kernels as
// the op's Python path (kernels/triton_attention.py: _native_forward, _native_backward)
// with the same layouts, and leaves everything else to Python:
//
//   forward    PyTorch's fused forward (cuDNN or FA2; CPU flash for the tests), returning
//              o in q's dimension order and lse as a contiguous (B, H, L) float32 row vector
//              (forward_output: o alone, for calls nothing differentiates);
//   backward   without create_graph, for a plain dO and no lse cotangent: the fused
//              backward, with no Python and no GIL; anything else (create_graph, i.e. a
//              second order, an lse cotangent, a tensor subclass or a dispatch mode,
//              deterministic algorithms, or the fused kernel refusing) calls the Python
//              function set by set_general_backward, the op's own differentiable path.
#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <numeric>

namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Which fused kernels run (the Python side passes these numbers: bob_compile/native_node.py)
enum Kernels : int64_t { kCudnn = 0, kFlash = 1, kCpuFlash = 2 };

// ---------------------------------------------------------------------------- layouts
// Outputs are dense, in the dimension order of the input they are shaped like
// (kernels/layout.py): a stable sort of like's strides, 0-strided dimensions outermost.
std::vector<int64_t> inner_to_outer(at::IntArrayRef strides) {
  std::vector<int64_t> order(strides.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    bool a0 = strides[a] == 0, b0 = strides[b] == 0;
    return a0 != b0 ? b0 : strides[a] < strides[b];
  });
  return order;
}

Tensor in_order_of(const Tensor& t, const Tensor& like) {
  auto order = inner_to_outer(like.strides());
  auto sizes = t.sizes();
  auto strides = t.strides();
  int64_t step = 1;
  bool laid_out = true;
  for (auto d : order) {
    // a size-1 dimension's stride never addresses memory
    if (sizes[d] != 1 && strides[d] != step) {
      laid_out = false;
      break;
    }
    step *= sizes[d];
  }
  if (laid_out) return t;
  std::vector<int64_t> outer_to_inner(order.rbegin(), order.rend());
  std::vector<int64_t> back(order.size());
  for (size_t i = 0; i < outer_to_inner.size(); ++i) back[outer_to_inner[i]] = i;
  return t.permute(outer_to_inner).contiguous().permute(back);
}

// ---------------------------------------------------------------------------- fused kernels
// o, and with_lse the lse; without it (a call nothing differentiates) cuDNN neither computes
// nor writes the lse (what native SDPA runs without grad) and the lse returned is undefined;
// FA2's and the CPU kernel's forwards always compute one
std::tuple<Tensor, Tensor> fused_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                         double scale, bool causal, int64_t kernels,
                                         bool with_lse) {
  Tensor o, lse;
  if (kernels == kCudnn) {
    auto out = at::_scaled_dot_product_cudnn_attention(q, k, v, std::nullopt, with_lse, 0.0,
                                                       causal, false, scale);
    o = std::get<0>(out);
    lse = std::get<1>(out);
  } else if (kernels == kFlash) {
    auto out = at::_scaled_dot_product_flash_attention(q, k, v, 0.0, causal, false, scale);
    o = std::get<0>(out);
    lse = std::get<1>(out);
  } else {
    auto out = at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, {}, scale);
    o = std::get<0>(out);
    lse = std::get<1>(out);
  }
  if (!with_lse) return {in_order_of(o, q), Tensor()};
  // cuDNN's lse is (B, H, L, 1); all are float32 (the CPU kernel's: its accumulation type)
  return {in_order_of(o, q), lse.reshape(q.sizes().slice(0, 3)).contiguous()};
}

// o alone, for a call nothing differentiates
Tensor forward_output(const Tensor& q, const Tensor& k, const Tensor& v, double scale,
                      bool causal, int64_t kernels) {
  RECORD_FUNCTION("bob_compile::attn_fwd", std::vector<c10::IValue>());
  return std::get<0>(fused_forward(q, k, v, scale, causal, kernels, false));
}

std::tuple<Tensor, Tensor, Tensor> fused_backward(const Tensor& dout, const Tensor& q,
                                                  const Tensor& k, const Tensor& v,
                                                  const Tensor& o, const Tensor& lse,
                                                  double scale, bool causal, int64_t kernels) {
  // the fused backwards read dO in o's layout; with dropout 0 the RNG seed and offset are
  // never read, and undefined cumulative lengths mean "not varlen"
  Tensor d = in_order_of(dout, o);
  int64_t L = q.size(2), S = k.size(2);
  std::tuple<Tensor, Tensor, Tensor> g;
  if (kernels == kCudnn) {
    Tensor seed = at::empty({0}, q.options().dtype(at::kLong));
    g = at::_scaled_dot_product_cudnn_attention_backward(
        d, q, k, v, o, lse.unsqueeze(-1), seed, seed, Tensor(), Tensor(), Tensor(), L, S, 0.0,
        causal, scale);
  } else if (kernels == kFlash) {
    Tensor seed = at::empty({0}, q.options().dtype(at::kLong));
    g = at::_scaled_dot_product_flash_attention_backward(d, q, k, v, o, lse, Tensor(), Tensor(),
                                                         L, S, 0.0, causal, seed, seed, scale);
  } else {
    g = at::_scaled_dot_product_flash_attention_for_cpu_backward(d, q, k, v, o, lse, 0.0, causal,
                                                                 {}, scale);
  }
  return {in_order_of(std::get<0>(g), q), in_order_of(std::get<1>(g), k),
          in_order_of(std::get<2>(g), v)};
}

// The Python function of every backward this node does not run itself (never freed: it may
// be called from the autograd engine's threads until the interpreter exits).
py::object* general_backward = nullptr;

bool deterministic() {
  auto& context = at::globalContext();
  return context.deterministicAlgorithms() && !context.deterministicAlgorithmsWarnOnly();
}

// Whether dO can go to the fused backward as it is: a dense tensor like o (not a tensor
// subclass, functorch wrapper or batched tensor, whose dispatch keys differ), and no
// dispatch mode that should see the ops
bool plain_like(const Tensor& dout, const Tensor& o) {
  return dout.key_set() == o.key_set() && c10::impl::TorchDispatchModeTLS::stack_len() == 0;
}

py::object none_or(const Tensor& t) {
  return t.defined() ? py::cast(t) : py::none();
}

// ---------------------------------------------------------------------------- the node
struct NativeAttention : public torch::autograd::Function<NativeAttention> {
  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k,
                               const Tensor& v, double scale, bool causal, int64_t kernels) {
    RECORD_FUNCTION("bob_compile::attn_fwd", std::vector<c10::IValue>());
    auto [o, lse] = fused_forward(q, k, v, scale, causal, kernels, true);
    ctx->save_for_backward({q, k, v, o, lse});
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["kernels"] = kernels;
    ctx->set_materialize_grads(false);      // dlse stays undefined in ordinary training
    return {o, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Tensor& dout = grads[0];
    const Tensor& dlse = grads[1];
    if (!dout.defined() && !dlse.defined()) return {Tensor(), Tensor(), Tensor(), Tensor(),
                                                    Tensor(), Tensor()};
    auto saved = ctx->get_saved_variables();
    const Tensor &q = saved[0], &k = saved[1], &v = saved[2], &o = saved[3], &lse = saved[4];
    double scale = ctx->saved_data["scale"].toDouble();
    bool causal = ctx->saved_data["causal"].toBool();
    int64_t kernels = ctx->saved_data["kernels"].toInt();
    std::string refused;
    if (dout.defined() && !dlse.defined() && !c10::GradMode::is_enabled() && !deterministic() &&
        plain_like(dout, o)) {
      try {
        RECORD_FUNCTION("bob_compile::attn_bwd", std::vector<c10::IValue>());
        auto [dq, dk, dv] = fused_backward(dout, q, k, v, o, lse, scale, causal, kernels);
        return {dq, dk, dv, Tensor(), Tensor(), Tensor()};
      } catch (const c10::OutOfMemoryError&) {
        throw;      // not a refusal: the general path would run out of memory too
      } catch (const c10::Error& e) {
        refused = e.what_without_backtrace();
      }
    }
    TORCH_CHECK(general_backward != nullptr, "bob_compile native node: no general backward set");
    py::gil_scoped_acquire gil;
    try {
      py::tuple got = (*general_backward)(q, k, v, o, lse, none_or(dout), none_or(dlse), scale,
                                          causal, kernels,
                                          refused.empty() ? py::object(py::none())
                                                          : py::object(py::str(refused)));
      variable_list result(6);
      for (size_t i = 0; i < 3; ++i) {
        if (!got[i].is_none()) result[i] = got[i].cast<Tensor>();
      }
      return result;
    } catch (py::error_already_set& e) {
      // rethrown as what the engine carries across threads with its Python type
      e.restore();
      python_error error;
      error.persist();
      throw error;
    }
  }
};

// (o, lse) of the attention op through the node (or without one where no input requires
// grad or grad mode is off: Function::apply decides).
std::tuple<Tensor, Tensor> attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                     double scale, bool causal, int64_t kernels) {
  auto out = NativeAttention::apply(q, k, v, scale, causal, kernels);
  return {out[0], out[1]};
}

void set_general_backward(py::object fn) {
  delete general_backward;
  general_backward = new py::object(std::move(fn));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attention", &attention, "(o, lse) through the C++ autograd node");
  m.def("forward_output", &forward_output, "o of a call nothing differentiates");
  m.def("set_general_backward", &set_general_backward,
        "the Python function of the backwards the node does not run itself");
  m.attr("CUDNN") = static_cast<int64_t>(kCudnn);
  m.attr("FLASH") = static_cast<int64_t>(kFlash);
  m.attr("CPU_FLASH") = static_cast<int64_t>(kCpuFlash);
}
