// jaxcomm's eager path in C++: an operation's host function run directly on the
// buffers of Python arrays (jaxcomm._eager), and the eager wait and test of
// non-blocking requests. Polled waits give up on Ctrl-C.
#include "eager.h"

#include <mpi.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "call.h"
#include "lockstep.h"
#include "operations.h"
#include "requests.h"

namespace nb = nanobind;

namespace jaxcomm {
namespace {

// An XLA FFI buffer description of memory that a Python object owns, held
// through the buffer protocol while it lives.
struct HeldBuffer {
  XLA_FFI_Buffer buffer{};
  std::vector<int64_t> dims;
  Py_buffer view{};  // held until the call is over

  HeldBuffer() = default;
  HeldBuffer(const HeldBuffer&) = delete;
  HeldBuffer& operator=(const HeldBuffer&) = delete;
  ~HeldBuffer() {
    if (view.obj != nullptr) PyBuffer_Release(&view);
  }

  void describe(nb::handle array, int dtype, bool writable) {
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

// Eager calls run a host operation directly on the buffers of arrays that are
// already computed, outside XLA (jaxcomm's eager fast path). Inputs are
// jax.Arrays, outputs writable NumPy arrays, each with its dtype code. The buffer
// protocol gives their memory: for a jax.Array it waits until the array is
// computed and keeps its buffer alive until released, and it costs less than
// jax.Array.unsafe_buffer_pointer or NumPy's ctypes attribute. The first
// `templates` inputs (a receive's template) only gave the results' types and are
// not passed. `attrs` are the operation's attributes in the order of its binding
// (comm, check, then the op's own).
class EagerArguments {
 public:
  EagerArguments(nb::args inputs, size_t templates, const std::vector<int>& input_codes,
                 const std::vector<nb::object>& outputs, const std::vector<int>& output_codes,
                 nb::tuple attrs)
      : inputs_(input_codes.size()), outputs_(outputs.size()), attrs_(attrs) {
    for (size_t i = 0; i < inputs_.size(); ++i) {
      inputs_[i].describe(inputs[templates + i], input_codes[i], /*writable=*/false);
    }
    for (size_t i = 0; i < outputs_.size(); ++i) {
      outputs_[i].describe(outputs[i], output_codes[i], /*writable=*/true);
    }
    token_.struct_size = XLA_FFI_Buffer_STRUCT_SIZE;
    token_.dtype = XLA_FFI_DataType_TOKEN;
    strings_.reserve(4);  // string_views into it must stay valid
  }

  // The next argument of type T, in binding order.
  template <typename T>
  T next() {
    if constexpr (std::is_same_v<T, mpi::Token>) {
      return mpi::Token(&token_);
    } else if constexpr (std::is_same_v<T, mpi::TokenOut>) {
      return mpi::TokenOut(mpi::Token(&token_));
    } else if constexpr (std::is_same_v<T, mpi::Buffer>) {
      return mpi::Buffer(&inputs_.at(input_++).buffer);
    } else if constexpr (std::is_same_v<T, mpi::Result>) {
      return mpi::Result(mpi::Buffer(&outputs_.at(output_++).buffer));
    } else if constexpr (std::is_same_v<T, mpi::Status>) {
      return mpi::Status(mpi::StatusBuffer(&outputs_.at(output_++).buffer));
    } else if constexpr (std::is_same_v<T, std::string_view>) {
      return strings_.emplace_back(nb::cast<std::string>(attrs_[attr_++]));
    } else {
      return nb::cast<T>(attrs_[attr_++]);
    }
  }

 private:
  std::vector<HeldBuffer> inputs_, outputs_;
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

using EagerRun = ffi::Error (*)(EagerArguments&);

// Polled waits on the Python thread give up when a signal handler raises
// (Ctrl-C's KeyboardInterrupt); the caller then raises that exception.
bool python_interrupted() {
  nb::gil_scoped_acquire locked;
  return PyErr_CheckSignals() != 0;
}

void raise_if_interrupted() {
  if (PyErr_Occurred()) throw nb::python_error();
}

template <auto Function>
struct Eager;

template <typename... Args, ffi::Error (*Function)(Args...)>
struct Eager<Function> {
  static ffi::Error Run(EagerArguments& arguments) {
    Entered entered(kOperationName<Function>);
    std::tuple<Args...> args{arguments.template next<Args>()...};  // braces: left to right
    nb::gil_scoped_release unlocked;                               // MPI may wait for other ranks
    mpi::CheckInterrupts interrupts(&python_interrupted);
    return std::apply(Function, args);
  }
};

EagerRun eager_run(std::string_view operation) {
#define JAXCOMM_EAGER_RUN(name, function, ...) \
  if (operation == #name) return &Eager<&mpi::function>::Run;
  JAXCOMM_OPERATIONS(JAXCOMM_EAGER_RUN, _, JAXCOMM_ATTRIBUTE_NAME)
  JAXCOMM_NONBLOCKING_OPERATIONS(JAXCOMM_EAGER_RUN, _, JAXCOMM_ATTRIBUTE_NAME)
#undef JAXCOMM_EAGER_RUN
  throw nb::value_error(("no jaxcomm operation named " + std::string(operation)).c_str());
}

// One operation on arrays of fixed types, called directly: made once per
// signature by jaxcomm._eager. It is in C++ because its Python equivalent cost
// about as much again as the call's own work (lists, zips and frames).
class EagerCall {
 public:
  // The call takes `templates` inputs that are not passed (EagerArguments), then
  // one of each dtype code of `input_codes`. Each output is (allocate, dtype code,
  // wrap): allocate() makes the NumPy array the result is written to, wrap(array)
  // the jax.Array returned (with wrap None, the NumPy array is). `before()` runs
  // first; fail(code name, message) raises the call's error.
  EagerCall(std::string_view operation, size_t templates, std::vector<int> input_codes,
            std::vector<std::tuple<nb::object, int, nb::object>> outputs, nb::tuple attrs,
            nb::object before, nb::object fail)
      : run_(eager_run(operation)),
        operation_(operation),
        templates_(templates),
        input_codes_(std::move(input_codes)),
        attrs_(std::move(attrs)),
        comm_key_(nb::cast<int64_t>(attrs_[0])),  // (comm, check, then the op's own)
        before_(std::move(before)),
        fail_(std::move(fail)) {
    for (auto& [allocate, code, wrap] : outputs) {
      allocate_.push_back(std::move(allocate));
      output_codes_.push_back(code);
      wrap_.push_back(std::move(wrap));
    }
  }

  // The results on `inputs`, as a list of new jax.Arrays. The call is its own
  // computation, of one operation, run on the Python thread: an error leaves this
  // rank in step if it is paired (lockstep.h). So does Ctrl-C, which cancels a
  // receive and leaves a send to MPI. A call that `before()` refuses (an earlier
  // computation failed) never runs, while the peers run theirs; nor does one on
  // a communicator on which an earlier computation owes an operation.
  nb::list operator()(nb::args inputs) const {
    if (inputs.size() != templates_ + input_codes_.size()) {
      throw nb::type_error("jaxcomm eager call: wrong number of arrays");
    }
    if (!in_step()) raise(refusal(operation_));
    try {
      before_();
    } catch (nb::python_error& error) {
      diverge(operation_ + " was not run: an earlier computation failed (" +
              nb::str(error.value()).c_str() + ")");
      throw;
    }
    // Once the computations before it are done: one still running owes nothing yet.
    if (!may_run(std::nullopt, {&comm_key_, 1})) raise(refusal(operation_));
    std::vector<nb::object> outputs;
    outputs.reserve(allocate_.size());
    for (const nb::object& allocate : allocate_) outputs.push_back(allocate());
    ffi::Error error = ffi::Error::Success();
    {
      EagerArguments arguments(inputs, templates_, input_codes_, outputs, output_codes_, attrs_);
      error = run_(arguments);
    }
    raise_if_interrupted();
    if (!error.success()) {
      failed(operation_, error, /*last=*/true, /*synchronous=*/true);
      raise(error);
    }
    nb::list results;
    for (size_t i = 0; i < outputs.size(); ++i) {
      results.append(wrap_[i].is_none() ? outputs[i] : wrap_[i](outputs[i]));
    }
    return results;
  }

 private:
  [[noreturn]] void raise(const ffi::Error& error) const {
    fail_(error_code_name(error.errc()), error.message());
    throw std::runtime_error("jaxcomm eager call: fail() returned");
  }

  EagerRun run_;
  std::string operation_;
  size_t templates_;
  std::vector<int> input_codes_, output_codes_;
  std::vector<nb::object> allocate_, wrap_;
  nb::tuple attrs_;
  int64_t comm_key_;
  nb::object before_, fail_;
};

// Where the memory of `array` (a NumPy array or jax.Array; None: nowhere) is. The
// caller keeps the array alive while it uses the address.
void* address_of(nb::handle array, bool writable = false) {
  if (array.is_none()) return nullptr;
  HeldBuffer held;
  held.describe(array, 0, writable);
  return held.buffer.data;
}

// The eager wait: completes the request posted in the buffer of `request`,
// whose result MPI writes into `out` (None: none); `tangent_of` (None: none) as
// mpi::complete takes it. Returns ("", "", source, tag), or the error's code
// name and message.
std::tuple<std::string, std::string, int, int> complete(nb::handle request, nb::handle out,
                                                        nb::handle tangent_of) {
  int32_t status[2] = {MPI_PROC_NULL, MPI_ANY_TAG};
  const void* key = address_of(request);
  void* result = address_of(out, /*writable=*/true);
  const auto* primal = static_cast<const int32_t*>(address_of(tangent_of));
  constexpr std::string_view operation = kOperationName<&mpi::Wait>;
  ffi::Error error = in_step() ? ffi::Error::Success() : refusal(operation);
  if (error.success()) {
    nb::gil_scoped_release unlocked;
    mpi::CheckInterrupts interrupts(&python_interrupted);
    Entered entered(operation);
    error = mpi::complete(key, result, status, primal);
  }
  raise_if_interrupted();  // Ctrl-C: the receive cancelled, the send left to MPI
  if (!error.success()) {
    failed(operation, error, /*last=*/true, /*synchronous=*/true);
    return {error_code_name(error.errc()), error.message(), 0, 0};
  }
  return {"", "", status[0], status[1]};
}

// The eager test: whether the request posted in the buffer of `request` has
// completed. Returns ("", "", done), or the error's code name and message.
std::tuple<std::string, std::string, bool> test(nb::handle request) {
  bool done = false;
  const void* key = address_of(request);
  constexpr std::string_view operation = kOperationName<&mpi::Test>;
  ffi::Error error = in_step() ? ffi::Error::Success() : refusal(operation);
  if (error.success()) {
    nb::gil_scoped_release unlocked;
    Entered entered(operation);
    error = mpi::test(key, &done);
  }
  if (error.failure()) failed(operation, error, /*last=*/true, /*synchronous=*/true);
  if (!error.success()) return {error_code_name(error.errc()), error.message(), false};
  return {"", "", done};
}

}  // namespace

void define_eager(nb::module_& m) {
  nb::class_<EagerCall>(m, "EagerCall", "An operation on arrays of fixed types, run directly.")
      .def(nb::init<std::string_view, size_t, std::vector<int>,
                    std::vector<std::tuple<nb::object, int, nb::object>>, nb::tuple, nb::object,
                    nb::object>(),
           nb::arg("operation"), nb::arg("templates"), nb::arg("input_codes"), nb::arg("outputs"),
           nb::arg("attrs"), nb::arg("before"), nb::arg("fail"))
      .def("__call__", &EagerCall::operator());
  m.def("complete", &complete, nb::arg("request"), nb::arg("out").none(),
        nb::arg("tangent_of").none() = nb::none(),
        "Wait for the non-blocking operation posted in the buffer of `request`.");
  m.def("test", &test, nb::arg("request"),
        "Whether the non-blocking operation posted in the buffer of `request` is done.");
  m.def(
      "discard",
      [](nb::handle request) {
        const void* key = address_of(request);
        nb::gil_scoped_release unlocked;
        mpi::discard(key);
      },
      nb::arg("request"), "Drop a non-blocking operation that will never be waited.");
}

}  // namespace jaxcomm
