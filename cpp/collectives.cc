// The collective handlers on host memory that move data without reducing it:
// each calls the MPI library's own collective, tuned for the network, topology
// and rank count. What jaxcomm adds around it: checking mode (call.h), pieces or
// derived datatypes beyond 2^31 - 1 elements, MPI_IN_PLACE when XLA gives the
// output the input's buffer, and outputs that are written on every rank.
#include "collectives.h"

#include <mpi.h>

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "call.h"
#include "datatypes.h"
#include "jaxcomm/jaxcomm.h"
#include "memory.h"
#include "started.h"

namespace jaxcomm::mpi {

ffi::Error Bcast(Token, Buffer x, TokenOut, Result out, int64_t comm_key, bool check,
                 int32_t root) {
  Call call(comm_key, check, x);
  auto [error, comm, type] = start(call.param("root", root), x);
  if (error.failure()) return error;
  // The root sends from x (MPI only reads it there) and the others receive in out.
  const bool is_root = comm_rank(comm) == root;
  if (is_root) copy_if_distinct(out, x);
  char* data = is_root ? bytes(x) : bytes(out);
  const size_t width = ffi::ByteWidth(x.element_type());
  JAXCOMM_CHECK_MPI(for_each_piece(x.element_count(),
                                   [&](int64_t offset, int n) {
                                     return MPI_Bcast(data + offset * width, n, type, root, comm);
                                   }),
                    call.operation(), comm);
  return ffi::Error::Success();
}

ffi::Error Allgather(Token, Buffer x, TokenOut, Result out, int64_t comm_key, bool check) {
  Call call(comm_key, check, x);
  auto [error, comm, type] = start(call, x);
  if (error.failure()) return error;
  Block block(x.element_count(), type);
  JAXCOMM_CHECK_MPI(MPI_Allgather(x.untyped_data(), block.count(), block.type(),
                                  out->untyped_data(), block.count(), block.type(), comm),
                    call.operation(), comm);
  return ffi::Error::Success();
}

namespace {

// gather and scatter: a block per rank between the root's rows and each rank's
// own block (MPI's functions share a signature).
template <bool kGather>
ffi::Error rooted_blocks(const Buffer& x, Result& out, int64_t comm_key, bool check, int32_t root) {
  const Buffer& own = kGather ? x : *out;  // this rank's block
  Call call(comm_key, check, own);
  auto [error, comm, type] = start(call.param("root", root), x);
  if (error.failure()) return error;
  Block block(own.element_count(), type);
  const bool is_root = comm_rank(comm) == root;
  // gather's non-root ranks get their input back, so the output is always written.
  if (kGather && !is_root) copy_if_distinct(out, x);
  auto* exchange = kGather ? &MPI_Gather : &MPI_Scatter;
  JAXCOMM_CHECK_MPI(exchange(kGather || is_root ? x.untyped_data() : nullptr, block.count(),
                             block.type(), kGather && !is_root ? nullptr : out->untyped_data(),
                             block.count(), block.type(), root, comm),
                    call.operation(), comm);
  return ffi::Error::Success();
}

}  // namespace

ffi::Error Gather(Token, Buffer x, TokenOut, Result out, int64_t comm_key, bool check,
                  int32_t root) {
  return rooted_blocks<true>(x, out, comm_key, check, root);
}

ffi::Error Scatter(Token, Buffer x, TokenOut, Result out, int64_t comm_key, bool check,
                   int32_t root) {
  return rooted_blocks<false>(x, out, comm_key, check, root);
}

ffi::Error Alltoall(Token, Buffer x, TokenOut, Result out, int64_t comm_key, bool check) {
  Call call(comm_key, check, x);
  auto [error, comm, type] = start(call, x);
  if (error.failure()) return error;
  Block block(x.element_count() / comm_size(comm), type);
  const void* in = bytes(out) == bytes(x) ? MPI_IN_PLACE : x.untyped_data();
  JAXCOMM_CHECK_MPI(MPI_Alltoall(in, block.count(), block.type(), out->untyped_data(),
                                 block.count(), block.type(), comm),
                    call.operation(), comm);
  return ffi::Error::Success();
}

ffi::Error Barrier(Token, TokenOut, int64_t comm_key, bool check) {
  Call call(comm_key, check);
  if (auto err = call.agree(); err.failure()) return err;
  JAXCOMM_CHECK_MPI(MPI_Barrier(call.comm()), call.operation(), call.comm());
  return ffi::Error::Success();
}

}  // namespace jaxcomm::mpi

