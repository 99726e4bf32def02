// The attention op's first order, where PyTorch's fused kernels compute it, as a C++
// autograd node (docs/host-overhead.md).
//
// A Python autograd.Function costs ~25-50 us of host time per call beyond the kernels it
// launches (its apply, and a backward run under the GIL on the engine's device thread): at
// short lengths that is what the GPU waits for. This node calls the same fused kernels as
// the op's Python path (bob_compile/kernels/native_sdpa.py: forward, backward)
// with the same layouts, and leaves everything else to Python:
//
//   forward    PyTorch's fused forward (cuDNN or FA2; CPU flash for the tests), returning
//              o in q's dimension order and lse as a contiguous (B, H, L) float32 row vector
//              (forward_output: o alone, for calls nothing differentiates);
//   backward   without create_graph, for a plain dO and no lse cotangent: the fused
//              backward, with no Python and no GIL; with create_graph where the second
//              order takes the folded form, the same fused backward as the forward of a
//              second C++ node (NativeAttentionBackward, below); anything else (an lse
//              cotangent, the chain form, a tensor subclass or a dispatch mode,
//              deterministic algorithms, or the fused kernel refusing) calls the Python
//              function set by set_general_backward, the op's own differentiable path.
//
// A call with a mask runs the same two nodes with the op's Triton kernels instead of the
// fused ones (kTriton).
//
// NativeAttentionBackward's backward is the folded backward-over-backward (the BoB), Triton
// kernels in either case. Every Triton stage (a masked call's forward with the mask's
// summary and its first backward; the folded BoB of any call) runs from a *program*
// (below, "Programs"): once Python has run the stage for a call signature under a
// recording, this module holds the tensors it made and its launches (the compiled kernels'
// CUDA functions, grids, and where each kernel argument comes from), and later calls of
// that signature make the same tensors and launch the same kernels with the CUDA driver,
// checking first that every argument specializes as it did when the kernels were compiled.
// Anything else (no program yet, a third order, a tensor subclass, a changed
// specialization) runs by Python: the stage function set by set_triton_stage, or the
// differentiable BoB set by set_bob_backward.
#include <ATen/ATen.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/autocast_mode.h>
#include <ATen/record_function.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/frontend/tracer.h>
#include <torch/csrc/profiler/orchestration/observer.h>
#include <torch/csrc/utils/pybind.h>

#include <cmath>

#include <algorithm>
#include <climits>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>

namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Which kernels run the forward and the first backward (the Python side passes these
// numbers: bob_compile/eager/node.py): PyTorch's fused ones, or (kTriton, calls with a mask)
// the op's Triton kernels, launched from programs (below, "Programs") or by Python
enum Kernels : int64_t { kCudnn = 0, kFlash = 1, kCpuFlash = 2, kTriton = 3 };

// ---------------------------------------------------------------------------- layouts
// Outputs are dense, in the dimension order of the input they are shaped like
// (bob_compile/kernels/layout.py): a stable sort of like's strides, 0-strided dimensions outermost.
std::vector<int64_t> inner_to_outer(at::IntArrayRef strides) {
  std::vector<int64_t> order(strides.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    bool a0 = strides[a] == 0, b0 = strides[b] == 0;
    return a0 != b0 ? b0 : strides[a] < strides[b];
  });
  return order;
}

