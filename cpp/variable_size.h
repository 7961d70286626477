// The variable-size exchanges (variable_size.cc) move rows of x (its leading
// axis); out takes the rows received, in rank order, then zeros. The counts
// (integer buffers of any integer dtype, counts.h) received are given, or with
// `exchange` learnt from the senders. Under vmap x, the counts and the results
// have a leading batch axis. With `agree` every rank learns whether any rank's
// counts or capacity fail (one MPI_Allreduce) and all raise before a row moves:
// the JVP rules set it on a primal exchange, whose tangent or cotangent exchange
// may run in another computation, or never.
#ifndef JAXCOMM_VARIABLE_SIZE_H_
#define JAXCOMM_VARIABLE_SIZE_H_

#include <cstdint>
#include <utility>

#include "binding.h"

namespace jaxcomm {

// token, x, counts, given counts -> token, Results..., with the communicator's
// attributes.
template <typename... Results, typename Binding>
auto variable_size(Binding&& base) {
  return with_comm(returning<Results...>(std::forward<Binding>(base)
                                             .template Arg<mpi::Token>()
                                             .template Arg<mpi::Buffer>()
                                             .template Arg<mpi::Buffer>()
                                             .template Arg<mpi::Buffer>()
                                             .template Ret<mpi::Token>()));
}

namespace mpi {

// alltoallv: send_counts[i] ([size]) rows to rank i; recv_counts int32[size].
ffi::Error Alltoallv(Token, Buffer x, Buffer send_counts, Buffer given_counts, TokenOut, Result out,
                     Result recv_counts, int64_t comm, bool check, int32_t exchange, int32_t agree);
// On a Cartesian or graph communicator: neighbor_alltoallv sends send_counts[j]
// ([destinations]) rows to destination j; recv_counts int32[sources], in the
// order of its sources. A source beyond a grid's edge sends nothing (count 0).
ffi::Error NeighborAlltoallv(Token, Buffer x, Buffer send_counts, Buffer given_counts, TokenOut,
                             Result out, Result recv_counts, int64_t comm, bool check,
                             int32_t exchange, int32_t agree);
// neighbor_allgatherv: `count` ([]) rows to every destination; counts int32[sources].
ffi::Error NeighborAllgatherv(Token, Buffer x, Buffer count, Buffer given_counts, TokenOut,
                              Result out, Result counts, int64_t comm, bool check, int32_t exchange,
                              int32_t agree);
// allgatherv: `count` ([]) rows from every rank to every rank; counts int32[size].
ffi::Error Allgatherv(Token, Buffer x, Buffer count, Buffer given_counts, TokenOut, Result out,
                      Result counts, int64_t comm, bool check, int32_t exchange, int32_t agree);
// gatherv: `count` rows from every rank to root; counts int32[size] (on root).
ffi::Error Gatherv(Token, Buffer x, Buffer count, Buffer given_counts, TokenOut, Result out,
                   Result counts, int64_t comm, bool check, int32_t root, int32_t exchange,
                   int32_t agree);
// scatterv: root's counts[i] ([size]) rows to rank i; count int32[].
ffi::Error Scatterv(Token, Buffer x, Buffer counts, Buffer given_count, TokenOut, Result out,
                    Result count, int64_t comm, bool check, int32_t root, int32_t exchange,
                    int32_t agree);
// The non-blocking alltoallv (host memory only): a start as nonblocking.h's, whose
// recv_counts are known, and returned, at the post.
ffi::Error Ialltoallv(Token, Buffer x, Buffer send_counts, Buffer given_counts, TokenOut,
                      Result out, Result request, Result keep, Result recv_counts, int64_t comm,
                      bool check, int32_t exchange, int32_t agree);
ffi::Error IneighborAlltoallv(Token, Buffer x, Buffer send_counts, Buffer given_counts, TokenOut,
                              Result out, Result request, Result keep, Result recv_counts,
                              int64_t comm, bool check, int32_t exchange, int32_t agree);
// The same of the gather family and scatterv; iallgatherv's count exchange (at
// the post) carries the capacities, so that every rank's wait raises when any
// rank's rows do not fit.
ffi::Error Iallgatherv(Token, Buffer x, Buffer count, Buffer given_counts, TokenOut, Result out,
                       Result request, Result keep, Result counts, int64_t comm, bool check,
                       int32_t exchange, int32_t agree);
ffi::Error IneighborAllgatherv(Token, Buffer x, Buffer count, Buffer given_counts, TokenOut,
                               Result out, Result request, Result keep, Result counts, int64_t comm,
                               bool check, int32_t exchange, int32_t agree);
ffi::Error Igatherv(Token, Buffer x, Buffer count, Buffer given_counts, TokenOut, Result out,
                    Result request, Result keep, Result counts, int64_t comm, bool check,
                    int32_t root, int32_t exchange, int32_t agree);
ffi::Error Iscatterv(Token, Buffer x, Buffer counts, Buffer given_count, TokenOut, Result out,
                     Result request, Result keep, Result count, int64_t comm, bool check,
                     int32_t root, int32_t exchange, int32_t agree);

}  // namespace mpi
}  // namespace jaxcomm

