// The collective handlers on host memory: each calls the MPI library's own
// collective, so the algorithm is always the one the library has tuned for the
// network, topology and rank count. What jaxcomm adds around it: checking mode
// (call.h), pieces or derived datatypes beyond 2^31 - 1 elements, MPI_IN_PLACE
// when XLA gives the output the input's buffer (a donated input), and outputs
// that are written on every rank. The non-blocking forms (at the end) post the
// library's I-collective; their wait completes it (requests.h).
#include <mpi.h>

#include <cstring>
#include <functional>
#include <string_view>
#include <utility>

#include "call.h"
#include "datatypes.h"
#include "jaxcomm/jaxcomm.h"
#include "memory.h"
#include "ops.h"
#include "requests.h"

namespace jaxcomm::host {
namespace {

// A collective past checking mode's agreement on the call: its communicator and
// the MPI datatype of its elements, or the error that ends it.
struct Started {
  ffi::Error error;
  MPI_Comm comm;
  MPI_Datatype type;
};

Started start(Call& call, const Buffer& x) {
  Started started{call.agree(), call.comm(), MPI_DATATYPE_NULL};
  if (started.error.success()) started.error = datatype_of(x, call.operation(), &started.type);
  return started;
}

// The same for a reduction, which records `op` among the call's params; with the
// MPI operator that reduces x's elements.
struct StartedReduction {
  ffi::Error error;
  MPI_Comm comm;
  MPI_Datatype type;
  MPI_Op mpi;
};

StartedReduction start_reduction(Call& call, const Buffer& x, int32_t op) {
  StartedReduction started{call.reduce_op(op).agree(), call.comm(), MPI_DATATYPE_NULL, MPI_OP_NULL};
  if (started.error.success())
    started.error = reduction_of(x, op, call.operation(), &started.type, &started.mpi);
  return started;
}

int comm_size(MPI_Comm comm) {
  int size = 0;
  MPI_Comm_size(comm, &size);
  return size;
}

// allreduce, scan and exscan: kReduce (MPI's function of that name) on x's
// elements in int-sized pieces; logical results become 0 or 1.
template <auto kReduce>
ffi::Error reduce_elements(Call& call, const Buffer& x, Result& out, int32_t op) {
  auto [error, comm, type, mpi] = start_reduction(call, x, op);
  if (error.failure()) return error;
  JAXCOMM_CHECK_MPI(reduce_pieces(x.untyped_data(), out->untyped_data(), x.element_count(), type,
                                  [&](const void* i, void* o, int n) {
                                    return kReduce(i, o, n, type, mpi, comm);
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
  auto [error, comm, type, mpi] = start_reduction(call.param("root", root), x, op);
  if (error.failure()) return error;
  const bool is_root = comm_rank(comm) == root;
  // Non-root ranks get their input back, so the output is always written.
  if (!is_root) copy_if_distinct(out, x);
  JAXCOMM_CHECK_MPI(reduce_pieces(is_root ? x.untyped_data() : out->untyped_data(),
                                  out->untyped_data(), x.element_count(), type,
                                  [&](const void* i, void* o, int n) {
                                    // Non-root: send our data, receive nothing.
                                    return is_root
                                               ? MPI_Reduce(i, o, n, type, mpi, root, comm)
                                               : MPI_Reduce(o, nullptr, n, type, mpi, root, comm);
                                  }),
                    current_operation(), comm);
  if (is_root) normalize_logical(out, op);
  return ffi::Error::Success();
}

ffi::Error ReduceScatter(Token, Buffer x, TokenOut, Result out, int64_t comm_key, bool check,
                         int32_t op) {
  Call call(comm_key, check, x);
  auto [error, comm, type, mpi] = start_reduction(call, x, op);
  if (error.failure()) return error;
  const int64_t block = out->element_count();
  if (block <= kMaxCount) {
    JAXCOMM_CHECK_MPI(MPI_Reduce_scatter_block(x.untyped_data(), out->untyped_data(),
                                               static_cast<int>(block), type, mpi, comm),
                      current_operation(), comm);
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
                                                           mpi, root, comm);
                                       }),
                        current_operation(), comm);
    }
  }
  normalize_logical(out, op);
  return ffi::Error::Success();
}

