// How the MPI library pairs the blocks of a peer that is a neighbour twice in
// its non-blocking neighbour exchanges, and what jaxcomm does where that is not
// MPI's standard. Shared by nonblocking.cc (ineighbor_alltoall) and
// variable_size.cc (ineighbor_alltoallv).
#ifndef JAXCOMM_PAIRING_H_
#define JAXCOMM_PAIRING_H_

#include <mpi.h>

#include <cstddef>
#include <vector>

namespace jaxcomm::mpi {

// Whether the library's non-blocking neighbour exchanges deliver block s of the
// sender into block s ^ 1 of the receiver where a Cartesian dimension's lower
// and upper neighbours are one rank (a periodic dimension of 1 or 2 ranks), as
// MPI 4.1 (8.6) says. Open MPI's deliver it into block s (5.0.11; open-mpi/ompi
// issue 14430): a wrong value jaxcomm must not return. Its blocking forms, and
// both forms on a graph (whose blocks pair in the order of its lists), are
// right. Asked once, of MPI_Ineighbor_alltoall on a periodic ring of this rank
// alone; MPI_Ineighbor_alltoallv posts its blocks as it does (both libraries).
inline bool posted_pairs_as_standard() {
  static const bool standard = [] {
    MPI_Comm ring;
    int dims = 1, periods = 1;
    MPI_Cart_create(MPI_COMM_SELF, 1, &dims, &periods, 0, &ring);
    int sent[2] = {0, 1}, received[2] = {-1, -1};
    MPI_Request request;
    MPI_Ineighbor_alltoall(sent, 1, MPI_INT, received, 1, MPI_INT, ring, &request);
    MPI_Wait(&request, MPI_STATUS_IGNORE);
    MPI_Comm_free(&ring);
    return received[0] == sent[1];
  }();
  return standard;
}

// Where the library pairs such a dimension's blocks s to s, sending the two
// swapped delivers each where the standard puts it: every rank along the
// dimension has the one neighbour both ways. Calls swap(lower) for each such
// dimension of `grid` (Neighborhood::grid: its lower and upper neighbours,
// dimension after dimension) with the index of its lower block; for none on a
// graph (no grid) or where the library pairs as the standard says. (An
// allgather's two blocks to that rank are one: they need no swap.)
template <typename Swap>
void pair_as_standard(const std::vector<int>& grid, Swap&& swap) {
  for (size_t lower = 0; lower + 1 < grid.size(); lower += 2)
    if (grid[lower] == grid[lower + 1] && grid[lower] != MPI_PROC_NULL &&
        !posted_pairs_as_standard())
      swap(lower);
}

}  // namespace jaxcomm::mpi

#endif  // JAXCOMM_PAIRING_H_
