// The reduction handlers on host memory: each calls the MPI library's own
// reduction, so the algorithm is always the one the library has tuned for the
// network, topology and rank count. What jaxcomm adds around it: checking mode
// (call.h), int-sized pieces beyond 2^31 - 1 elements, MPI_IN_PLACE when XLA
// gives the output the input's buffer (a donated input), logical results that
// are 0 or 1, exscan's identity on rank 0, and outputs written on every rank.
#include "reductions.h"

#include <mpi.h>

#include <cstdint>
#include <utility>

#include "call.h"
#include "datatypes.h"
#include "jaxcomm/jaxcomm.h"
#include "memory.h"
#include "started.h"

namespace jaxcomm::mpi {
namespace {

// allreduce, scan and exscan: kReduce (MPI's function of that name) on x's
// elements in int-sized pieces; logical results become 0 or 1.
template <auto kReduce>
ffi::Error reduce_elements(Call& call, const Buffer& x, Result& out, int32_t op) {
  auto [error, comm, type, mpi_operator] = start_reduction(call, x, op);
  if (error.failure()) return error;
  JAXCOMM_CHECK_MPI(reduce_pieces(x.untyped_data(), out->untyped_data(), x.element_count(), type,
                                  [&](const void* i, void* o, int n) {
                                    return kReduce(i, o, n, type, mpi_operator, comm);
                                  }),
                    call.operation(), comm);
  normalize_logical(out, op);
  return ffi::Error::Success();
}

}  // namespace

ffi::Error Allreduce(Token, Buffer x, TokenOut, Result out, int64_t comm_key, bool check,
                     int32_t op) {
  Call call(comm_key, check, x);
  return reduce_elements<MPI_Allreduce>(call, x, out, op);
}

ffi::Error Scan(Token, Buffer x, TokenOut, Result out, int64_t comm_key, bool check, int32_t op) {
  Call call(comm_key, check, x);
  return reduce_elements<MPI_Scan>(call, x, out, op);
}

ffi::Error Exscan(Token, Buffer x, TokenOut, Result out, int64_t comm_key, bool check, int32_t op) {
  Call call(comm_key, check, x);
  if (auto err = reduce_elements<MPI_Exscan>(call, x, out, op); err.failure()) return err;
  // MPI leaves exscan's rank-0 result undefined; jaxcomm's is the identity of op.
  if (comm_rank(call.comm()) == 0) fill_identity(out, op);
  return ffi::Error::Success();
}

ffi::Error Reduce(Token, Buffer x, TokenOut, Result out, int64_t comm_key, bool check, int32_t op,
                  int32_t root) {
  Call call(comm_key, check, x);
  auto [error, comm, type, mpi_operator] = start_reduction(call.param("root", root), x, op);
  if (error.failure()) return error;
  if (comm_rank(comm) != root) {
    // The other ranks only send x, which is their result too.
    copy_if_distinct(out, x);
    const size_t width = ffi::ByteWidth(x.element_type());
    JAXCOMM_CHECK_MPI(for_each_piece(x.element_count(),
                                     [&](int64_t offset, int n) {
                                       return MPI_Reduce(bytes(x) + offset * width, nullptr, n,
                                                         type, mpi_operator, root, comm);
                                     }),
                      call.operation(), comm);
    return ffi::Error::Success();
  }
  JAXCOMM_CHECK_MPI(reduce_pieces(x.untyped_data(), out->untyped_data(), x.element_count(), type,
                                  [&](const void* i, void* o, int n) {
                                    return MPI_Reduce(i, o, n, type, mpi_operator, root, comm);
                                  }),
                    call.operation(), comm);
  normalize_logical(out, op);
  return ffi::Error::Success();
}

ffi::Error ReduceScatter(Token, Buffer x, TokenOut, Result out, int64_t comm_key, bool check,
                         int32_t op) {
  Call call(comm_key, check, x);
  auto [error, comm, type, mpi_operator] = start_reduction(call, x, op);
  if (error.failure()) return error;
  const int64_t block = out->element_count();
  if (block <= kMaxCount) {
    JAXCOMM_CHECK_MPI(MPI_Reduce_scatter_block(x.untyped_data(), out->untyped_data(),
                                               static_cast<int>(block), type, mpi_operator, comm),
                      call.operation(), comm);
  } else {
    // A block too large for an int count (a derived datatype cannot carry a
    // reduction): one reduce per destination rank, each in int-sized pieces.
    const size_t width = ffi::ByteWidth(x.element_type());
    for (int root = 0, size = comm_size(comm); root < size; ++root) {
      const char* row = bytes(x) + root * block * width;
      JAXCOMM_CHECK_MPI(for_each_piece(block,
                                       [&](int64_t offset, int n) {
                                         return MPI_Reduce(row + offset * width,
                                                           bytes(out) + offset * width, n, type,
                                                           mpi_operator, root, comm);
                                       }),
                        call.operation(), comm);
    }
  }
  normalize_logical(out, op);
  return ffi::Error::Success();
}

}  // namespace jaxcomm::mpi
