// jaxcomm's CUDA handlers, and the Python module `jaxcomm._jaxcomm_cuda`.
//
// Each handler runs the host operation (reductions.cc, collectives.cc, p2p.cc) on GPU buffers:
//
// - staged (default): the inputs are copied into pinned host buffers on XLA's
//   stream, the stream is synchronised once, MPI works on host memory, and the
//   results are copied back on the stream (the handler returns without waiting).
//   The pinned arena is allocated once, grown when a call needs more, and reused;
//   nothing is allocated per call.
// - CUDA-aware: after synchronising the stream, device pointers go straight to
//   MPI; what the host code writes into buffers itself (copies, fills, exscan's
//   identity) goes through DeviceMemory on the stream. Some calls stay staged
//   (see `direct` below): float16/bfloat16 reductions, whose MPI operators are
//   jaxcomm's own host functions, checking mode's check_replicated, which
//   compares values on the host, and tagged_sendrecv, which reads its tags there.
#include <cuda_runtime_api.h>
#include <mpi.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>

#include <algorithm>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <vector>

#if __has_include(<mpi-ext.h>)
#include <mpi-ext.h>
#endif

#include "call.h"
#include "lockstep.h"
#include "memory.h"
#include "operations.h"
#include "requests.h"
#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;

namespace jaxcomm {
namespace {

ffi::Error cuda_error(cudaError_t code, const char* what) {
  return ffi::Error(ffi::ErrorCode::kInternal,
                    std::string("jaxcomm (CUDA): ") + what + ": " + cudaGetErrorString(code));
}

#define JAXCOMM_CHECK_CUDA(call, what)                                    \
  do {                                                                    \
    if (cudaError_t jaxcomm_cuda_ = (call); jaxcomm_cuda_ != cudaSuccess) \
      return cuda_error(jaxcomm_cuda_, what);                             \
  } while (0)

// JAXCOMM_CUDA_AWARE as jaxcomm._settings read it (configure()); unset: ask MPI.
std::optional<bool> forced_cuda_aware;

// Does the MPI library accept device pointers?
bool query_cuda_aware() {
#if defined(MPIX_CUDA_AWARE_SUPPORT) && MPIX_CUDA_AWARE_SUPPORT
  return MPIX_Query_cuda_support() == 1;  // Open MPI
#elif defined(MPIX_GPU_SUPPORT_CUDA)
  int supported = 0;  // MPICH
  return MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA, &supported) == MPI_SUCCESS && supported;
#else
  return false;
#endif
}

// Decided once per process, at the first call.
bool cuda_aware() {
  static const bool aware = forced_cuda_aware.value_or(query_cuda_aware());
  return aware;
}

// Pinned host memory reused by every call: calls run one at a time (the ordered
// effect serialises them), and a call's copies back to the device are queued on
// the stream ahead of the next call's copies out of it.
class Arena {
 public:
  ~Arena() {
    if (base_) cudaFreeHost(base_);
  }

  ffi::Error reserve(size_t bytes) {
    if (bytes <= capacity_) return ffi::Error::Success();
    const size_t grown = std::max(bytes, capacity_ * 2);  // amortise repeated growth
    // The previous call's copies back to the device may still read the old arena.
    JAXCOMM_CHECK_CUDA(cudaDeviceSynchronize(), "waiting before growing the staging buffer");
    if (base_) JAXCOMM_CHECK_CUDA(cudaFreeHost(base_), "freeing the pinned staging buffer");
    base_ = nullptr;
    capacity_ = 0;
    JAXCOMM_CHECK_CUDA(cudaMallocHost(&base_, grown), "allocating the pinned staging buffer");
    capacity_ = grown;
    return ffi::Error::Success();
  }

  char* base() const { return static_cast<char*>(base_); }

  // Calls queue their copies on XLA's stream; the next call's copies into the
  // arena are ordered after the last call's copies out of it only on the same
  // stream, so a call on another stream first waits for the last one's.
  ffi::Error settle(cudaStream_t stream) {
    if (last_stream_ != nullptr && last_stream_ != stream) {
      JAXCOMM_CHECK_CUDA(cudaStreamSynchronize(last_stream_), "waiting for the previous call");
    }
    last_stream_ = stream;
    return ffi::Error::Success();
  }

