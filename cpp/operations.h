// jaxcomm's operations, from each family's table: reductions.h, collectives.h,
// variable_size.h, p2p.h, replicated.h, structure.h (blocking) and nonblocking.h, each
// declaring its host functions (defined in the .cc of the same name) and listing
// them as rows X(name, function, binding, attributes):
// - the FFI target is "jaxcomm_<name>" on every platform;
// - `binding` (binding.h) binds the function's buffers and the communicator's
//   attributes after the backend's context arguments `base`;
// - `attributes` lists the operation's own attributes, after "comm" and "check",
//   as A(type, name) in binding order. The caller's A completes the binding
//   (JAXCOMM_BIND_ATTRIBUTE) or lists their names, from which the Python side
//   derives its primitives' attributes and the eager path their order.
// The CPU backend (cpu.cc) binds the functions directly; the CUDA backend
// (cuda.cc) the blocking ones, behind staging, with XLA's CUDA stream as an
// extra context argument. A new family adds its table here.
#ifndef JAXCOMM_OPERATIONS_H_
#define JAXCOMM_OPERATIONS_H_

#include <string_view>

#include "binding.h"
#include "collectives.h"
#include "nonblocking.h"
#include "p2p.h"
#include "reductions.h"
#include "replicated.h"
#include "structure.h"
#include "variable_size.h"

#define JAXCOMM_OPERATIONS(X, base, A) \
  JAXCOMM_REDUCTIONS(X, base, A)       \
  JAXCOMM_COLLECTIVES(X, base, A)      \
  JAXCOMM_VARIABLE_SIZE(X, base, A)    \
  JAXCOMM_P2P(X, base, A)              \
  JAXCOMM_REPLICATED(X, base, A)       \
  JAXCOMM_STRUCTURE(X, base, A)

#define JAXCOMM_NONBLOCKING_OPERATIONS(X, base, A) \
  JAXCOMM_NONBLOCKING(X, base, A)                  \
  JAXCOMM_VARIABLE_SIZE_STARTS(X, base, A)

namespace jaxcomm {

// Each host function's operation name, from the tables: what the wrapper that
// calls it (a handler, an eager call) enters (call.h, Entered).
template <auto Function>
inline constexpr std::string_view kOperationName = "jaxcomm";
#define JAXCOMM_OPERATION_NAME(name, function, ...) \
  template <>                                       \
  inline constexpr std::string_view kOperationName<&mpi::function> = #name;
JAXCOMM_OPERATIONS(JAXCOMM_OPERATION_NAME, _, JAXCOMM_ATTRIBUTE_NAME)
JAXCOMM_NONBLOCKING_OPERATIONS(JAXCOMM_OPERATION_NAME, _, JAXCOMM_ATTRIBUTE_NAME)
JAXCOMM_OPERATION_NAME(wait, Wait)
JAXCOMM_OPERATION_NAME(test, Test)
#undef JAXCOMM_OPERATION_NAME

// Whether a host function is a start (the non-blocking table): it posts requests.
template <auto Function>
inline constexpr bool kStarts = false;
#define JAXCOMM_STARTS(name, function, ...) \
  template <>                               \
  inline constexpr bool kStarts<&mpi::function> = true;
JAXCOMM_NONBLOCKING_OPERATIONS(JAXCOMM_STARTS, _, JAXCOMM_ATTRIBUTE_NAME)
#undef JAXCOMM_STARTS

}  // namespace jaxcomm

#endif  // JAXCOMM_OPERATIONS_H_
