// jaxcomm's operations: the host-memory functions (one file per family, named
// as jaxcomm's Python modules are: reductions.cc, collectives.cc,
// variable_size.cc, p2p.cc, nonblocking.cc, replicated.cc), their XLA FFI bindings and the one
// table of targets that both backends register from. The CPU backend (cpu.cc) binds the functions
// directly; the CUDA backend (cuda.cc) binds them behind staging, with XLA's CUDA stream as an
// extra context argument.
#ifndef JAXCOMM_OPERATIONS_H_
#define JAXCOMM_OPERATIONS_H_

#include <cstdint>
#include <string_view>
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

ffi::Error Allreduce(Token, Buffer x, TokenOut, Result out, int64_t comm, bool check, int32_t op);
ffi::Error Reduce(Token, Buffer x, TokenOut, Result out, int64_t comm, bool check, int32_t op,
                  int32_t root);
ffi::Error Scan(Token, Buffer x, TokenOut, Result out, int64_t comm, bool check, int32_t op);
ffi::Error Exscan(Token, Buffer x, TokenOut, Result out, int64_t comm, bool check, int32_t op);
ffi::Error ReduceScatter(Token, Buffer x, TokenOut, Result out, int64_t comm, bool check,
                         int32_t op);
ffi::Error Bcast(Token, Buffer x, TokenOut, Result out, int64_t comm, bool check, int32_t root);
ffi::Error Gather(Token, Buffer x, TokenOut, Result out, int64_t comm, bool check, int32_t root);
ffi::Error Allgather(Token, Buffer x, TokenOut, Result out, int64_t comm, bool check);
ffi::Error Scatter(Token, Buffer x, TokenOut, Result out, int64_t comm, bool check, int32_t root);
ffi::Error Alltoall(Token, Buffer x, TokenOut, Result out, int64_t comm, bool check);
// On a Cartesian communicator, with its neighbours in MPI's order (along each
// dimension the lower, then the upper one): neighbor_allgather gives every
// neighbour's x, (2 * dims, *x.shape); neighbor_alltoall sends block k of x
// (2 * dims, *s) to neighbour k. Blocks from beyond a non-periodic edge are zeros.
ffi::Error NeighborAllgather(Token, Buffer x, TokenOut, Result out, int64_t comm, bool check);
ffi::Error NeighborAlltoall(Token, Buffer x, TokenOut, Result out, int64_t comm, bool check);
// The variable-size exchanges (variable_size.cc) move rows of x (its leading
// axis); out takes the rows received, in rank order, then zeros. The counts
// received are given (int32 buffers), or with `exchange` learnt from the senders.
// alltoallv: send_counts[i] (int32[size]) rows to rank i; recv_counts int32[size].
ffi::Error Alltoallv(Token, Buffer x, Buffer send_counts, Buffer given_counts, TokenOut, Result out,
                     Result recv_counts, int64_t comm, bool check, int32_t exchange);
// allgatherv: `count` (int32[]) rows from every rank to every rank; counts int32[size].
ffi::Error Allgatherv(Token, Buffer x, Buffer count, Buffer given_counts, TokenOut, Result out,
                      Result counts, int64_t comm, bool check, int32_t exchange);
// gatherv: `count` rows from every rank to root; counts int32[size] (on root).
ffi::Error Gatherv(Token, Buffer x, Buffer count, Buffer given_counts, TokenOut, Result out,
                   Result counts, int64_t comm, bool check, int32_t root, int32_t exchange);
// scatterv: root's counts[i] (int32[size]) rows to rank i; count int32[].
ffi::Error Scatterv(Token, Buffer x, Buffer counts, Buffer given_count, TokenOut, Result out,
                    Result count, int64_t comm, bool check, int32_t root, int32_t exchange);
ffi::Error Send(Token, Buffer x, TokenOut, int64_t comm, bool check, int32_t dest, int32_t tag);
// A receive's template gives its result's shape and dtype when traced, so XLA
// does not pass it (a template made for the call would cost a kernel filling it).
ffi::Error Recv(Token, TokenOut, Result out, Status status, int64_t comm, bool check,
                int32_t source, int32_t tag);
ffi::Error Sendrecv(Token, Buffer x, TokenOut, Result out, Status status, int64_t comm, bool check,
                    int32_t source, int32_t dest, int32_t sendtag, int32_t recvtag);
// sendrecv with (sendtag, recvtag) read from the int32[2] array `tags`.
ffi::Error TaggedSendrecv(Token, Buffer x, Buffer tags, TokenOut, Result out, Status status,
                          int64_t comm, bool check, int32_t source, int32_t dest);