 private:
  void* base_ = nullptr;
  size_t capacity_ = 0;
  cudaStream_t last_stream_ = nullptr;
};

Arena& arena() {
  static Arena instance;
  return instance;
}

size_t round_up(size_t n) { return (n + 255) / 256 * 256; }

size_t byte_size(const XLA_FFI_Buffer& b) {
  size_t n = ffi::ByteWidth(static_cast<ffi::DataType>(b.dtype));
  for (int64_t i = 0; i < b.rank; ++i) n *= static_cast<size_t>(b.dims[i]);
  return n;
}

// Host stand-ins for the device buffers of one call.
class Staging {
 public:
  // Views point into entries_, so it must never reallocate: no op has more than
  // three buffers.
  explicit Staging(cudaStream_t stream) : stream_(stream) { entries_.reserve(8); }

  // Each argument of the host function, in order: device buffers become views of
  // host memory; everything else passes through.
  template <typename T>
  T view(T value) {
    return value;
  }
  mpi::Buffer view(mpi::Buffer b) { return mpi::Buffer(add(b, true)); }
  mpi::Result view(mpi::Result r) { return mpi::Result(mpi::Buffer(add(*r, false))); }
  mpi::Status view(mpi::Status s) { return mpi::Status(mpi::StatusBuffer(add(*s, false))); }

  // Lays the buffers out in the arena and copies the inputs in. The views must all
  // have been made: their data pointers are patched here.
  ffi::Error copy_in() {
    size_t total = 0;
    for (Entry& e : entries_) {
      if (e.alias < 0) {
        e.offset = total;
        total += round_up(byte_size(e.host));
      }
    }
    if (auto err = arena().settle(stream_); err.failure()) return err;
    if (auto err = arena().reserve(total); err.failure()) return err;
    for (Entry& e : entries_) {
      const Entry& owner = e.alias < 0 ? e : entries_[e.alias];
      e.host.data = arena().base() + owner.offset;
      if (e.input && e.alias < 0) {
        JAXCOMM_CHECK_CUDA(cudaMemcpyAsync(e.host.data, e.device, byte_size(e.host),
                                           cudaMemcpyDeviceToHost, stream_),
                           "copying an input to the host");
      }
    }
    JAXCOMM_CHECK_CUDA(cudaStreamSynchronize(stream_), "waiting for the inputs");
    return ffi::Error::Success();
  }

  ffi::Error copy_out() {
    for (const Entry& e : entries_) {
      if (!e.input) {
        JAXCOMM_CHECK_CUDA(cudaMemcpyAsync(e.device, e.host.data, byte_size(e.host),
                                           cudaMemcpyHostToDevice, stream_),
                           "copying a result to the device");
      }
    }
    return ffi::Error::Success();
  }

 private:
  struct Entry {
    XLA_FFI_Buffer host;
    void* device;
    bool input;
    int alias;  // index of an earlier entry with the same device memory, or -1
    size_t offset;
  };

  template <typename B>
  const XLA_FFI_Buffer* add(const B& b, bool input) {
    auto dims = b.dimensions();
    Entry e{};
    e.host.struct_size = XLA_FFI_Buffer_STRUCT_SIZE;
    e.host.dtype = static_cast<XLA_FFI_DataType>(b.element_type());
    e.host.rank = static_cast<int64_t>(dims.size());
    e.host.dims = const_cast<int64_t*>(dims.begin());
    e.device = const_cast<void*>(b.untyped_data());
    e.input = input;
    e.alias = -1;
    for (size_t i = 0; i < entries_.size(); ++i) {
      if (entries_[i].device == e.device && byte_size(e.host) > 0) e.alias = static_cast<int>(i);
    }
    entries_.push_back(e);
    return &entries_.back().host;
  }

  cudaStream_t stream_;
  std::vector<Entry> entries_;
};

// Buffer contents written by host code during a CUDA-aware call: work on the
// stream, finished before the host code goes on (MPI may read the result next).
class DeviceMemory final : public mpi::Memory {
 public:
  explicit DeviceMemory(cudaStream_t stream) : stream_(stream) {}