// t itself when laid out so, else a copy (a tensor of its own, not a view: a node's output
// that is a view could not be modified in place)
Tensor in_order_of(const Tensor& t, const Tensor& like) {
  auto order = inner_to_outer(like.strides());
  auto sizes = t.sizes();
  auto strides = t.strides();
  std::vector<int64_t> dense(order.size());
  int64_t step = 1;
  bool laid_out = true;
  for (auto d : order) {
    // a size-1 dimension's stride never addresses memory
    laid_out = laid_out && (sizes[d] == 1 || strides[d] == step);
    dense[d] = step;
    step *= sizes[d];
  }
  if (laid_out) return t;
  return at::empty_strided(sizes, dense, t.options()).copy_(t);
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

// The Python functions of the backwards the nodes do not run themselves (never freed: they
// may be called from the autograd engine's threads until the interpreter exits).
py::object* general_backward = nullptr;
py::object* bob_backward = nullptr;

bool deterministic() {
  auto& context = at::globalContext();
  return context.deterministicAlgorithms() && !context.deterministicAlgorithmsWarnOnly();
}

// Whether a cotangent can go to the fused kernels as it is: a dense tensor like `like` (not
// a tensor subclass, functorch wrapper or batched tensor, whose dispatch keys differ, nor a
// dual tensor of forward-mode AD), and no dispatch mode that should see the ops
bool plain_like(const Tensor& t, const Tensor& like) {
  return t.key_set() == like.key_set() && !t._fw_grad(0).defined() &&
         c10::impl::TorchDispatchModeTLS::stack_len() == 0;
}

bool plain_or_undefined(const Tensor& t, const Tensor& like) {
  return !t.defined() || plain_like(t, like);
}

Tensor tensor_or_undefined(const py::handle& h) {
  return h.is_none() ? Tensor() : h.cast<Tensor>();
}

// A Python exception (caught under the GIL) as what the autograd engine carries across
// threads, and this module's exception translator restores, with its Python type
[[noreturn]] void throw_python_error(py::error_already_set& e) {
  e.restore();
  python_error error;
  error.persist();
  throw error;
}

// Calls a Python backward (which returns a tuple of tensors or Nones) under the GIL and puts
// its results at `positions` of the gradients returned; a Python exception is rethrown as
// what the engine carries across threads with its Python type. The arguments are converted
// under the GIL (an undefined tensor becomes None).
template <typename... Args>
void call_python(py::object* fn, const char* what, variable_list& result,
                 std::initializer_list<size_t> positions, Args&&... args) {
  TORCH_CHECK(fn != nullptr, "bob_compile native node: no ", what, " set");
  py::gil_scoped_acquire gil;
  try {
    py::tuple got = (*fn)(std::forward<Args>(args)...);
    size_t i = 0;
    for (size_t position : positions) result[position] = tensor_or_undefined(got[i++]);
  } catch (py::error_already_set& e) {
    throw_python_error(e);
  }
}

// ---------------------------------------------------------------------------- Triton launches
// The CUDA driver's cuLaunchKernel and cuCtxGetCurrent, set by Python (set_driver) on
// machines with a GPU; this module links no CUDA library, so that one source builds
// everywhere (the CI's CPU machines included).
using LaunchKernelFn = int (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                               unsigned, void*, void**, void**);
using ContextFn = int (*)(void**);
LaunchKernelFn cu_launch_kernel = nullptr;
ContextFn cu_ctx_get_current = nullptr;

// Where one runtime argument of a kernel comes from, and how Triton specialized it when it
// compiled the kernel (triton_common.py, "Launching"): a pointer's 16-byte alignment, an
// int's width and divisibility by 16; an int that was 1 became a constant of the kernel
// (kStrideOne: no argument, and the stride must be 1 again).
enum ArgKind : int64_t { kPointer, kStride, kStrideOne, kInt32, kInt64, kFloat32 };
struct Arg {
  int64_t kind, slot, dim, flag;  // flag: the pointer was aligned / the stride divisible by 16
  int64_t wide;                   // a stride passed as int64 (else int32)
  int64_t dtype;                  // a pointer's at::ScalarType
  int64_t int_value;
  double float_value;
};
struct KernelLaunch {
  uint64_t function;
  unsigned grid_x, grid_y, threads, shared_bytes;
  std::vector<Arg> args;
};
// A double's bits, as a key entry (equal keys: the very same scale)
int64_t bits_of(double x) {
  int64_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return bits;
}

// Fills `values` (one 8-byte cell per launched argument) for one launch; false where an
// argument does not specialize as the compiled kernel expects
bool pack_arguments(const KernelLaunch& launch, const Tensor* slots,
                    std::vector<uint64_t>& values) {
  values.clear();
  for (const Arg& a : launch.args) {
    uint64_t cell = 0;
    if (a.kind == kPointer) {
      const Tensor& t = slots[a.slot];
      if (!t.defined() || static_cast<int64_t>(t.scalar_type()) != a.dtype) return false;
      auto address = reinterpret_cast<uint64_t>(t.data_ptr());
      if (a.flag && address % 16) return false;
      cell = address;
    } else if (a.kind == kStride || a.kind == kStrideOne) {
      const Tensor& t = slots[a.slot];
      if (!t.defined()) return false;
      int64_t stride = t.stride(a.dim);
      if (a.kind == kStrideOne) {
        if (stride != 1) return false;
        continue;
      }
      if (a.flag && stride % 16) return false;
      if (a.wide) {
        std::memcpy(&cell, &stride, sizeof(stride));
      } else {
        if (stride < INT32_MIN || stride > INT32_MAX) return false;
        auto narrow = static_cast<int32_t>(stride);
        std::memcpy(&cell, &narrow, sizeof(narrow));
      }
    } else if (a.kind == kInt32) {
      auto narrow = static_cast<int32_t>(a.int_value);
      std::memcpy(&cell, &narrow, sizeof(narrow));
    } else if (a.kind == kInt64) {
      std::memcpy(&cell, &a.int_value, sizeof(a.int_value));
    } else {
      auto single = static_cast<float>(a.float_value);
      std::memcpy(&cell, &single, sizeof(single));
    }
    values.push_back(cell);
  }
  values.push_back(0);   // Triton's global and profile scratch pointers (the programs'
  values.push_back(0);   // kernels need neither: Python makes no program of one that does)
  return true;
}

// Launches every kernel of `launches` on device's current stream, their arguments taken from
// `slots`; false, and nothing launched, where an argument does not specialize as compiled
bool launch_all(const std::vector<KernelLaunch>& launches, const Tensor* slots,
                const c10::Device& device) {
  std::vector<std::vector<uint64_t>> values(launches.size());
  for (size_t i = 0; i < launches.size(); ++i) {
    if (!pack_arguments(launches[i], slots, values[i])) return false;
  }
  void* stream = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)
                     ->getStream(device)
                     .native_handle();
  std::vector<void*> pointers;
  for (size_t i = 0; i < launches.size(); ++i) {
    const KernelLaunch& launch = launches[i];
    pointers.clear();
    for (auto& cell : values[i]) pointers.push_back(&cell);
    int status = cu_launch_kernel(reinterpret_cast<void*>(launch.function), launch.grid_x,
                                  launch.grid_y, 1, launch.threads, 1, 1, launch.shared_bytes,
                                  stream, pointers.data(), nullptr);
    TORCH_CHECK(status == 0, "bob_compile: launching a Triton kernel from a program failed (CUDA "
                "driver error ", status, ")");
  }
  return true;
}

