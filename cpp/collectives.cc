// The collective handlers on host memory that move data without reducing it:
// each calls the MPI library's own collective, tuned for the network, topology
// and rank count. What jaxcomm adds around it: checking mode (call.h), pieces or
// derived datatypes beyond 2^31 - 1 elements, MPI_IN_PLACE when XLA gives the
// output the input's buffer, and outputs that are written on every rank.
#include "collectives.h"

#include <mpi.h>

#include <cstdint>
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

ffi::Error cartesian_neighbors(MPI_Comm comm, std::string_view operation, std::vector<int>* found) {
  int kind = MPI_UNDEFINED;
  MPI_Topo_test(comm, &kind);
  if (kind != MPI_CART)
    return invalid_argument(operation, "needs a Cartesian communicator (create_cart)");
  int dims = 0;
  MPI_Cartdim_get(comm, &dims);
  found->clear();
  for (int d = 0; d < dims; ++d) {
    int lower = MPI_PROC_NULL, upper = MPI_PROC_NULL;
    MPI_Cart_shift(comm, d, 1, &lower, &upper);
    found->push_back(lower);
    found->push_back(upper);
  }
  return ffi::Error::Success();
}

void zero_missing(char* blocks, const std::vector<int>& from, int64_t block_bytes) {
  static const char nothing = 0;
  for (size_t k = 0; k < from.size(); ++k)
    if (from[k] == MPI_PROC_NULL) memory().fill(blocks + k * block_bytes, &nothing, 1, block_bytes);
}

ffi::Error NeighborAllgather(Token, Buffer x, TokenOut, Result out, int64_t comm_key, bool check) {
  Call call(comm_key, check, x);
  auto [error, comm, type] = start(call, x);
  if (error.failure()) return error;
  std::vector<int> from;
  if (auto err = cartesian_neighbors(comm, call.operation(), &from); err.failure()) return err;
  Block block(x.element_count(), type);
  JAXCOMM_CHECK_MPI(MPI_Neighbor_allgather(x.untyped_data(), block.count(), block.type(),
                                           out->untyped_data(), block.count(), block.type(), comm),
                    call.operation(), comm);
  zero_missing(bytes(out), from, static_cast<int64_t>(x.size_bytes()));
  return ffi::Error::Success();
}

ffi::Error NeighborAlltoall(Token, Buffer x, TokenOut, Result out, int64_t comm_key, bool check) {
  Call call(comm_key, check, x);
  auto [error, comm, type] = start(call, x);
  if (error.failure()) return error;
  std::vector<int> from;
  if (auto err = cartesian_neighbors(comm, call.operation(), &from); err.failure()) return err;
  const int64_t blocks = static_cast<int64_t>(from.size());
  Block block(blocks ? x.element_count() / blocks : 0, type);
  JAXCOMM_CHECK_MPI(MPI_Neighbor_alltoall(x.untyped_data(), block.count(), block.type(),
                                          out->untyped_data(), block.count(), block.type(), comm),
                    call.operation(), comm);
  zero_missing(bytes(out), from, blocks ? static_cast<int64_t>(x.size_bytes()) / blocks : 0);
  return ffi::Error::Success();
}

}  // namespace jaxcomm::mpi
