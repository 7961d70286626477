// The Python module `jaxcomm._jaxcomm_cpu`: hands the CPU handlers to
// jax.ffi.register_ffi_target and reports which MPI library it is linked to.
#include <mpi.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <vector>

#include "call.h"
#include "ops.h"

namespace nb = nanobind;

namespace jaxcomm {
#define JAXCOMM_DECLARE(name, function, binding) XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxcomm_##name);
JAXCOMM_OPERATIONS(JAXCOMM_DECLARE, _)
#undef JAXCOMM_DECLARE
}  // namespace jaxcomm

namespace jaxcomm {
namespace {

// Eager calls run a host operation directly on the buffers of arrays that are
// already computed, outside XLA (jaxcomm's eager fast path). Buffers arrive as
// (array, dtype code): inputs are jax.Arrays, outputs writable NumPy arrays.
// The buffer protocol gives their memory: for a jax.Array it waits until the
// array is computed and keeps its buffer alive until released, and it costs
// less than jax.Array.unsafe_buffer_pointer or NumPy's ctypes attribute. `attrs`
// are the operation's attributes in the order of its binding (comm, check, then
// the op's own).
using RawBuffer = std::tuple<nb::handle, int>;

class EagerArguments {
 public:
  EagerArguments(const std::vector<RawBuffer>& inputs, const std::vector<RawBuffer>& outputs,
                 nb::tuple attrs)
      : inputs_(inputs.size()), outputs_(outputs.size()), attrs_(std::move(attrs)) {
    for (size_t i = 0; i < inputs.size(); ++i) inputs_[i].describe(inputs[i], /*writable=*/false);
    for (size_t i = 0; i < outputs.size(); ++i) outputs_[i].describe(outputs[i], /*writable=*/true);
    token_.struct_size = XLA_FFI_Buffer_STRUCT_SIZE;
    token_.dtype = XLA_FFI_DataType_TOKEN;
    strings_.reserve(4);  // string_views into it must stay valid
  }

  // The next argument of type T, in binding order.
  template <typename T>
  T next() {
    if constexpr (std::is_same_v<T, host::Token>) {
      return host::Token(&token_);
    } else if constexpr (std::is_same_v<T, host::TokenOut>) {
      return host::TokenOut(host::Token(&token_));
    } else if constexpr (std::is_same_v<T, host::Buffer>) {
      return host::Buffer(&inputs_.at(input_++).buffer);
    } else if constexpr (std::is_same_v<T, host::Result>) {
      return host::Result(host::Buffer(&outputs_.at(output_++).buffer));
    } else if constexpr (std::is_same_v<T, host::Status>) {
      return host::Status(host::StatusBuffer(&outputs_.at(output_++).buffer));
    } else if constexpr (std::is_same_v<T, std::string_view>) {
      return strings_.emplace_back(nb::cast<std::string>(attrs_[attr_++]));
    } else {
      return nb::cast<T>(attrs_[attr_++]);
    }
  }

 private:
  // An XLA FFI buffer description of memory that a Python object owns.
  struct Described {
    XLA_FFI_Buffer buffer{};
    std::vector<int64_t> dims;
    Py_buffer view{};  // held until the call is over

    Described() = default;
    Described(const Described&) = delete;
    Described& operator=(const Described&) = delete;
    ~Described() {
      if (view.obj != nullptr) PyBuffer_Release(&view);
    }

    void describe(const RawBuffer& raw, bool writable) {
      const auto& [array, dtype] = raw;
      // PyBUF_ND: C-contiguous, or refused.
      int flags = writable ? PyBUF_ND | PyBUF_WRITABLE : PyBUF_ND;
      void* data = nullptr;
      if (PyObject_GetBuffer(array.ptr(), &view, flags) == 0) {
        data = view.buf;
        dims.assign(view.shape, view.shape + view.ndim);
      } else if (!writable && PyErr_ExceptionMatches(PyExc_BufferError)) {
        // jax.Array refuses the protocol for dtypes that have no buffer format
        // (bfloat16).
        PyErr_Clear();
        array.attr("block_until_ready")();
        data = reinterpret_cast<void*>(nb::cast<uintptr_t>(array.attr("unsafe_buffer_pointer")()));
        dims = nb::cast<std::vector<int64_t>>(array.attr("shape"));
      } else {
        throw nb::python_error();
      }
      buffer.struct_size = XLA_FFI_Buffer_STRUCT_SIZE;
      buffer.dtype = static_cast<XLA_FFI_DataType>(dtype);
      buffer.data = data;
      buffer.rank = static_cast<int64_t>(dims.size());
      buffer.dims = dims.data();
    }
  };