// A pointer or a stride: an argument taken from a slot's tensor
bool uses_slot(const Arg& arg) {
  return arg.kind == kPointer || arg.kind == kStride || arg.kind == kStrideOne;
}

// Launches from Python (launch_programs.launch_arguments): per launch (function, grid_x, grid_y,
// threads, shared bytes, [(kind, slot, dim, flag, wide, dtype, int, float), ...]); slots
// numbered below num_slots
std::vector<KernelLaunch> parse_launches(const std::vector<py::tuple>& launches,
                                         int64_t num_slots) {
  std::vector<KernelLaunch> parsed;
  for (const py::tuple& l : launches) {
    KernelLaunch launch;
    launch.function = l[0].cast<uint64_t>();
    launch.grid_x = l[1].cast<unsigned>();
    launch.grid_y = l[2].cast<unsigned>();
    launch.threads = l[3].cast<unsigned>();
    launch.shared_bytes = l[4].cast<unsigned>();
    for (const py::handle& item : l[5].cast<py::list>()) {
      auto a = item.cast<py::tuple>();
      Arg arg{a[0].cast<int64_t>(), a[1].cast<int64_t>(), a[2].cast<int64_t>(),
              a[3].cast<int64_t>(), a[4].cast<int64_t>(), a[5].cast<int64_t>(),
              a[6].cast<int64_t>(), a[7].cast<double>()};
      TORCH_CHECK(arg.kind >= kPointer && arg.kind <= kFloat32, "bad argument kind");
      TORCH_CHECK(!uses_slot(arg) || (arg.slot >= 0 && arg.slot < num_slots), "bad slot");
      TORCH_CHECK(!uses_slot(arg) || arg.kind == kPointer || (arg.dim >= 0 && arg.dim < 4),
                  "bad dimension");
      launch.args.push_back(arg);
    }
    parsed.push_back(std::move(launch));
  }
  return parsed;
}

void set_driver(uint64_t launch_kernel, uint64_t context_get_current) {
  cu_launch_kernel = reinterpret_cast<LaunchKernelFn>(launch_kernel);
  cu_ctx_get_current = reinterpret_cast<ContextFn>(context_get_current);
}

// ---------------------------------------------------------------------------- programs
// The op's Triton kernels run in stages: a masked call's forward (the mask's summary, then
// the forward kernel) and first backward, and any call's folded BoB. Once Python has run a
// stage for a call signature under a recording (node.py run_triton_stage, programs.py), this
// module holds a *program* of it: the tensors the stage made (fresh allocations and views,
// each by sizes, strides and dtype) and its launches, with slots numbered inputs first, then
// the tensors made, in order. Later calls of the signature make the same tensors and launch
// the same kernels; a signature whose stage cannot be replayed (an op besides allocations
// and views, a launch Triton took another path for) is marked so, and Python runs it
// without recording.
enum Stage : int64_t { kForwardStage = 0, kBackwardStage = 1, kBobStage = 2 };

struct MadeTensor {
  int64_t base;     // -1: a fresh allocation, else the slot it is a view of
  std::vector<int64_t> sizes, strides;
  int64_t offset;   // a view's storage offset past its base's
  int64_t dtype;    // a fresh allocation's at::ScalarType
};
struct Program {
  bool replayable;
  std::vector<MadeTensor> made;
  std::vector<KernelLaunch> launches;
  std::vector<std::pair<int64_t, int64_t>> outputs;   // (slot, input laid out like, or -1)
};
std::mutex programs_lock;
std::map<std::vector<int64_t>, std::shared_ptr<const Program>> programs;
constexpr size_t kProgramsLimit = 1024;   // signatures, bounded like Python's call paths
py::object* triton_stage = nullptr;

// The stage, scale, causal and each input's dtype, device, sizes and strides: everything
// Python's stage decides its allocations, views and launches from, besides the settings
// (their reload drops every program) and pointer alignment (checked when packing)
std::vector<int64_t> program_key(int64_t stage, const std::vector<Tensor>& inputs,
                                 double scale, bool causal) {
  std::vector<int64_t> key{stage, bits_of(scale), causal};
  for (const Tensor& t : inputs) {
    if (!t.defined()) {
      key.push_back(-1);
      continue;
    }
    key.insert(key.end(), {static_cast<int64_t>(t.scalar_type()),
                           static_cast<int64_t>(t.device().type()), t.device().index(), t.dim()});
    key.insert(key.end(), t.sizes().begin(), t.sizes().end());
    key.insert(key.end(), t.strides().begin(), t.strides().end());
  }
  return key;
}