namespace jaxcomm::mpi {

std::shared_ptr<const Neighborhood> neighborhood_of(MPI_Comm comm) {
  int kind = MPI_UNDEFINED;
  MPI_Topo_test(comm, &kind);
  if (kind != MPI_DIST_GRAPH && kind != MPI_CART) return nullptr;
  auto found = std::make_shared<Neighborhood>();
  if (kind == MPI_DIST_GRAPH) {
    int weighted = 0;
    MPI_Dist_graph_neighbors_count(comm, &found->sources, &found->destinations, &weighted);
    return found;
  }
  int dims = 0;
  MPI_Cartdim_get(comm, &dims);
  for (int d = 0; d < dims; ++d) {
    int lower = MPI_PROC_NULL, upper = MPI_PROC_NULL;
    MPI_Cart_shift(comm, d, 1, &lower, &upper);
    found->grid.push_back(lower);
    found->grid.push_back(upper);
  }
  found->sources = found->destinations = 2 * dims;
  return found;
}

ffi::Error check_blocks(std::string_view operation, const Neighborhood& hood,
                        const ffi::AnyBuffer& out, const Buffer* x) {
  auto leading = [](const ffi::AnyBuffer& b) {
    return b.dimensions().size() ? b.dimensions()[0] : int64_t{-1};
  };
  if (leading(out) == hood.sources && (x == nullptr || leading(*x) == hood.destinations))
    return ffi::Error::Success();
  return invalid_argument(operation, "blocks for " + std::to_string(hood.sources) +
                                         " sources and " + std::to_string(hood.destinations) +
                                         " destinations do not match the communicator's");
}

int64_t block_elements(const ffi::AnyBuffer& blocks) {
  int64_t elements = 1;
  for (size_t d = 1; d < blocks.dimensions().size(); ++d) elements *= blocks.dimensions()[d];
  return elements;
}

void zero_missing(char* blocks, const Neighborhood& hood, int64_t block_bytes) {
  static const char nothing = 0;
  for (size_t k = 0; k < hood.grid.size(); ++k)
    if (hood.grid[k] == MPI_PROC_NULL)
      memory().fill(blocks + k * block_bytes, &nothing, 1, block_bytes);
}

ffi::Error NeighborAllgather(Token, Buffer x, TokenOut, Result out, int64_t comm_key, bool check) {
  Call call(comm_key, check, x);
  auto [error, comm, type] = start(call, x);
  if (error.failure()) return error;
  const Neighborhood* hood = nullptr;
  if (auto err = call.neighborhood(&hood); err.failure()) return err;
  if (auto err = check_blocks(call.operation(), *hood, *out, nullptr); err.failure()) return err;
  Block block(x.element_count(), type);
  JAXCOMM_CHECK_MPI(MPI_Neighbor_allgather(x.untyped_data(), block.count(), block.type(),
                                           out->untyped_data(), block.count(), block.type(), comm),
                    call.operation(), comm);
  zero_missing(bytes(out), *hood, static_cast<int64_t>(x.size_bytes()));
  return ffi::Error::Success();
}

// Ranks of a graph send different numbers of blocks: checking mode compares one.
ffi::Error NeighborAlltoall(Token, Buffer x, TokenOut, Result out, int64_t comm_key, bool check) {
  Call call(comm_key, check, x);
  auto [error, comm, type] = start(call.per_block(), x);
  if (error.failure()) return error;
  const Neighborhood* hood = nullptr;
  if (auto err = call.neighborhood(&hood); err.failure()) return err;
  if (auto err = check_blocks(call.operation(), *hood, *out, &x); err.failure()) return err;
  const int64_t elements = block_elements(x);
  Block block(elements, type);
  JAXCOMM_CHECK_MPI(MPI_Neighbor_alltoall(x.untyped_data(), block.count(), block.type(),
                                          out->untyped_data(), block.count(), block.type(), comm),
                    call.operation(), comm);
  zero_missing(bytes(out), *hood,
               elements * static_cast<int64_t>(ffi::ByteWidth(x.element_type())));
  return ffi::Error::Success();
}

}  // namespace jaxcomm::mpi