// X(name, function, binding, attributes) for each, as operations.h describes.
#define JAXCOMM_VARIABLE_SIZE(X, base, A)                                                     \
  X(alltoallv, Alltoallv, (variable_size<mpi::Buffer, mpi::Buffer>(base)),                    \
    A(int32_t, exchange) A(int32_t, agree))                                                   \
  X(allgatherv, Allgatherv, (variable_size<mpi::Buffer, mpi::Buffer>(base)),                  \
    A(int32_t, exchange) A(int32_t, agree))                                                   \
  X(gatherv, Gatherv, (variable_size<mpi::Buffer, mpi::Buffer>(base)),                        \
    A(int32_t, root) A(int32_t, exchange) A(int32_t, agree))                                  \
  X(scatterv, Scatterv, (variable_size<mpi::Buffer, mpi::Buffer>(base)),                      \
    A(int32_t, root) A(int32_t, exchange) A(int32_t, agree))                                  \
  X(neighbor_alltoallv, NeighborAlltoallv, (variable_size<mpi::Buffer, mpi::Buffer>(base)),   \
    A(int32_t, exchange) A(int32_t, agree))                                                   \
  X(neighbor_allgatherv, NeighborAllgatherv, (variable_size<mpi::Buffer, mpi::Buffer>(base)), \
    A(int32_t, exchange) A(int32_t, agree))

// The starts, as nonblocking.h's: the result's buffer, the request, x passed
// through, and the counts received.
#define JAXCOMM_VARIABLE_SIZE_STARTS(X, base, A)                                                   \
  X(ialltoallv, Ialltoallv,                                                                        \
    (variable_size<mpi::Buffer, mpi::Buffer, mpi::Buffer, mpi::Buffer>(base)),                     \
    A(int32_t, exchange) A(int32_t, agree))                                                        \
  X(ineighbor_alltoallv, IneighborAlltoallv,                                                       \
    (variable_size<mpi::Buffer, mpi::Buffer, mpi::Buffer, mpi::Buffer>(base)),                     \
    A(int32_t, exchange) A(int32_t, agree))                                                        \
  X(iallgatherv, Iallgatherv,                                                                      \
    (variable_size<mpi::Buffer, mpi::Buffer, mpi::Buffer, mpi::Buffer>(base)),                     \
    A(int32_t, exchange) A(int32_t, agree))                                                        \
  X(igatherv, Igatherv, (variable_size<mpi::Buffer, mpi::Buffer, mpi::Buffer, mpi::Buffer>(base)), \
    A(int32_t, root) A(int32_t, exchange) A(int32_t, agree))                                       \
  X(iscatterv, Iscatterv,                                                                          \
    (variable_size<mpi::Buffer, mpi::Buffer, mpi::Buffer, mpi::Buffer>(base)),                     \
    A(int32_t, root) A(int32_t, exchange) A(int32_t, agree))                                       \
  X(ineighbor_allgatherv, IneighborAllgatherv,                                                     \
    (variable_size<mpi::Buffer, mpi::Buffer, mpi::Buffer, mpi::Buffer>(base)),                     \
    A(int32_t, exchange) A(int32_t, agree))

#endif  // JAXCOMM_VARIABLE_SIZE_H_