// The stage's outputs from its program, or nothing where it does not apply
std::optional<std::vector<Tensor>> replay(const Program& program,
                                          const std::vector<Tensor>& inputs) {
  c10::DeviceGuard on_inputs_device(inputs[0].device());    // its context launches them
  void* context = nullptr;
  if (cu_ctx_get_current(&context) != 0 || context == nullptr) return std::nullopt;
  std::vector<Tensor> slots(inputs);
  slots.reserve(inputs.size() + program.made.size());
  auto options = inputs[0].options();
  for (const MadeTensor& m : program.made) {
    if (m.base < 0) {
      slots.push_back(at::empty_strided(m.sizes, m.strides,
                                        options.dtype(static_cast<at::ScalarType>(m.dtype))));
    } else {
      const Tensor& base = slots[m.base];
      if (!base.defined()) return std::nullopt;
      slots.push_back(base.as_strided(m.sizes, m.strides, base.storage_offset() + m.offset));
    }
  }
  if (!launch_all(program.launches, slots.data(), inputs[0].device())) return std::nullopt;
  std::vector<Tensor> outputs;
  for (auto [slot, like] : program.outputs) {
    outputs.push_back(like < 0 ? slots[slot] : in_order_of(slots[slot], inputs[like]));
  }
  return outputs;
}

// Python's stage (eager/node.py run_triton_stage), under the GIL; wants_program: record it
std::vector<Tensor> python_stage(int64_t stage, const std::vector<Tensor>& inputs, double scale,
                                 bool causal, bool wants_program) {
  TORCH_CHECK(triton_stage != nullptr, "bob_compile native node: no Triton stage set");
  py::gil_scoped_acquire gil;
  try {
    py::tuple args(inputs.size());
    for (size_t i = 0; i < inputs.size(); ++i) {
      args[i] = inputs[i].defined() ? py::cast(inputs[i]) : py::none();
    }
    py::tuple got = (*triton_stage)(stage, args, scale, causal, wants_program);
    std::vector<Tensor> outputs;
    for (const py::handle& h : got) outputs.push_back(tensor_or_undefined(h));
    return outputs;
  } catch (py::error_already_set& e) {
    throw_python_error(e);
  }
}

// A stage of a masked call: from its program, else by Python (recording it where a program
// could be replayed on this machine and none is held yet)
std::vector<Tensor> run_stage(int64_t stage, const std::vector<Tensor>& inputs, double scale,
                              bool causal) {
  bool replays = cu_launch_kernel != nullptr && inputs[0].is_cuda();
  std::shared_ptr<const Program> program;
  if (replays) {
    auto key = program_key(stage, inputs, scale, causal);
    {
      std::lock_guard<std::mutex> guard(programs_lock);
      auto found = programs.find(key);
      if (found != programs.end()) program = found->second;
    }
    if (program && program->replayable) {
      auto outputs = replay(*program, inputs);
      if (outputs) return *outputs;
    }
  }
  return python_stage(stage, inputs, scale, causal, replays && !program);
}

// A program from Python (eager/programs.py): made, [(base, sizes, strides, offset, dtype)];
// launches as parse_launches takes them; outputs, [(slot, like)]. replayable=false marks the
// signature as one Python runs unrecorded
void register_program(int64_t stage, const std::vector<std::optional<Tensor>>& inputs,
                      double scale, bool causal, bool replayable,
                      const std::vector<py::tuple>& made, const std::vector<py::tuple>& launches,
                      const std::vector<std::pair<int64_t, int64_t>>& outputs) {
  auto program = std::make_shared<Program>();
  program->replayable = replayable;
  auto num_inputs = static_cast<int64_t>(inputs.size());
  for (const py::tuple& m : made) {
    MadeTensor t{m[0].cast<int64_t>(), m[1].cast<std::vector<int64_t>>(),
                 m[2].cast<std::vector<int64_t>>(), m[3].cast<int64_t>(), m[4].cast<int64_t>()};
    auto slot = num_inputs + static_cast<int64_t>(program->made.size());
    TORCH_CHECK(t.base < slot && t.sizes.size() == t.strides.size(), "bad made tensor");
    program->made.push_back(std::move(t));
  }
  auto num_slots = num_inputs + static_cast<int64_t>(program->made.size());
  program->launches = parse_launches(launches, num_slots);
  for (auto [slot, like] : outputs) {
    TORCH_CHECK(slot >= 0 && slot < num_slots && like < num_inputs, "bad output");
  }
  program->outputs = outputs;
  TORCH_CHECK(!replayable || !program->outputs.empty(), "a program without outputs");
  std::vector<Tensor> tensors;
  for (const auto& t : inputs) tensors.push_back(t.value_or(Tensor()));
  auto key = program_key(stage, tensors, scale, causal);
  std::lock_guard<std::mutex> guard(programs_lock);
  if (programs.size() >= kProgramsLimit) programs.clear();
  programs[key] = std::move(program);
}

void forget_programs() {
  std::lock_guard<std::mutex> guard(programs_lock);
  programs.clear();
}

size_t program_count() {
  std::lock_guard<std::mutex> guard(programs_lock);
  size_t replayable = 0;
  for (const auto& entry : programs) replayable += entry.second->replayable;
  return replayable;
}

// ---------------------------------------------------------------------------- the nodes
// What a node's stages run: PyTorch's fused kernels, or (kTriton) the masked call's programs
struct Forward {
  Tensor o, lse, key_range;   // key_range: the mask's summary (kTriton), for the backwards
};

Forward node_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask,
                     double scale, bool causal, int64_t kernels, bool with_lse) {
  if (kernels == kTriton) {
    auto out = run_stage(kForwardStage, {q, k, v, mask}, scale, causal);
    return {out[0], out[1], out[2]};
  }
  auto [o, lse] = fused_forward(q, k, v, scale, causal, kernels, with_lse);
  return {o, lse, Tensor()};
}

