// The non-blocking starts (host memory only; nonblocking.cc): each posts MPI's
// I-form and returns a one-element `request` buffer for Wait (requests.h); `keep`
// is x passed through. ibcast works in place: XLA passes x's buffer as `out`.
#ifndef JAXCOMM_NONBLOCKING_H_
#define JAXCOMM_NONBLOCKING_H_

#include <cstdint>
#include <utility>

#include "binding.h"

namespace jaxcomm {

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

namespace mpi {

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
// On a Cartesian or graph communicator, as neighbor_allgather and neighbor_alltoall
// (collectives.h).
ffi::Error IneighborAllgather(Token, Buffer x, TokenOut, Result out, Result request, Result keep,
                              int64_t comm, bool check);
ffi::Error IneighborAlltoall(Token, Buffer x, TokenOut, Result out, Result request, Result keep,
                             int64_t comm, bool check);
ffi::Error Isend(Token, Buffer x, TokenOut, Result request, Result keep, int64_t comm, bool check,
                 int32_t dest, int32_t tag);
ffi::Error Irecv(Token, TokenOut, Result out, Result request, int64_t comm, bool check,
                 int32_t source, int32_t tag);
// isend with the tag of `status` (source, tag), known at run time: a cotangent
// going back to the sender of a message received from MPI_ANY_TAG.
ffi::Error ItaggedSend(Token, Buffer x, Buffer status, TokenOut, Result request, Result keep,
                       int64_t comm, bool check, int32_t dest);
// Completes the request named by `request`; its other operands keep buffers
// alive, but for a receive's second: the status of the message whose tangent it
// takes, if any (requests.h, complete). Results: the received data (aliased with
// the start's), then the status.
ffi::Error Wait(Token, Buffer request, ffi::RemainingArgs, TokenOut, ffi::RemainingRets results);
// Whether the request named by `request` has completed (requests.h, test).
ffi::Error Test(Token, Buffer request, TokenOut, ffi::Result<ffi::BufferR0<ffi::PRED>> done);

}  // namespace mpi
}  // namespace jaxcomm

// X(name, function, binding, attributes) for each start, as operations.h
// describes. A start returns its result's buffer, the request and x passed
// through (isend has no result; irecv and ibcast no x: ibcast works in x's buffer).
// itagged_send, which AD alone posts, is isend with its tag read from a status.
#define JAXCOMM_NONBLOCKING(X, base, A)                                                          \
  X(iallreduce, Iallreduce, (one_input<mpi::Buffer, mpi::Buffer, mpi::Buffer>(base)),            \
    A(int32_t, op))                                                                              \
  X(ireduce_scatter, IreduceScatter, (one_input<mpi::Buffer, mpi::Buffer, mpi::Buffer>(base)),   \
    A(int32_t, op))                                                                              \
  X(ibcast, Ibcast, (one_input<mpi::Buffer, mpi::Buffer>(base)), A(int32_t, root))               \
  X(iallgather, Iallgather, (one_input<mpi::Buffer, mpi::Buffer, mpi::Buffer>(base)), )          \
  X(ialltoall, Ialltoall, (one_input<mpi::Buffer, mpi::Buffer, mpi::Buffer>(base)), )            \
  X(ineighbor_allgather, IneighborAllgather,                                                     \
    (one_input<mpi::Buffer, mpi::Buffer, mpi::Buffer>(base)), )                                  \
  X(ineighbor_alltoall, IneighborAlltoall,                                                       \
    (one_input<mpi::Buffer, mpi::Buffer, mpi::Buffer>(base)), )                                  \
  X(isend, Isend, (one_input<mpi::Buffer, mpi::Buffer>(base)), A(int32_t, dest) A(int32_t, tag)) \
  X(itagged_send, ItaggedSend,                                                                   \
    with_comm(base.Arg<mpi::Token>()                                                             \
                  .Arg<mpi::Buffer>()                                                            \
                  .Arg<mpi::Buffer>()                                                            \
                  .Ret<mpi::Token>()                                                             \
                  .Ret<mpi::Buffer>()                                                            \
                  .Ret<mpi::Buffer>()),                                                          \
    A(int32_t, dest))                                                                            \
  X(irecv, Irecv, (no_input<mpi::Buffer, mpi::Buffer>(base)), A(int32_t, source) A(int32_t, tag))

#endif  // JAXCOMM_NONBLOCKING_H_
