// The collective handlers on host memory that move data without reducing it:
// each calls the MPI library's own collective, tuned for the network, topology
// and rank count. What jaxcomm adds around it: checking mode (call.h), pieces or
// derived datatypes beyond 2^31 - 1 elements, MPI_IN_PLACE when XLA gives the
// output the input's buffer, and outputs that are written on every rank.
#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "call.h"
#include "datatypes.h"
#include "jaxcomm/jaxcomm.h"
#include "memory.h"
#include "operations.h"
#include "started.h"

namespace jaxcomm::mpi {

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
namespace {

// One row of x (its elements past the leading axis) as an MPI datatype, so that
// alltoallv's counts and displacements count rows.
class RowType {
 public:
  RowType(int64_t elements, MPI_Datatype base) {
    MPI_Type_contiguous(static_cast<int>(elements), base, &type_);
    MPI_Type_commit(&type_);
  }
  ~RowType() { MPI_Type_free(&type_); }
  RowType(const RowType&) = delete;
  RowType& operator=(const RowType&) = delete;
  MPI_Datatype get() const { return type_; }

 private:
  MPI_Datatype type_ = MPI_DATATYPE_NULL;
};

std::string counts_text(const std::vector<int>& counts) {
  std::string text = "[";
  for (size_t i = 0; i < counts.size(); ++i) text += (i ? ", " : "") + std::to_string(counts[i]);
  return text + "]";
}

// Exclusive prefix sums: where each rank's rows start.
std::vector<int> displacements(const std::vector<int>& counts) {
  std::vector<int> starts(counts.size(), 0);
  for (size_t i = 1; i < counts.size(); ++i) starts[i] = starts[i - 1] + counts[i - 1];
  return starts;
}

}  // namespace

// Every rank takes part in MPI_Alltoallv whatever its own counts are, so that no
// other rank waits for it: a rank whose send counts are invalid sends no rows,
// and a rank whose incoming rows exceed `out` receives them into a scratch
// buffer; each then returns an error naming its counts.
ffi::Error Alltoallv(Token, Buffer x, Buffer send_counts, Buffer given_counts, TokenOut, Result out,
                     Result recv_counts, int64_t comm_key, bool check, int32_t exchange) {
  Call call(comm_key, check);
  const auto dims = x.dimensions();
  if (dims.size() == 0) return invalid_argument(call.operation(), "x needs a leading axis of rows");
  int64_t row_elements = 1;
  for (size_t i = 1; i < dims.size(); ++i) row_elements *= dims[i];
  if (row_elements > kMaxCount)
    return invalid_argument(call.operation(), "rows of more than 2^31 - 1 elements");
  call.param("dtype", static_cast<int64_t>(x.element_type())).param("row", row_elements);
  auto [error, comm, type] = start(call, x);
  if (error.failure()) return error;
  const int size = comm_size(comm);
  const int64_t rows = dims[0], capacity = out->dimensions()[0];
  const int32_t* asked = static_cast<const int32_t*>(send_counts.untyped_data());
  std::vector<int> sending(asked, asked + size);
  int64_t total_sent = 0;
  bool bad_send = false;
  for (int c : sending) {
    bad_send |= c < 0;
    total_sent += c;
  }
  bad_send |= total_sent > rows;
  if (bad_send) std::fill(sending.begin(), sending.end(), 0);  // still take part
  std::vector<int> receiving(size, 0);
  if (exchange || check)
    JAXCOMM_CHECK_MPI(MPI_Alltoall(sending.data(), 1, MPI_INT, receiving.data(), 1, MPI_INT, comm),
                      call.operation(), comm);
  if (!exchange) {
    const int32_t* given = static_cast<const int32_t*>(given_counts.untyped_data());
    bool differ = check && !std::equal(receiving.begin(), receiving.end(), given);
    if (check) {
      // Every rank learns whether any rank's counts are wrong, before MPI_Alltoallv
      // could wait for rows that never come.
      int any = differ ? 1 : 0;
      JAXCOMM_CHECK_MPI(MPI_Allreduce(MPI_IN_PLACE, &any, 1, MPI_INT, MPI_MAX, comm),
                        call.operation(), comm);
      if (any)
        return ffi::Error(
            ffi::ErrorCode::kFailedPrecondition,
            "jaxcomm check: " + std::string(call.operation()) + " on rank " +
                std::to_string(comm_rank(comm)) +
                (differ ? ": recv_counts " + counts_text({given, given + size}) +
                              " but the other ranks send " + counts_text(receiving)
                        : ": another rank's recv_counts differ from what is sent to it"));
    }
    receiving.assign(given, given + size);
  }
  int64_t total = 0;
  for (int c : receiving) total += c;
  if (total > kMaxCount || total_sent > kMaxCount)
    return invalid_argument(call.operation(), "more than 2^31 - 1 rows");
  const bool overflow = total > capacity;
  const int64_t row_bytes = row_elements * static_cast<int64_t>(ffi::ByteWidth(x.element_type()));
  std::vector<char> scratch(overflow ? static_cast<size_t>(total * row_bytes) : 0);
  char* into = overflow ? scratch.data() : bytes(out);
  RowType row(row_elements, type);
  JAXCOMM_CHECK_MPI(
      MPI_Alltoallv(x.untyped_data(), sending.data(), displacements(sending).data(), row.get(),
                    into, receiving.data(), displacements(receiving).data(), row.get(), comm),
      call.operation(), comm);
  const int64_t kept = overflow ? 0 : total;  // rows of out that hold data
  static const char nothing = 0;
  memory().fill(bytes(out) + kept * row_bytes, &nothing, 1, (capacity - kept) * row_bytes);
  std::vector<int32_t> counts(receiving.begin(), receiving.end());
  memory().copy(recv_counts->untyped_data(), counts.data(), counts.size() * sizeof(int32_t));
  if (bad_send)
    return invalid_argument(call.operation(), "send_counts " + counts_text({asked, asked + size}) +
                                                  " must be non-negative and sum to at most x's " +
                                                  std::to_string(rows) +
                                                  " rows (this rank sent none)");
  if (overflow)
    return invalid_argument(
        call.operation(),
        "recv_counts " + counts_text(receiving) + " add up to " + std::to_string(total) +
            " rows, more than capacity=" + std::to_string(capacity) + " (the rows were not kept)");
  return ffi::Error::Success();
}

}  // namespace jaxcomm::mpi