// o alone, for a call nothing differentiates
Tensor forward_output(const Tensor& q, const Tensor& k, const Tensor& v,
                      const std::optional<Tensor>& mask, double scale, bool causal,
                      int64_t kernels) {
  RECORD_FUNCTION("bob_compile::attn_fwd", std::vector<c10::IValue>());
  return node_forward(q, k, v, mask.value_or(Tensor()), scale, causal, kernels, false).o;
}

std::tuple<Tensor, Tensor, Tensor> node_backward(const Tensor& dout, const Tensor& q,
                                                 const Tensor& k, const Tensor& v,
                                                 const Tensor& o, const Tensor& lse,
                                                 const Tensor& mask, const Tensor& key_range,
                                                 double scale, bool causal, int64_t kernels) {
  if (kernels == kTriton) {
    auto out = run_stage(kBackwardStage, {q, k, v, o, lse, dout, mask, key_range}, scale, causal);
    return {out[0], out[1], out[2]};
  }
  return fused_backward(dout, q, k, v, o, lse, scale, causal, kernels);
}

Tensor saved_tensor(AutogradContext* ctx, const char* name) {
  auto found = ctx->saved_data.find(name);
  return found == ctx->saved_data.end() ? Tensor() : found->second.toTensor();
}

// A masked call's mask (undefined without one), passed to the nodes' apply as a non-tensor
// argument: an undefined tensor argument cannot be a node's input, and the mask never gets a
// gradient. The nodes save it for their backwards, which refuses one modified in place since.
struct Mask {
  Tensor tensor;
};

// o and lse of the forward, with their history: what a third order differentiates the BoB
// through; and the mask with its summary. Passed to NativeAttentionBackward::apply as one
// non-tensor argument, so that they make no edges of that node (the folded BoB returns no
// cotangents for o and lse).
struct ForwardOutputs {
  Tensor o, lse, mask, key_range;
};

// B = P k, the attention output with the keys as values, for the folded BoB's row pass of
// heads wider than keys_out_above_head_dim (narrower ones accumulate it in the pass: Python's
// triton_attention._keys_out decides alike), from the fused kernels where they run the
// call; undefined otherwise, or where the kernel refuses (the stage then computes it)
int64_t keys_out_above_head_dim = INT64_MAX;

Tensor keys_out(const Tensor& q, const Tensor& k, double scale, bool causal, int64_t kernels) {
  if (kernels == kTriton || q.size(3) <= keys_out_above_head_dim) return Tensor();
  try {
    return std::get<0>(fused_forward(q, k, k, scale, causal, kernels, false));
  } catch (const c10::OutOfMemoryError&) {
    throw;
  } catch (const c10::Error&) {
    return Tensor();
  }
}

// The first backward of a folded second order (what AttnBwdFn is to the Python node, for o
// and lse detached: autograd.py _first_backward): forward, the first-order backward;
// backward, the folded BoB (from a program, or by Python).
struct NativeAttentionBackward : public torch::autograd::Function<NativeAttentionBackward> {
  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k,
                               const Tensor& v, const Tensor& o, const Tensor& lse,
                               const Tensor& dout, const ForwardOutputs& attached,
                               double scale, bool causal, int64_t kernels) {
    RECORD_FUNCTION("bob_compile::attn_bwd", std::vector<c10::IValue>());
    auto [dq, dk, dv] = node_backward(dout, q, k, v, o, lse, attached.mask, attached.key_range,
                                      scale, causal, kernels);
    ctx->save_for_backward({q, k, v, o, lse, dout, attached.o, attached.lse, attached.mask});
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["kernels"] = kernels;
    if (attached.key_range.defined()) ctx->saved_data["key_range"] = attached.key_range;
    // dq, for the BoB's row pass to read R = dS k from (autograd.py _keep_dq): detached, so
    // that the caller may still modify it in place; a changed version is not read
    ctx->saved_data["dq"] = dq.detach();
    ctx->saved_data["dq_version"] =
        static_cast<int64_t>(torch::autograd::impl::version_counter(dq).current_version());
    ctx->set_materialize_grads(false);      // None cotangents skip their GEMMs
    return {dq, dk, dv};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Tensor &gdq = grads[0], &gdk = grads[1], &gdv = grads[2];
    variable_list result(10);
    if (!gdq.defined() && !gdk.defined() && !gdv.defined()) return result;
    auto saved = ctx->get_saved_variables();
    const Tensor &q = saved[0], &k = saved[1], &v = saved[2], &o = saved[3], &lse = saved[4];
    const Tensor &dout = saved[5], &mask = saved[8];
    double scale = ctx->saved_data["scale"].toDouble();
    bool causal = ctx->saved_data["causal"].toBool();
    int64_t kernels = ctx->saved_data["kernels"].toInt();
    Tensor dq = ctx->saved_data["dq"].toTensor();
    if (static_cast<int64_t>(torch::autograd::impl::version_counter(dq).current_version()) !=
        ctx->saved_data["dq_version"].toInt()) {
      dq = Tensor();
    }
    bool plain = !c10::GradMode::is_enabled() && plain_or_undefined(gdq, q) &&
                 plain_or_undefined(gdk, k) && plain_or_undefined(gdv, v);
    if (plain && (kernels == kTriton || (cu_launch_kernel != nullptr && q.is_cuda()))) {
      RECORD_FUNCTION("bob_compile::attn_bob_folded", std::vector<c10::IValue>());
      auto got = run_stage(kBobStage, {q, k, v, o, lse, dout, dq, gdq, gdk, gdv, mask,
                                       saved_tensor(ctx, "key_range"),
                                       keys_out(q, k, scale, causal, kernels)},
                           scale, causal);
      result[0] = got[0], result[1] = got[1], result[2] = got[2], result[5] = got[3];
      return result;
    }
    call_python(bob_backward, "BoB backward", result, {0, 1, 2, 5}, q, k, v, o, lse, dout,
                saved[6], saved[7], gdq, gdk, gdv, dq, scale, causal, mask);
    return result;
  }
};

