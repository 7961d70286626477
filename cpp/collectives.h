// The collectives that move data without reducing it (collectives.cc), and the
// barrier.
#ifndef JAXCOMM_COLLECTIVES_H_
#define JAXCOMM_COLLECTIVES_H_

#include <mpi.h>

#include <cstdint>
#include <string_view>
#include <vector>

#include "binding.h"

namespace jaxcomm::mpi {

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
ffi::Error Barrier(Token, TokenOut, int64_t comm, bool check);

// The neighbours of a Cartesian communicator in MPI's order (along each
// dimension, the lower then the upper one; MPI_PROC_NULL beyond an edge) into
// `found`, or an error naming `operation` if comm is not Cartesian.
ffi::Error cartesian_neighbors(MPI_Comm comm, std::string_view operation, std::vector<int>* found);
// MPI leaves the blocks from MPI_PROC_NULL neighbours unwritten: zeros there.
void zero_missing(char* blocks, const std::vector<int>& from, int64_t block_bytes);

}  // namespace jaxcomm::mpi

// X(name, function, binding, attributes) for each, as operations.h describes.
#define JAXCOMM_COLLECTIVES(X, base, A)                                    \
  X(bcast, Bcast, one_input<mpi::Buffer>(base), A(int32_t, root))          \
  X(gather, Gather, one_input<mpi::Buffer>(base), A(int32_t, root))        \
  X(allgather, Allgather, one_input<mpi::Buffer>(base), )                  \
  X(scatter, Scatter, one_input<mpi::Buffer>(base), A(int32_t, root))      \
  X(alltoall, Alltoall, one_input<mpi::Buffer>(base), )                    \
  X(neighbor_allgather, NeighborAllgather, one_input<mpi::Buffer>(base), ) \
  X(neighbor_alltoall, NeighborAlltoall, one_input<mpi::Buffer>(base), )   \
  X(barrier, Barrier, no_input(base), )

#endif  // JAXCOMM_COLLECTIVES_H_
