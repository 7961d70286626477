// The collectives that move data without reducing it (collectives.cc), and the
// barrier.
#ifndef JAXCOMM_COLLECTIVES_H_
#define JAXCOMM_COLLECTIVES_H_

#include <mpi.h>

#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "binding.h"

namespace jaxcomm::mpi {

ffi::Error Bcast(Token, Buffer x, TokenOut, Result out, int64_t comm, bool check, int32_t root);
ffi::Error Gather(Token, Buffer x, TokenOut, Result out, int64_t comm, bool check, int32_t root);
ffi::Error Allgather(Token, Buffer x, TokenOut, Result out, int64_t comm, bool check);
ffi::Error Scatter(Token, Buffer x, TokenOut, Result out, int64_t comm, bool check, int32_t root);
ffi::Error Alltoall(Token, Buffer x, TokenOut, Result out, int64_t comm, bool check);
// On a Cartesian or distributed-graph communicator, whose neighbours MPI knows
// (neighborhood): neighbor_allgather gives every source's x, (sources, *x.shape);
// neighbor_alltoall sends block j of x (destinations, *s) to destination j and
// gives (sources, *s), block i from source i. On a grid, blocks from beyond a
// non-periodic edge are zeros.
ffi::Error NeighborAllgather(Token, Buffer x, TokenOut, Result out, int64_t comm, bool check);
ffi::Error NeighborAlltoall(Token, Buffer x, TokenOut, Result out, int64_t comm, bool check);
ffi::Error Barrier(Token, TokenOut, int64_t comm, bool check);

// A neighbourhood communicator's neighbours: how many blocks arrive (sources)
// and leave (destinations). On a Cartesian grid both are its neighbours in MPI's
// order (along each dimension the lower, then the upper one; MPI_PROC_NULL
// beyond an edge), in `grid`; a distributed graph leaves `grid` empty.
struct Neighborhood {
  int sources = 0;
  int destinations = 0;
  std::vector<int> grid;
};
// comm's neighbourhood, or null if comm has no Cartesian or distributed-graph
// topology. Asked once, when jaxcomm registers comm (call.h, register_comm): a
// handler takes it from its Call (Call::neighborhood).
std::shared_ptr<const Neighborhood> neighborhood_of(MPI_Comm comm);
// An error naming `operation` unless `out` holds a block per source along its
// leading axis and, for an alltoall, `x` one per destination.
ffi::Error check_blocks(std::string_view operation, const Neighborhood& hood,
                        const ffi::AnyBuffer& out, const Buffer* x);
// The elements of one block of `blocks`, whose leading axis counts them.
int64_t block_elements(const ffi::AnyBuffer& blocks);
// MPI leaves the blocks from MPI_PROC_NULL neighbours unwritten: zeros there.
void zero_missing(char* blocks, const Neighborhood& hood, int64_t block_bytes);

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