struct NativeAttention : public torch::autograd::Function<NativeAttention> {
  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k,
                               const Tensor& v, const Mask& mask, double scale, bool causal,
                               int64_t kernels, bool fold) {
    RECORD_FUNCTION("bob_compile::attn_fwd", std::vector<c10::IValue>());
    auto out = node_forward(q, k, v, mask.tensor, scale, causal, kernels, true);
    ctx->save_for_backward({q, k, v, out.o, out.lse, mask.tensor});
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["kernels"] = kernels;
    ctx->saved_data["fold"] = fold;
    if (out.key_range.defined()) ctx->saved_data["key_range"] = out.key_range;
    ctx->set_materialize_grads(false);      // dlse stays undefined in ordinary training
    return {out.o, out.lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Tensor& dout = grads[0];
    const Tensor& dlse = grads[1];
    variable_list result(8);
    if (!dout.defined() && !dlse.defined()) return result;
    auto saved = ctx->get_saved_variables();
    const Tensor &q = saved[0], &k = saved[1], &v = saved[2], &o = saved[3], &lse = saved[4];
    const Tensor& mask = saved[5];
    double scale = ctx->saved_data["scale"].toDouble();
    bool causal = ctx->saved_data["causal"].toBool();
    int64_t kernels = ctx->saved_data["kernels"].toInt();
    Tensor key_range = saved_tensor(ctx, "key_range");
    std::string refused;
    if (dout.defined() && !dlse.defined() && !deterministic() && plain_like(dout, o)) {
      try {
        if (!c10::GradMode::is_enabled()) {
          RECORD_FUNCTION("bob_compile::attn_bwd", std::vector<c10::IValue>());
          auto [dq, dk, dv] = node_backward(dout, q, k, v, o, lse, mask, key_range, scale,
                                            causal, kernels);
          result[0] = dq, result[1] = dk, result[2] = dv;
          return result;
        }
        // create_graph: a second order follows; in the folded form o and lse enter the first
        // backward detached (autograd.py _first_backward), outside torch.func transforms
        // (which, while active, put their front-mode key in the thread's dispatch keys)
        if (ctx->saved_data["fold"].toBool() &&
            !c10::impl::tls_is_dispatch_key_included(
                c10::DispatchKey::FuncTorchDynamicLayerFrontMode)) {
          auto grads = NativeAttentionBackward::apply(
              q, k, v, o.detach(), lse.detach(), dout, ForwardOutputs{o, lse, mask, key_range},
              scale, causal, kernels);
          result[0] = grads[0], result[1] = grads[1], result[2] = grads[2];
          return result;
        }
      } catch (const c10::OutOfMemoryError&) {
        throw;      // not a refusal: the general path would run out of memory too
      } catch (const c10::Error& e) {
        if (kernels == kTriton) throw;      // the op's own kernels: nothing to fall back to
        refused = e.what_without_backtrace();
      }
    }
    call_python(general_backward, "general backward", result, {0, 1, 2}, q, k, v, o, lse,
                dout, dlse, scale, causal, kernels,
                refused.empty() ? std::optional<std::string>() : std::optional(refused), mask);
    return result;
  }
};

// (o, lse) of the attention op through the node (or without one where no input requires
// grad or grad mode is off: Function::apply decides). mask: a masked call's (B, Hq, L, S)
// view (kernels kTriton); fold: whether a second order takes the folded form
// (kernels.fold_bob)
std::tuple<Tensor, Tensor> attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                     const std::optional<Tensor>& mask, double scale,
                                     bool causal, int64_t kernels, bool fold) {
  auto out = NativeAttention::apply(q, k, v, Mask{mask.value_or(Tensor())}, scale, causal,
                                    kernels, fold);
  return {out[0], out[1]};
}

// ---------------------------------------------------------------------------- the entry
// bob_compile.attention's first lines (attention.py): for a call whose route Python has
// decided before (remember_route), o from here, or None where Python must run the call
// (anything but 4-D plain tensors, a plain mask or none, and a float or default scale; a torch.func
// transform, dispatch or torch-function mode, JIT trace, the profiler, autocast, a compiled
// graph's kernel choices, a forward-AD level or tangent; an unknown signature; a kernel's
// refusal).
// What Python would run for such a call is exactly this: the C++ node, or forward_output.
struct Route {
  int64_t kernels;    // -1: not the node's (Python runs the call)
  bool fold;
};
std::mutex routes_lock;
std::map<std::vector<int64_t>, Route> routes;
constexpr size_t kRoutesLimit = 4096;
PyObject* kernel_choices = nullptr;   // bob_compile/kernels/settings.py's contextvar of kernel choices
PyObject* forward_ad = nullptr;       // torch.autograd.forward_ad (its _current_level)
PyObject* current_level = nullptr;    // the interned name "_current_level"