ffi::Error Bcast(Token, Buffer x, TokenOut, Result out, int64_t comm_key, bool check,
                 int32_t root) {
  Call call(comm_key, check, x);
  auto [error, comm, type] = start(call.param("root", root), x);
  if (error.failure()) return error;
  if (comm_rank(comm) == root) copy_if_distinct(out, x);
  const size_t width = ffi::ByteWidth(x.element_type());
  JAXCOMM_CHECK_MPI(for_each_piece(x.element_count(),
                                   [&](int64_t offset, int n) {
                                     return MPI_Bcast(bytes(out) + offset * width, n, type, root,
                                                      comm);
                                   }),
                    current_operation(), comm);
  return ffi::Error::Success();
}

ffi::Error Allgather(Token, Buffer x, TokenOut, Result out, int64_t comm_key, bool check) {
  Call call(comm_key, check, x);
  auto [error, comm, type] = start(call, x);
  if (error.failure()) return error;
  Block block(x.element_count(), type);
  JAXCOMM_CHECK_MPI(MPI_Allgather(x.untyped_data(), block.count(), block.type(),
                                  out->untyped_data(), block.count(), block.type(), comm),
                    current_operation(), comm);
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
                    current_operation(), comm);
  return ffi::Error::Success();
}

ffi::Error Barrier(Token, TokenOut, int64_t comm_key, bool check) {
  Call call(comm_key, check);
  if (auto err = call.agree(); err.failure()) return err;
  JAXCOMM_CHECK_MPI(MPI_Barrier(call.comm()), current_operation(), call.comm());
  return ffi::Error::Success();
}

// -- non-blocking forms: MPI reads and writes buffers the pending request owns
// (requests.h): the start copies x into one, the wait copies the result out.
// XLA still passes x through as `keep` (or, for ibcast, as `out`), which the
// handlers ignore.

namespace {

// The pending collective whose result MPI writes into a buffer it owns, of
// out's size; `finish` edits that result once complete. Returns where x's copy
// and the result are.
struct Owned {
  Pending pending;
  const char* in;
  char* result;
};

Owned own_buffers(std::string_view operation, int64_t comm_key, bool check, const Buffer& x,
                  Result& out) {
  Owned owned{Pending{operation, comm_key, check}, nullptr, nullptr};
  owned.in = owned.pending.own_copy(x.untyped_data(), x.size_bytes());
  owned.result = owned.pending.own_result(out->size_bytes());
  return owned;
}

// Logical results become 0 or 1 once the reduction is complete.
void normalize_later(Owned& owned, Result& out, int32_t op) {
  owned.pending.finish = [data = owned.result, dtype = out->element_type(),
                          n = out->element_count(), op](Call&, const MPI_Status*, int32_t*) {
    normalize_logical(data, dtype, n, op);
    return ffi::Error::Success();
  };
}

}  // namespace

ffi::Error Iallreduce(Token, Buffer x, TokenOut, Result out, Result request, Result /*keep*/,
                      int64_t comm_key, bool check, int32_t op) {
  Call call(comm_key, check, x);
  auto [error, comm, type, mpi] = start_reduction(call, x, op);
  if (error.failure()) return error;
  Owned owned = own_buffers(current_operation(), comm_key, check, x, out);
  normalize_later(owned, out, op);
  auto& requests = owned.pending.requests;
  JAXCOMM_CHECK_MPI(reduce_pieces(owned.in, owned.result, x.element_count(), type,
                                  [&](const void* i, void* o, int n) {
                                    return MPI_Iallreduce(i, o, n, type, mpi, comm,
                                                          &requests.emplace_back());
                                  }),
                    current_operation(), comm);
  return post(request->untyped_data(), std::move(owned.pending));
}