ffi::Error Barrier(Token, TokenOut, int64_t comm, bool check);
// Non-blocking starts (host memory only): each posts MPI's I-form and returns a
// one-element `request` buffer for Wait (requests.h); `keep` is x passed through.
// ibcast works in place: XLA passes x's buffer as `out`.
ffi::Error Iallreduce(Token, Buffer x, TokenOut, Result out, Result request, Result keep,
                      int64_t comm, bool check, int32_t op);
ffi::Error IreduceScatter(Token, Buffer x, TokenOut, Result out, Result request, Result keep,
                          int64_t comm, bool check, int32_t op);
ffi::Error Ibcast(Token, Buffer x, TokenOut, Result out, Result request, int64_t comm, bool check,
                  int32_t root);
ffi::Error Iallgather(Token, Buffer x, TokenOut, Result out, Result request, Result keep,
                      int64_t comm, bool check);
ffi::Error Ialltoall(Token, Buffer x, TokenOut, Result out, Result request, Result keep,
                     int64_t comm, bool check);
ffi::Error Isend(Token, Buffer x, TokenOut, Result request, Result keep, int64_t comm, bool check,
                 int32_t dest, int32_t tag);
ffi::Error Irecv(Token, TokenOut, Result out, Result request, int64_t comm, bool check,
                 int32_t source, int32_t tag);
// Completes the request named by `request`; its other operands only keep buffers
// alive. Results: the received data (aliased with the start's), then the status.
ffi::Error Wait(Token, Buffer request, ffi::RemainingArgs, TokenOut, ffi::RemainingRets results);
// Whether the request named by `request` has completed (requests.h, test).
ffi::Error Test(Token, Buffer request, TokenOut, ffi::Result<ffi::BufferR0<ffi::PRED>> done);

ffi::Error CheckReplicated(Token, Buffer x, TokenOut, Result out, int64_t comm, bool check,
                           std::string_view operation);

}  // namespace mpi

// Bindings start after the backend's context arguments `base` (none on CPU, the
// stream on CUDA); every op's buffers are followed by its communicator's key
// "comm" (call.h, register_comm) and its checking-mode flag "check".
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

// token, x -> token, Results..., with the communicator's attributes. In the table
// below, a binding whose template arguments hold a comma is in parentheses.
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

// token -> token, Results..., with the communicator's attributes: the receives.
template <typename... Results, typename Binding>
auto no_input(Binding&& base) {
  auto inputs = std::forward<Binding>(base).template Arg<mpi::Token>().template Ret<mpi::Token>();
  return with_comm(returning<Results...>(std::move(inputs)));
}

// token, x, counts, given counts -> token, result, counts, with the
// communicator's attributes: the variable-size exchanges.
template <typename Binding>
auto variable_size(Binding&& base) {
  return with_comm(std::forward<Binding>(base)
                       .template Arg<mpi::Token>()
                       .template Arg<mpi::Buffer>()
                       .template Arg<mpi::Buffer>()
                       .template Arg<mpi::Buffer>()
                       .template Ret<mpi::Token>()
                       .template Ret<mpi::Buffer>()
                       .template Ret<mpi::Buffer>());
}