// a mask by its dtype, sizes and strides (the broadcast attention.py accepted for them)
std::vector<int64_t> route_key(const Tensor& q, const Tensor& k, const Tensor& v,
                               const Tensor& mask, double scale, bool causal) {
  std::vector<int64_t> key{static_cast<int64_t>(q.device().type()), q.device().index(),
                           static_cast<int64_t>(q.scalar_type()), q.size(0), q.size(1),
                           q.size(2), q.size(3), k.size(1), k.size(2), v.size(3), causal,
                           bits_of(scale)};
  if (mask.defined()) {
    key.insert(key.end(), {static_cast<int64_t>(mask.scalar_type()), mask.dim()});
    key.insert(key.end(), mask.sizes().begin(), mask.sizes().end());
    key.insert(key.end(), mask.strides().begin(), mask.strides().end());
  }
  return key;
}

void remember_route(const Tensor& q, const Tensor& k, const Tensor& v,
                    const std::optional<Tensor>& mask, double scale, bool causal,
                    int64_t kernels, bool fold) {
  if (q.dim() != 4 || k.dim() != 4 || v.dim() != 4) return;     // the entry takes 4-D only
  std::lock_guard<std::mutex> guard(routes_lock);
  if (routes.size() >= kRoutesLimit) routes.clear();
  routes[route_key(q, k, v, mask.value_or(Tensor()), scale, causal)] = Route{kernels, fold};
}

void forget_routes() {
  std::lock_guard<std::mutex> guard(routes_lock);
  routes.clear();
}

// A tensor whose dispatch keys are those of a fresh dense tensor of its device type (not a
// subclass's, functorch wrapper's, batched, conjugate or negative view's, nor an inference
// tensor's); the fresh tensors' keys are read once, outside inference mode
bool plain_tensor(const Tensor& t) {
  static std::once_flag cpu_once, cuda_once;
  static c10::DispatchKeySet cpu_keys, cuda_keys;
  if (c10::InferenceMode::is_enabled()) return false;
  bool cuda = t.is_cuda();
  std::call_once(cuda ? cuda_once : cpu_once, [&] {
    (cuda ? cuda_keys : cpu_keys) = at::empty({0}, t.options()).key_set();
  });
  return t.key_set() == (cuda ? cuda_keys : cpu_keys);
}

bool nothing_intercepts(const Tensor& q) {
  if (c10::impl::tls_is_dispatch_key_included(c10::DispatchKey::FuncTorchDynamicLayerFrontMode) ||
      c10::impl::TorchDispatchModeTLS::stack_len() != 0 || at::impl::torch_function_mode_enabled() ||
      torch::jit::tracer::isTracing() || torch::profiler::impl::profilerEnabled() ||
      at::autocast::is_autocast_enabled(q.device().type())) {
    return false;
  }
  if (forward_ad != nullptr) {          // a dual level open: Python's AttnFn (with its jvp)
    PyObject* level = PyObject_GetAttr(forward_ad, current_level);
    long value = level != nullptr ? PyLong_AsLong(level) : 0;
    Py_XDECREF(level);
    if (level == nullptr || (value == -1 && PyErr_Occurred())) {
      PyErr_Clear();
      return false;
    }
    if (value >= 0) return false;
  }
  if (kernel_choices != nullptr) {
    PyObject* choices = nullptr;
    if (PyContextVar_Get(kernel_choices, Py_None, &choices) != 0) {
      PyErr_Clear();
      return false;
    }
    bool none = choices == Py_None;
    Py_XDECREF(choices);
    if (!none) return false;
  }
  return true;
}