ffi::Error IreduceScatter(Token, Buffer x, TokenOut, Result out, Result request, Result /*keep*/,
                          int64_t comm_key, bool check, int32_t op) {
  Call call(comm_key, check, x);
  auto [error, comm, type, mpi] = start_reduction(call, x, op);
  if (error.failure()) return error;
  const int64_t block = out->element_count();
  if (block > kMaxCount)
    return invalid_argument(current_operation(),
                            "rows of more than 2^31 - 1 elements; use the blocking form");
  Owned owned = own_buffers(current_operation(), comm_key, check, x, out);
  normalize_later(owned, out, op);
  JAXCOMM_CHECK_MPI(MPI_Ireduce_scatter_block(owned.in, owned.result, static_cast<int>(block), type,
                                              mpi, comm, &owned.pending.requests.emplace_back()),
                    current_operation(), comm);
  return post(request->untyped_data(), std::move(owned.pending));
}

// MPI_Ibcast works in one buffer: the root's holds a copy of x. The root's result
// is x, written now (inside jit `out` is x's own buffer: nothing to copy), so only
// the other ranks copy theirs out at the wait.
ffi::Error Ibcast(Token, Buffer x, TokenOut, Result out, Result request, int64_t comm_key,
                  bool check, int32_t root) {
  Call call(comm_key, check, x);
  auto [error, comm, type] = start(call.param("root", root), x);
  if (error.failure()) return error;
  Pending pending{current_operation(), comm_key, check};
  char* data = nullptr;
  if (comm_rank(comm) == root) {
    copy_if_distinct(out, x);
    data = pending.own_copy(x.untyped_data(), x.size_bytes());
  } else {
    data = pending.own_result(out->size_bytes());
  }
  const size_t width = ffi::ByteWidth(x.element_type());
  JAXCOMM_CHECK_MPI(for_each_piece(x.element_count(),
                                   [&](int64_t offset, int n) {
                                     return MPI_Ibcast(data + offset * width, n, type, root, comm,
                                                       &pending.requests.emplace_back());
                                   }),
                    current_operation(), comm);
  return post(request->untyped_data(), std::move(pending));
}

namespace {

// iallgather and ialltoall: one block per rank each way (MPI's functions share a
// signature).
template <bool kAlltoall>
ffi::Error exchange_blocks(const Buffer& x, Result& out, Result& request, int64_t comm_key,
                           bool check) {
  Call call(comm_key, check, x);
  const std::string_view name = call.operation();
  auto [error, comm, type] = start(call, x);
  if (error.failure()) return error;
  // MPI lets a datatype be freed (Block's destructor) while a request uses it.
  Block block(x.element_count() / (kAlltoall ? comm_size(comm) : 1), type);
  Owned owned = own_buffers(name, comm_key, check, x, out);
  auto* post_blocks = kAlltoall ? &MPI_Ialltoall : &MPI_Iallgather;
  JAXCOMM_CHECK_MPI(post_blocks(owned.in, block.count(), block.type(), owned.result, block.count(),
                                block.type(), comm, &owned.pending.requests.emplace_back()),
                    name, comm);
  return post(request->untyped_data(), std::move(owned.pending));
}

}  // namespace

ffi::Error Iallgather(Token, Buffer x, TokenOut, Result out, Result request, Result /*keep*/,
                      int64_t comm_key, bool check) {
  return exchange_blocks<false>(x, out, request, comm_key, check);
}

ffi::Error Ialltoall(Token, Buffer x, TokenOut, Result out, Result request, Result /*keep*/,
                     int64_t comm_key, bool check) {
  return exchange_blocks<true>(x, out, request, comm_key, check);
}

}  // namespace jaxcomm::host