  void copy(void* to, const void* from, size_t bytes) const override {
    if (bytes > 0) finish(cudaMemcpyAsync(to, from, bytes, cudaMemcpyDeviceToDevice, stream_));
  }

  void fill(void* to, const void* element, size_t width, int64_t count) const override {
    if (count <= 0) return;
    if (width == 1) {
      finish(cudaMemsetAsync(to, *static_cast<const unsigned char*>(element),
                             static_cast<size_t>(count), stream_));
      return;
    }
    std::vector<char> pattern(width * static_cast<size_t>(count));
    mpi::Memory::fill(pattern.data(), element, width, count);
    finish(cudaMemcpyAsync(to, pattern.data(), pattern.size(), cudaMemcpyHostToDevice, stream_));
  }

  void edit(void* data, size_t bytes, const std::function<void(void*)>& change) const override {
    std::vector<char> local(bytes);
    if (!finish(cudaMemcpyAsync(local.data(), data, bytes, cudaMemcpyDeviceToHost, stream_)))
      return;
    change(local.data());
    finish(cudaMemcpyAsync(data, local.data(), bytes, cudaMemcpyHostToDevice, stream_));
  }

  // The first CUDA failure of the call, if any.
  ffi::Error status() const {
    return error_ == cudaSuccess ? ffi::Error::Success()
                                 : cuda_error(error_, "writing a device buffer");
  }

 private:
  bool finish(cudaError_t queued) const {
    cudaError_t code = queued == cudaSuccess ? cudaStreamSynchronize(stream_) : queued;
    if (code != cudaSuccess && error_ == cudaSuccess) error_ = code;
    return code == cudaSuccess;
  }

  cudaStream_t stream_;
  mutable cudaError_t error_ = cudaSuccess;
};

enum class Pointers { kDevice, kDeviceUnlessHalfFloat, kHost };

// Whether Function is one of Functions (functions of any type).
template <auto F, auto G>
constexpr bool kSame = false;
template <auto F>
constexpr bool kSame<F, F> = true;

template <auto Function, auto... Functions>
constexpr bool kAmong = (kSame<Function, Functions> || ...);

// Which pointers a CUDA-aware call hands to MPI, by host function: device
// pointers, but host copies for half-float reductions (jaxcomm's own MPI
// operators reduce those, on the host) and for the functions that read their
// buffers on the host (the variable-size exchanges their counts).
template <auto Function>
constexpr Pointers kPointers =
    kAmong<Function, &mpi::CheckReplicated, &mpi::TaggedSendrecv, &mpi::Alltoallv, &mpi::Allgatherv,
           &mpi::Gatherv, &mpi::Scatterv>
        ? Pointers::kHost
    : kAmong<Function, &mpi::Allreduce, &mpi::Reduce, &mpi::Scan, &mpi::Exscan, &mpi::ReduceScatter>
        ? Pointers::kDeviceUnlessHalfFloat
        : Pointers::kDevice;

template <typename T>
bool is_half_float(const T&) {
  return false;
}
bool is_half_float(const mpi::Buffer& b) {
  return b.element_type() == ffi::DataType::F16 || b.element_type() == ffi::DataType::BF16;
}

template <auto Function>
struct Staged;

template <typename... Args, ffi::Error (*Function)(Args...)>
struct Staged<Function> {
  static bool direct(const Args&... args) {
    constexpr Pointers pointers = kPointers<Function>;
    if (pointers == Pointers::kHost || !cuda_aware()) return false;
    return pointers == Pointers::kDevice || !(is_half_float(args) || ...);
  }

  // Refuses to run as the CPU handlers do; a failure may put this rank out of
  // step (lockstep.h; the attributes as for the CPU handlers, cpu.cc).
  static ffi::Error Run(cudaStream_t stream, ffi::RunId run, Args... args, bool last,
                        ffi::Span<const int64_t> comms, int32_t owing) {
    constexpr std::string_view operation = kOperationName<Function>;
    if (!may_run(run.run_id, comms)) return refusal(operation);
    Entered entered(operation);
    ffi::Error error = Stage(stream, args...);
    if (error.failure()) {
      // In step, the peers skip the rest of the computation too: it owes nothing.
      if (failed(operation, error, last, on_python_thread()))
        ran(run.run_id, comms, /*last=*/true, operation);
    } else if (owing != kInside) {
      ran(run.run_id, comms, owing == kSettles, operation);
    }
    return error;
  }