py::object fast_attention(py::handle query, py::handle key, py::handle value, py::handle mask,
                          py::handle is_causal, py::handle scale_arg, py::handle enable_gqa) {
  py::object none = py::none();
  if (!PyBool_Check(is_causal.ptr()) || !PyBool_Check(enable_gqa.ptr()) ||
      !(scale_arg.is_none() || PyFloat_CheckExact(scale_arg.ptr())) ||
      !THPVariable_CheckExact(query.ptr()) || !THPVariable_CheckExact(key.ptr()) ||
      !THPVariable_CheckExact(value.ptr()) ||
      !(mask.is_none() || THPVariable_CheckExact(mask.ptr()))) {
    return none;
  }
  const Tensor& q = THPVariable_Unpack(query.ptr());
  const Tensor& k = THPVariable_Unpack(key.ptr());
  const Tensor& v = THPVariable_Unpack(value.ptr());
  Tensor m = mask.is_none() ? Tensor() : THPVariable_Unpack(mask.ptr());
  bool causal = is_causal.ptr() == Py_True;
  // first what intercepts ops (plain_tensor's first call makes a tensor, which no mode may see)
  if (q.dim() != 4 || k.dim() != 4 || v.dim() != 4 || !nothing_intercepts(q) ||
      k.scalar_type() != q.scalar_type() || v.scalar_type() != q.scalar_type() ||
      k.device() != q.device() || v.device() != q.device() || !plain_tensor(q) ||
      !plain_tensor(k) || !plain_tensor(v) || q._fw_grad(0).defined() ||
      k._fw_grad(0).defined() || v._fw_grad(0).defined()) {
    return none;
  }
  // a mask: what attention.py checks besides its shape (its route was remembered for this
  // dtype, shape and strides, so its broadcast was accepted), as a plain tensor
  if (m.defined() && (m.requires_grad() || m.device() != q.device() || !plain_tensor(m) ||
                      m._fw_grad(0).defined())) {
    return none;
  }
  // the shapes attention.py accepts without broadcasting (GQA only where asked for)
  bool gqa = enable_gqa.ptr() == Py_True;
  if (k.size(0) != q.size(0) || v.size(0) != q.size(0) || k.size(1) != v.size(1) ||
      k.size(2) != v.size(2) || k.size(3) != q.size(3) || k.size(1) == 0 ||
      (gqa ? q.size(1) % k.size(1) != 0 : k.size(1) != q.size(1)) ||
      q.stride(3) != 1 || k.stride(3) != 1 || v.stride(3) != 1) {
    return none;
  }
  double scale = scale_arg.is_none() ? 1.0 / std::sqrt(static_cast<double>(q.size(3)))
                                     : PyFloat_AS_DOUBLE(scale_arg.ptr());
  Route route;
  {
    std::lock_guard<std::mutex> guard(routes_lock);
    auto found = routes.find(route_key(q, k, v, m, scale, causal));
    if (found == routes.end()) return none;
    route = found->second;
  }
  if (route.kernels < 0 || (route.kernels == kCpuFlash) == q.is_cuda() ||
      (route.kernels == kTriton) != m.defined()) {
    return none;
  }
  bool needs_graph = c10::GradMode::is_enabled() &&
                     (q.requires_grad() || k.requires_grad() || v.requires_grad());
  // the mask as the kernels take it, (B, Hq, L, S) (ops.py flat_mask)
  if (m.defined()) m = m.expand({q.size(0), q.size(1), q.size(2), k.size(2)});
  Tensor o;
  try {
    o = needs_graph
            ? NativeAttention::apply(q, k, v, Mask{m}, scale, causal, route.kernels,
                                     route.fold)[0]
            : forward_output(q, k, v, m, scale, causal, route.kernels);
  } catch (const c10::OutOfMemoryError&) {
    throw;
  } catch (const c10::Error&) {
    return none;    // a refusal: Python's path runs the call again, logs and marks it
  }
  return py::cast(o);
}

// What the entry reads of Python's state (kept until the interpreter exits)
void set_python_state(py::object choices_contextvar, py::object forward_ad_module) {
  Py_XDECREF(kernel_choices);
  Py_XDECREF(forward_ad);
  kernel_choices = choices_contextvar.release().ptr();
  forward_ad = forward_ad_module.release().ptr();
  if (current_level == nullptr) current_level = PyUnicode_InternFromString("_current_level");
}

void set_python_function(py::object*& slot, py::object fn) {
  delete slot;
  slot = new py::object(std::move(fn));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // a Python exception raised in a Python stage called from a node's forward (python_error)
  // leaves this module's functions as itself; anything else as pybind11 translates it
  py::register_local_exception_translator([](std::exception_ptr e) {
    try {
      if (e) std::rethrow_exception(e);
    } catch (python_error& error) {
      error.restore();
    }
  });
  m.def("attention", &attention, "(o, lse) through the C++ autograd node");
  m.def("forward_output", &forward_output, "o of a call nothing differentiates");
  m.def("set_general_backward",
        [](py::object fn) { set_python_function(general_backward, std::move(fn)); },
        "the Python function of the first-order node's backwards it does not run itself");
  m.def("set_bob_backward",
        [](py::object fn) { set_python_function(bob_backward, std::move(fn)); },
        "the Python function of the BoBs the first backward's node does not run itself");
  m.def("set_driver", &set_driver, "the CUDA driver's cuLaunchKernel and cuCtxGetCurrent");
  m.def("fast_attention", &fast_attention,
        "o of bob_compile.attention's call where its route is known, else None");
  m.def("remember_route", &remember_route, "the route Python decided for a call signature");
  m.def("forget_routes", &forget_routes, "drop every remembered route");
  m.def("set_python_state", &set_python_state,
        "the contextvar of kernel choices, and torch.autograd.forward_ad");
  m.def("set_triton_stage",
        [](py::object fn) { set_python_function(triton_stage, std::move(fn)); },
        "the Python function that runs (and records) a Triton stage");
  m.def("set_keys_out_above_head_dim", [](int64_t d) { keys_out_above_head_dim = d; },
        "the head dims above which the folded BoB reads B = P k, computed beforehand");
  m.def("register_program", &register_program, "the program of a Triton stage");
  m.def("forget_programs", &forget_programs, "drop every program");
  m.def("program_count", &program_count, "how many replayable programs are kept");
  m.def("scalar_type_code", [](const Tensor& t) { return static_cast<int64_t>(t.scalar_type()); },
        "the number of a tensor's dtype in programs");
  m.attr("CUDNN") = static_cast<int64_t>(kCudnn);
  m.attr("FLASH") = static_cast<int64_t>(kFlash);
  m.attr("CPU_FLASH") = static_cast<int64_t>(kCpuFlash);
  m.attr("TRITON") = static_cast<int64_t>(kTriton);
  m.attr("STAGES") = py::make_tuple("forward", "backward", "bob_folded");
  m.attr("ARG_KINDS") = py::make_tuple("pointer", "stride", "stride_one", "int32", "int64",
                                       "float32");
}
