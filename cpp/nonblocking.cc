// The non-blocking handlers on host memory: each start posts the MPI library's
// I-form on buffers that its pending request owns (requests.h): the start copies
// x into one, the wait copies the result out, so MPI never touches a buffer that
// XLA may free or reuse. XLA still passes x through as `keep` (or, for ibcast, as
// `out`), which the handlers ignore. Wait and Test complete and poll a request.
#include "nonblocking.h"

#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string_view>
#include <utility>
#include <vector>

#include "call.h"
#include "collectives.h"
#include "datatypes.h"
#include "jaxcomm/jaxcomm.h"
#include "memory.h"
#include "p2p.h"
#include "pairing.h"
#include "requests.h"
#include "started.h"

namespace jaxcomm::mpi {

namespace {

// The pending collective whose result MPI writes into a buffer it owns, of
// out's size; `finish` edits that result once complete. Returns where x's copy
// and the result are.
struct Owned {
  Pending pending;
  char* in;
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
  auto [error, comm, type, mpi_operator] = start_reduction(call, x, op);
  if (error.failure()) return error;
  Owned owned = own_buffers(call.operation(), comm_key, check, x, out);
  normalize_later(owned, out, op);
  auto& requests = owned.pending.requests;
  JAXCOMM_CHECK_MPI(reduce_pieces(owned.in, owned.result, x.element_count(), type,
                                  [&](const void* i, void* o, int n) {
                                    return MPI_Iallreduce(i, o, n, type, mpi_operator, comm,
                                                          &requests.emplace_back());
                                  }),
                    call.operation(), comm);
  return post(request->untyped_data(), std::move(owned.pending));
}

ffi::Error IreduceScatter(Token, Buffer x, TokenOut, Result out, Result request, Result /*keep*/,
                          int64_t comm_key, bool check, int32_t op) {
  Call call(comm_key, check, x);
  auto [error, comm, type, mpi_operator] = start_reduction(call, x, op);
  if (error.failure()) return error;
  const int64_t block = out->element_count();
  if (block > kMaxCount)
    return invalid_argument(call.operation(),
                            "rows of more than 2^31 - 1 elements; use the blocking form");
  Owned owned = own_buffers(call.operation(), comm_key, check, x, out);
  normalize_later(owned, out, op);
  JAXCOMM_CHECK_MPI(
      MPI_Ireduce_scatter_block(owned.in, owned.result, static_cast<int>(block), type, mpi_operator,
                                comm, &owned.pending.requests.emplace_back()),
      call.operation(), comm);
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
  Pending pending{call.operation(), comm_key, check};
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
                    call.operation(), comm);
  return post(request->untyped_data(), std::move(pending));
}

namespace {

// MPI's non-blocking exchanges of one block per peer each way share a signature.
using PostBlocks = int (*)(const void*, int, MPI_Datatype, void*, int, MPI_Datatype, MPI_Comm,
                           MPI_Request*);

struct BlockExchange {
  PostBlocks post;
  bool split;         // x holds one block per peer (the alltoall forms), else it is one
  bool neighborhood;  // the peers are a Cartesian or graph communicator's neighbours
};

constexpr BlockExchange kIallgather{&MPI_Iallgather, false, false};
constexpr BlockExchange kIalltoall{&MPI_Ialltoall, true, false};
constexpr BlockExchange kIneighborAllgather{&MPI_Ineighbor_allgather, false, true};
constexpr BlockExchange kIneighborAlltoall{&MPI_Ineighbor_alltoall, true, true};

ffi::Error exchange_blocks(const BlockExchange& kind, const Buffer& x, Result& out, Result& request,
                           int64_t comm_key, bool check) {
  Call call(comm_key, check, x);
  const std::string_view name = call.operation();
  // A graph's ranks send different numbers of blocks: checking mode compares one.
  auto [error, comm, type] = start(kind.neighborhood && kind.split ? call.per_block() : call, x);
  if (error.failure()) return error;
  static const Neighborhood kEveryRank;  // no grid: nothing to swap or zero
  const Neighborhood* hood = &kEveryRank;
  if (kind.neighborhood) {
    if (auto err = call.neighborhood(&hood); err.failure()) return err;
    if (auto err = check_blocks(name, *hood, *out, kind.split ? &x : nullptr); err.failure())
      return err;
  }
  // A block is x, or one row of x (whose leading axis counts its blocks).
  const int64_t elements = kind.split ? block_elements(x) : x.element_count();
  // MPI lets a datatype be freed (Block's destructor) while a request uses it.
  Block block(elements, type);
  Owned owned = own_buffers(name, comm_key, check, x, out);
  const size_t block_bytes = elements * ffi::ByteWidth(x.element_type());
  if (kind.split)
    pair_as_standard(hood->grid, [&](size_t lower) {
      char* blocks = owned.in + lower * block_bytes;
      std::swap_ranges(blocks, blocks + block_bytes, blocks + block_bytes);
    });
  // Blocks from beyond an edge: MPI does not write them, and owned buffers are reused.
  zero_missing(owned.result, *hood, block_bytes);
  JAXCOMM_CHECK_MPI(kind.post(owned.in, block.count(), block.type(), owned.result, block.count(),
                              block.type(), comm, &owned.pending.requests.emplace_back()),
                    name, comm);
  return post(request->untyped_data(), std::move(owned.pending));
}

}  // namespace

ffi::Error Iallgather(Token, Buffer x, TokenOut, Result out, Result request, Result /*keep*/,
                      int64_t comm_key, bool check) {
  return exchange_blocks(kIallgather, x, out, request, comm_key, check);
}

ffi::Error Ialltoall(Token, Buffer x, TokenOut, Result out, Result request, Result /*keep*/,
                     int64_t comm_key, bool check) {
  return exchange_blocks(kIalltoall, x, out, request, comm_key, check);
}

ffi::Error IneighborAllgather(Token, Buffer x, TokenOut, Result out, Result request,
                              Result /*keep*/, int64_t comm_key, bool check) {
  return exchange_blocks(kIneighborAllgather, x, out, request, comm_key, check);
}

ffi::Error IneighborAlltoall(Token, Buffer x, TokenOut, Result out, Result request, Result /*keep*/,
                             int64_t comm_key, bool check) {
  return exchange_blocks(kIneighborAlltoall, x, out, request, comm_key, check);
}

// isend and irecv post on buffers their pending request owns (requests.h): isend
// sends a copy of x; irecv receives into a buffer that the wait copies out.
namespace {

ffi::Error post_send(Call& call, const Buffer& x, Result& request, int64_t comm_key, bool check,
                     int32_t dest, int32_t tag) {
  call.peer("dest", dest).peer("tag", tag);
  MPI_Comm comm = call.comm();
  MPI_Datatype type;
  if (auto err = datatype_of(x, call.operation(), &type); err.failure()) return err;
  Pending pending{call.operation(), comm_key, check};
  // Only checking mode sends a header; it lives as long as the requests, which
  // end with `finish`.
  auto header = check ? std::make_shared<Call::MessageHeader>() : nullptr;
  if (auto err =
          call.post_header(dest, tag, pieces(x.element_count()), header.get(), &pending.requests);
      err.failure())
    return err;
  if (header)
    pending.finish = [header](Call&, const MPI_Status*, int32_t*) { return ffi::Error::Success(); };
  const char* data = pending.own_copy(x.untyped_data(), x.size_bytes());
  // In pieces as send splits them, so that a blocking recv can match an isend.
  const size_t width = ffi::ByteWidth(x.element_type());
  JAXCOMM_CHECK_MPI(for_each_piece(x.element_count(),
                                   [&](int64_t offset, int n) {
                                     return MPI_Isend(data + offset * width, n, type, dest, tag,
                                                      comm, &pending.requests.emplace_back());
                                   }),
                    call.operation(), comm);
  return post(request->untyped_data(), std::move(pending));
}

}  // namespace

ffi::Error Isend(Token, Buffer x, TokenOut, Result request, Result /*keep*/, int64_t comm_key,
                 bool check, int32_t dest, int32_t tag) {
  Call call(comm_key, check, x);
  return post_send(call, x, request, comm_key, check, dest, tag);
}

ffi::Error ItaggedSend(Token, Buffer x, Buffer status, TokenOut, Result request, Result /*keep*/,
                       int64_t comm_key, bool check, int32_t dest) {
  Call call(comm_key, check, x);
  if (status.element_type() != ffi::DataType::S32 || status.element_count() != 2)
    return invalid_argument(call.operation(), "the status must be int32[2]");
  const int32_t tag = static_cast<const int32_t*>(status.untyped_data())[1];
  return post_send(call, x, request, comm_key, check, dest, tag);
}

// Checking mode receives each message's header alongside it: both are posted
// now, so that ranks that post their receives before their sends never wait for
// each other's headers.
ffi::Error Irecv(Token, TokenOut, Result out, Result request, int64_t comm_key, bool check,
                 int32_t source, int32_t tag) {
  Call call(comm_key, check, *out);
  call.peer("source", source).peer("tag", tag);
  if (auto err = call.live(); err.failure()) return err;
  MPI_Comm comm = call.comm();
  MPI_Datatype type = mpi_datatype(out->element_type());
  if (type == MPI_DATATYPE_NULL) return invalid_argument(call.operation(), "unsupported dtype");
  const int64_t count = out->element_count();
  if (source == MPI_ANY_SOURCE && (check || pieces(count) > 1))
    return invalid_argument(call.operation(),
                            "MPI.ANY_SOURCE needs one message without checking mode");
  Pending pending{call.operation(), comm_key, check};
  pending.cancellable = true;
  char* data = pending.own_result(out->size_bytes());
  if (source == MPI_PROC_NULL) std::memset(data, 0, out->size_bytes());
  const bool header = check && source != MPI_PROC_NULL;
  auto incoming = std::make_shared<Call::MessageHeader>();
  if (header)
    JAXCOMM_CHECK_MPI(MPI_Irecv(incoming.get(), sizeof *incoming, MPI_BYTE, source, tag, comm,
                                &pending.requests.emplace_back()),
                      call.operation(), comm);
  const size_t width = ffi::ByteWidth(out->element_type());
  JAXCOMM_CHECK_MPI(for_each_piece(count,
                                   [&](int64_t offset, int n) {
                                     return MPI_Irecv(data + offset * width, n, type, source, tag,
                                                      comm, &pending.requests.emplace_back());
                                   }),
                    call.operation(), comm);
  std::vector<int64_t> dims(out->dimensions().begin(), out->dimensions().end());
  const ffi::DataType dtype = out->element_type();
  if (header)
    // A message larger than the buffer fails MPI's receive; its header, which came
    // first, names both sides.
    pending.explain = [=](Call& done, const MPI_Status* statuses) {
      if (statuses[0].MPI_ERROR != MPI_SUCCESS) return ffi::Error::Success();
      return done.check_received(*incoming, statuses[0], dtype, dims);
    };
  pending.finish = [=](Call& done, const MPI_Status* statuses, int32_t* status) -> ffi::Error {
    if (header)
      if (auto err = done.check_received(*incoming, statuses[0], dtype, dims); err.failure())
        return err;
    const MPI_Status* data = statuses + (header ? 1 : 0);
    for (int64_t offset = 0, i = 0; offset < count || i == 0; offset += kMaxCount, ++i) {
      const int n = static_cast<int>(std::min<int64_t>(count - offset, kMaxCount));
      if (auto err = check_count(data[i], type, n, done.operation()); err.failure())
        return paired(std::move(err));  // the message arrived whole
    }
    if (status != nullptr) {
      status[0] = data[0].MPI_SOURCE;
      status[1] = data[0].MPI_TAG;
    }
    return ffi::Error::Success();
  };
  return post(request->untyped_data(), std::move(pending));
}

ffi::Error Wait(Token, Buffer request, ffi::RemainingArgs args, TokenOut,
                ffi::RemainingRets results) {
  void* out = nullptr;
  int32_t* status = nullptr;
  if (results.size() > 0) {
    auto result = results.get<ffi::AnyBuffer>(0);
    if (result.has_error()) return result.error();
    out = (*result)->untyped_data();
  }
  if (results.size() > 1) {
    auto result = results.get<ffi::AnyBuffer>(1);
    if (result.has_error()) return result.error();
    status = static_cast<int32_t*>((*result)->untyped_data());
  }
  // A receive's wait may take, after its buffer, the status of the message whose
  // tangent it receives (requests.h, complete).
  const int32_t* tangent_of = nullptr;
  if (status != nullptr && args.size() > 1) {
    auto primal = args.get<ffi::AnyBuffer>(1);
    if (primal.has_error()) return primal.error();
    tangent_of = static_cast<const int32_t*>((*primal).untyped_data());
  }
  return complete(request.untyped_data(), out, status, tangent_of);
}

ffi::Error Test(Token, Buffer request, TokenOut, ffi::Result<ffi::BufferR0<ffi::PRED>> done) {
  return test(request.untyped_data(), done->typed_data());
}

}  // namespace jaxcomm::mpi