  static ffi::Error Stage(cudaStream_t stream, Args... args) {
    if (direct(args...)) {
      JAXCOMM_CHECK_CUDA(cudaStreamSynchronize(stream), "waiting for the inputs");
      DeviceMemory device(stream);
      mpi::UseMemory use(device);
      ffi::Error result = Function(args...);
      if (auto err = device.status(); err.failure()) return err;
      return result;
    }
    Staging staging(stream);
    std::tuple<Args...> host_args{staging.view(args)...};  // braces: left to right
    if (auto err = staging.copy_in(); err.failure()) return err;
    if (auto err = std::apply(Function, host_args); err.failure()) return err;
    return staging.copy_out();
  }
};

}  // namespace

#define JAXCOMM_DEFINE_CUDA_HANDLER(name, function, binding, attributes)            \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxcomm_##name##_cuda, Staged<&mpi::function>::Run, \
                                binding attributes JAXCOMM_BIND_LOCKSTEP_ATTRIBUTES);
JAXCOMM_OPERATIONS(JAXCOMM_DEFINE_CUDA_HANDLER,
                   ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().Ctx<ffi::RunId>(),
                   JAXCOMM_BIND_ATTRIBUTE)
#undef JAXCOMM_DEFINE_CUDA_HANDLER

}  // namespace jaxcomm

NB_MODULE(_jaxcomm_cuda, m) {
  m.doc() = "jaxcomm's CUDA XLA FFI handlers.";
  m.def("registrations", [] {
    nb::dict targets;
#define JAXCOMM_REGISTER(name, ...) \
  targets["jaxcomm_" #name] = nb::capsule(reinterpret_cast<void*>(jaxcomm::jaxcomm_##name##_cuda));
    JAXCOMM_OPERATIONS(JAXCOMM_REGISTER, _, JAXCOMM_ATTRIBUTE_NAME)
#undef JAXCOMM_REGISTER
    targets["jaxcomm_in_step"] = nb::capsule(reinterpret_cast<void*>(jaxcomm::jaxcomm_in_step));
    targets["jaxcomm_settled"] = nb::capsule(reinterpret_cast<void*>(jaxcomm::jaxcomm_settled));
    targets["jaxcomm_entered"] = nb::capsule(reinterpret_cast<void*>(jaxcomm::jaxcomm_entered));
    return targets;
  });
  // This module has its own copy of call.cc's state: jaxcomm._native configures
  // both modules and registers every communicator with both.
  m.def(
      "configure",
      [](bool debug, double timeout, std::optional<bool> aware) {
        jaxcomm::configure(debug, timeout);
        jaxcomm::forced_cuda_aware = aware;
      },
      nb::arg("debug"), nb::arg("timeout"), nb::arg("cuda_aware").none(),
      "JAXCOMM_DEBUG, JAXCOMM_TIMEOUT and JAXCOMM_CUDA_AWARE, read by jaxcomm._settings.");
  m.def("register_comm", &jaxcomm::register_comm, nb::arg("key"), nb::arg("handle"));
  m.def("unregister_comm", &jaxcomm::unregister_comm, nb::arg("key"));
  m.def("in_flight", &jaxcomm::mpi::in_flight, nb::arg("comm_key"),
        "How many requests posted on the communicator `comm_key` MPI has not completed.");
  m.def(
      "share_lockstep", [](nb::capsule state) { jaxcomm::share(state.data()); }, nb::arg("state"),
      "Use the CPU module's lockstep state (lockstep.h): one for the process.");
  m.def("cuda_aware", &jaxcomm::cuda_aware,
        "Whether device pointers go to MPI directly (JAXCOMM_CUDA_AWARE, or the MPI's own query).");
}
