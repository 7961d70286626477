// How a host function's arguments bind to XLA's FFI call: the types they take
// and the bindings the family tables (reductions.h, collectives.h, ...) build
// from. Bindings start after the backend's context arguments `base` (none on
// CPU, the stream on CUDA); every operation's buffers are followed by its
// communicator's key "comm" (call.h, register_comm) and its checking-mode flag
// "check", then its own attributes.
#ifndef JAXCOMM_BINDING_H_
#define JAXCOMM_BINDING_H_

#include <cstdint>
#include <type_traits>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace jaxcomm {

namespace ffi = xla::ffi;

namespace mpi {

using Token = ffi::Token;
using TokenOut = ffi::Result<ffi::Token>;
using Buffer = ffi::AnyBuffer;
using Result = ffi::Result<ffi::AnyBuffer>;
using StatusBuffer = ffi::Buffer<ffi::DataType::S32, 1>;  // (source, tag)
using Status = ffi::Result<StatusBuffer>;

}  // namespace mpi

template <typename Binding>
auto with_comm(Binding&& binding) {
  return std::forward<Binding>(binding).template Attr<int64_t>("comm").template Attr<bool>("check");
}

// Adds the results `Result, Results...` to a binding, in order. (Bindings cannot
// be copied or moved: each step makes a new one.)
template <typename Result, typename... Results, typename Binding>
auto returning(Binding&& binding) {
  if constexpr (sizeof...(Results) == 0) {
    return std::forward<Binding>(binding).template Ret<Result>();
  } else {
    return returning<Results...>(std::forward<Binding>(binding).template Ret<Result>());
  }
}

// token, x -> token, Results..., with the communicator's attributes. In the
// tables, a binding whose template arguments hold a comma is in parentheses.
template <typename... Results, typename Binding>
auto one_input(Binding&& base) {
  auto inputs = std::forward<Binding>(base)
                    .template Arg<mpi::Token>()
                    .template Arg<mpi::Buffer>()
                    .template Ret<mpi::Token>();
  if constexpr (sizeof...(Results) == 0) {
    return with_comm(std::move(inputs));
  } else {
    return with_comm(returning<Results...>(std::move(inputs)));
  }
}

// token -> token, Results..., with the communicator's attributes: the receives
// and the barrier.
template <typename... Results, typename Binding>
auto no_input(Binding&& base) {
  auto inputs = std::forward<Binding>(base).template Arg<mpi::Token>().template Ret<mpi::Token>();
  if constexpr (sizeof...(Results) == 0) {
    return with_comm(std::move(inputs));
  } else {
    return with_comm(returning<Results...>(std::move(inputs)));
  }
}

// How many buffers a host function takes from XLA: jaxcomm passes a primitive's
// operands past these (a receive's template) to no call (jaxcomm/_primitive.py).
template <typename... Args>
constexpr int kInputs = (0 + ... + int(std::is_same_v<Args, mpi::Buffer>));

template <auto Function>
constexpr int inputs_of = 0;
template <typename... Args, ffi::Error (*Function)(Args...)>
constexpr int inputs_of<Function> = kInputs<Args...>;

}  // namespace jaxcomm

// A table row's attributes are A(type, name) in binding order; the caller's A
// makes them `.Attr<type>("name")` to complete the binding, or lists their names.
#define JAXCOMM_BIND_ATTRIBUTE(type, name) .Attr<type>(#name)
#define JAXCOMM_ATTRIBUTE_NAME(type, name) #name,

#endif  // JAXCOMM_BINDING_H_
