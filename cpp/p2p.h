// The blocking point-to-point operations (p2p.cc), and what they share with the
// non-blocking ones (nonblocking.cc): messages split into int-sized pieces, and
// the check that each piece arrived whole.
#ifndef JAXCOMM_P2P_H_
#define JAXCOMM_P2P_H_

#include <mpi.h>

#include <cstdint>
#include <string>
#include <string_view>

#include "binding.h"
#include "jaxcomm/jaxcomm.h"
#include "lockstep.h"

namespace jaxcomm::mpi {

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

// How many messages for_each_piece splits `count` elements into.
inline int64_t pieces(int64_t count) {
  return count == 0 ? 1 : (count + kMaxCount - 1) / kMaxCount;
}

// check_mpi of a receive's `code`. MPI's error for a message longer than the
// buffer comes after the message has been received whole: it is paired
// (lockstep.h) where `whole` says that no other piece of it was left unreceived.
inline ffi::Error check_received(int code, std::string_view operation, MPI_Comm comm, bool whole) {
  ffi::Error error = check_mpi(code, operation, comm);
  int error_class = MPI_SUCCESS;
  if (error.failure() && whole && MPI_Error_class(code, &error_class) == MPI_SUCCESS &&
      error_class == MPI_ERR_TRUNCATE)
    return paired(std::move(error));
  return error;
}

// A message shorter than the buffer is an error, not a partly written result.
inline ffi::Error check_count(const MPI_Status& s, MPI_Datatype type, int expected,
                              std::string_view operation) {
  if (s.MPI_SOURCE == MPI_PROC_NULL) return ffi::Error::Success();
  int count = 0;
  MPI_Get_count(&s, type, &count);
  if (count == expected) return ffi::Error::Success();
  return invalid_argument(operation, "received " + std::to_string(count) + " elements from rank " +
                                         std::to_string(s.MPI_SOURCE) +
                                         " but the receive buffer holds " +
                                         std::to_string(expected) +
                                         " (the sender's array and the template differ in size)");
}

}  // namespace jaxcomm::mpi

// X(name, function, binding, attributes) for each, as operations.h describes.
#define JAXCOMM_P2P(X, base, A)                                                  \
  X(send, Send, one_input<>(base), A(int32_t, dest) A(int32_t, tag))             \
  X(recv, Recv, (no_input<mpi::Buffer, mpi::StatusBuffer>(base)),                \
    A(int32_t, source) A(int32_t, tag))                                          \
  X(sendrecv, Sendrecv, (one_input<mpi::Buffer, mpi::StatusBuffer>(base)),       \
    A(int32_t, source) A(int32_t, dest) A(int32_t, sendtag) A(int32_t, recvtag)) \
  X(tagged_sendrecv, TaggedSendrecv,                                             \
    with_comm(base.Arg<mpi::Token>()                                             \
                  .Arg<mpi::Buffer>()                                            \
                  .Arg<mpi::Buffer>()                                            \
                  .Ret<mpi::Token>()                                             \
                  .Ret<mpi::Buffer>()                                            \
                  .Ret<mpi::StatusBuffer>()),                                    \
    A(int32_t, source) A(int32_t, dest))

#endif  // JAXCOMM_P2P_H_