// X(name, function, binding, attributes) for every operation: the FFI target is
// "jaxcomm_<name>" on every platform. `attributes` lists the operation's own
// attributes, after "comm" and "check", as A(type, name) in binding order; the
// caller's A makes them `.Attr<type>("name")` to complete the binding
// (JAXCOMM_BIND_ATTRIBUTE) or lists their names (the Python side derives its
// primitives' attributes, and the eager path their order, from these).
#define JAXCOMM_OPERATIONS(X, base, A)                                              \
  X(allreduce, Allreduce, one_input<mpi::Buffer>(base), A(int32_t, op))             \
  X(reduce, Reduce, one_input<mpi::Buffer>(base), A(int32_t, op) A(int32_t, root))  \
  X(scan, Scan, one_input<mpi::Buffer>(base), A(int32_t, op))                       \
  X(exscan, Exscan, one_input<mpi::Buffer>(base), A(int32_t, op))                   \
  X(reduce_scatter, ReduceScatter, one_input<mpi::Buffer>(base), A(int32_t, op))    \
  X(bcast, Bcast, one_input<mpi::Buffer>(base), A(int32_t, root))                   \
  X(gather, Gather, one_input<mpi::Buffer>(base), A(int32_t, root))                 \
  X(allgather, Allgather, one_input<mpi::Buffer>(base), )                           \
  X(scatter, Scatter, one_input<mpi::Buffer>(base), A(int32_t, root))               \
  X(alltoall, Alltoall, one_input<mpi::Buffer>(base), )                             \
  X(neighbor_allgather, NeighborAllgather, one_input<mpi::Buffer>(base), )          \
  X(neighbor_alltoall, NeighborAlltoall, one_input<mpi::Buffer>(base), )            \
  X(alltoallv, Alltoallv, variable_size(base), A(int32_t, exchange))                \
  X(allgatherv, Allgatherv, variable_size(base), A(int32_t, exchange))              \
  X(gatherv, Gatherv, variable_size(base), A(int32_t, root) A(int32_t, exchange))   \
  X(scatterv, Scatterv, variable_size(base), A(int32_t, root) A(int32_t, exchange)) \
  X(send, Send, one_input<>(base), A(int32_t, dest) A(int32_t, tag))                \
  X(recv, Recv, (no_input<mpi::Buffer, mpi::StatusBuffer>(base)),                   \
    A(int32_t, source) A(int32_t, tag))                                             \
  X(sendrecv, Sendrecv, (one_input<mpi::Buffer, mpi::StatusBuffer>(base)),          \
    A(int32_t, source) A(int32_t, dest) A(int32_t, sendtag) A(int32_t, recvtag))    \
  X(tagged_sendrecv, TaggedSendrecv,                                                \
    with_comm(base.Arg<mpi::Token>()                                                \
                  .Arg<mpi::Buffer>()                                               \
                  .Arg<mpi::Buffer>()                                               \
                  .Ret<mpi::Token>()                                                \
                  .Ret<mpi::Buffer>()                                               \
                  .Ret<mpi::StatusBuffer>()),                                       \
    A(int32_t, source) A(int32_t, dest))                                            \
  X(barrier, Barrier, with_comm(base.Arg<mpi::Token>().Ret<mpi::Token>()), )        \
  X(check_replicated, CheckReplicated, one_input<mpi::Buffer>(base), A(std::string_view, operation))

#define JAXCOMM_BIND_ATTRIBUTE(type, name) .Attr<type>(#name)
#define JAXCOMM_ATTRIBUTE_NAME(type, name) #name,

// The non-blocking starts, as JAXCOMM_OPERATIONS; the CPU backend registers them,
// jaxcomm_wait and jaxcomm_test. A start returns its result's buffer, the request
// and x passed through (isend has no result; irecv and ibcast no x: ibcast works
// in x's buffer).
#define JAXCOMM_NONBLOCKING_OPERATIONS(X, base, A)                                               \
  X(iallreduce, Iallreduce, (one_input<mpi::Buffer, mpi::Buffer, mpi::Buffer>(base)),            \
    A(int32_t, op))                                                                              \
  X(ireduce_scatter, IreduceScatter, (one_input<mpi::Buffer, mpi::Buffer, mpi::Buffer>(base)),   \
    A(int32_t, op))                                                                              \
  X(ibcast, Ibcast, (one_input<mpi::Buffer, mpi::Buffer>(base)), A(int32_t, root))               \
  X(iallgather, Iallgather, (one_input<mpi::Buffer, mpi::Buffer, mpi::Buffer>(base)), )          \
  X(ialltoall, Ialltoall, (one_input<mpi::Buffer, mpi::Buffer, mpi::Buffer>(base)), )            \
  X(isend, Isend, (one_input<mpi::Buffer, mpi::Buffer>(base)), A(int32_t, dest) A(int32_t, tag)) \
  X(irecv, Irecv, (no_input<mpi::Buffer, mpi::Buffer>(base)), A(int32_t, source) A(int32_t, tag))

// Each host function's operation name, from the tables above: what the wrapper
// that calls it (a handler, an eager call) enters (call.h, Entered).
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

template <typename Binding>
auto waiting(Binding&& base) {
  return std::forward<Binding>(base)
      .template Arg<mpi::Token>()
      .template Arg<mpi::Buffer>()
      .RemainingArgs()
      .template Ret<mpi::Token>()
      .RemainingRets();
}

template <typename Binding>
auto testing(Binding&& base) {
  return std::forward<Binding>(base)
      .template Arg<mpi::Token>()
      .template Arg<mpi::Buffer>()
      .template Ret<mpi::Token>()
      .template Ret<ffi::BufferR0<ffi::PRED>>();
}

}  // namespace jaxcomm

#endif  // JAXCOMM_OPERATIONS_H_