  std::vector<Described> inputs_, outputs_;
  nb::tuple attrs_;
  XLA_FFI_Buffer token_{};
  std::vector<std::string> strings_;
  size_t input_ = 0, output_ = 0, attr_ = 0;
};

const char* error_code_name(std::optional<ffi::ErrorCode> code) {
  switch (code.value_or(ffi::ErrorCode::kUnknown)) {
    case ffi::ErrorCode::kInvalidArgument:
      return "INVALID_ARGUMENT";
    case ffi::ErrorCode::kFailedPrecondition:
      return "FAILED_PRECONDITION";
    default:
      return "INTERNAL";
  }
}

template <auto Function>
struct Eager;

// Returns None, or (error code name, message) when the operation fails.
template <typename... Args, ffi::Error (*Function)(Args...)>
struct Eager<Function> {
  static nb::object Run(const std::vector<RawBuffer>& inputs, const std::vector<RawBuffer>& outputs,
                        nb::tuple attrs) {
    EagerArguments arguments(inputs, outputs, std::move(attrs));
    std::tuple<Args...> args{arguments.template next<Args>()...};  // braces: left to right
    ffi::Error error = ffi::Error::Success();
    {
      nb::gil_scoped_release unlocked;  // MPI may wait for other ranks
      error = std::apply(Function, args);
    }
    if (error.success()) return nb::none();
    return nb::make_tuple(error_code_name(error.errc()), error.message());
  }
};

}  // namespace
}  // namespace jaxcomm

namespace {

std::string library_version() {
  char text[MPI_MAX_LIBRARY_VERSION_STRING];
  int length = 0;
  MPI_Get_library_version(text, &length);
  return std::string(text, static_cast<size_t>(length));
}

bool initialized() {
  int flag = 0;
  MPI_Initialized(&flag);
  return flag != 0;
}

}  // namespace

NB_MODULE(_jaxcomm_cpu, m) {
  m.doc() = "jaxcomm's CPU XLA FFI handlers.";
  m.def("registrations", [] {
    nb::dict targets;
#define JAXCOMM_REGISTER(name, function, binding) \
  targets["jaxcomm_" #name] = nb::capsule(reinterpret_cast<void*>(jaxcomm::jaxcomm_##name));
    JAXCOMM_OPERATIONS(JAXCOMM_REGISTER, _)
#undef JAXCOMM_REGISTER
    return targets;
  });
  nb::dict eager;
#define JAXCOMM_EAGER(name, function, binding) \
  eager[#name] = nb::cpp_function(&jaxcomm::Eager<&jaxcomm::host::function>::Run);
  JAXCOMM_OPERATIONS(JAXCOMM_EAGER, _)
#undef JAXCOMM_EAGER
  m.attr("eager") = eager;
  nb::dict dtype_codes;
  for (int code = 0; code < 64; ++code) {
    const char* name = jaxcomm::dtype_name(static_cast<xla::ffi::DataType>(code));
    if (std::string_view(name) != "unsupported") dtype_codes[name] = code;
  }
  m.attr("dtype_codes") = dtype_codes;
  m.def("mpi_library_version", &library_version,
        "MPI_Get_library_version of the libmpi this module is linked to.");
  m.def("mpi_initialized", &initialized,
        "MPI_Initialized as seen by the libmpi this module is linked to.");
  m.def("call_count", &jaxcomm::call_count,
        "How many times a handler has called into MPI in this process.");
  m.attr("MPI_VERSION") = MPI_VERSION;
}
