// The variable-size exchanges on host memory: alltoallv (and ialltoallv),
// allgatherv, gatherv and scatterv, each MPI's own function on rows of x (its
// elements past the leading axis), with a static capacity of rows for the
// result. The counts are int32 buffers, so they may change from call to call;
// unless the caller gives them (`exchange` 0, as the AD rules do), one small
// collective of the counts comes first. Checking mode compares given counts
// with the exchanged ones on every rank at once.
//
// Every rank takes part in the data exchange whatever its own counts are, so that
// no rank waits for another: a rank whose counts are invalid sends no rows, and a
// rank whose incoming rows exceed its capacity receives them into a scratch
// buffer; each then returns an error that names its counts. Rows of the result
// past those received are zeros. Only beyond 2^31 - 1 rows, which no int counts,
// does a rank call MPI 4's large-count form (MPI_Alltoallv_c, ...).
#include "variable_size.h"

#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "call.h"
#include "datatypes.h"
#include "jaxcomm/jaxcomm.h"
#include "memory.h"
#include "requests.h"
#include "started.h"

// MPI 4 has large-count forms of the variable-size functions (MPI_Alltoallv_c, ...).
#define JAXCOMM_LARGE_COUNTS (MPI_VERSION >= 4)

namespace jaxcomm::mpi {
namespace {

constexpr bool kLargeCounts = JAXCOMM_LARGE_COUNTS;

std::string counts_text(std::span<const int> counts) {
  std::string text = "[";
  for (size_t i = 0; i < counts.size(); ++i) text += (i ? ", " : "") + std::to_string(counts[i]);
  return text + "]";
}

int64_t sum(std::span<const int> counts) {
  int64_t total = 0;
  for (int c : counts) total += c;
  return total;
}

// The `n` counts of an int32 buffer, read where XLA holds them (host memory:
// the CUDA backend stages the variable-size exchanges).
static_assert(std::is_same_v<int, int32_t>, "counts are int32 buffers and MPI's int counts");
std::span<const int> counts_of(const Buffer& b, size_t n) {
  return {static_cast<const int*>(b.untyped_data()), n};
}

// Counts of rows and where each rank's rows start, of the types MPI's function
// takes: ints, or MPI 4's MPI_Count and MPI_Aint (the _c functions) beyond int.
template <typename C, typename S>
struct Counted {
  using Count = C;
  using Start = S;
  std::vector<Count> counts;
  std::vector<Start> starts;
};
using IntCounts = Counted<int, int>;

#if JAXCOMM_LARGE_COUNTS
using LargeCounts = Counted<MPI_Count, MPI_Aint>;
#endif

// MPI's variable-size functions for counts of type Counts: the int forms, or
// MPI 4's large-count (_c) forms, whose arguments are the same but for MPI_Count
// counts and MPI_Aint displacements.
template <typename Counts>
struct Functions;

template <>
struct Functions<IntCounts> {
  static constexpr auto alltoallv = &MPI_Alltoallv;
  static constexpr auto ialltoallv = &MPI_Ialltoallv;
  static constexpr auto allgatherv = &MPI_Allgatherv;
  static constexpr auto gatherv = &MPI_Gatherv;
  static constexpr auto scatterv = &MPI_Scatterv;
};

#if JAXCOMM_LARGE_COUNTS
template <>
struct Functions<LargeCounts> {
  static constexpr auto alltoallv = &MPI_Alltoallv_c;
  static constexpr auto ialltoallv = &MPI_Ialltoallv_c;
  static constexpr auto allgatherv = &MPI_Allgatherv_c;
  static constexpr auto gatherv = &MPI_Gatherv_c;
  static constexpr auto scatterv = &MPI_Scatterv_c;
};
#endif

// x's rows: how many x has, the unit in which MPI counts them (fit), and where
// `out` is; what every variable-size exchange starts with. Checking mode agrees
// on the dtype, the row's size and the params.
class Rows {
 public:
  Rows(Call& call, const Buffer& x, Result& out) : call_(call), out_(out) {
    const auto dims = x.dimensions();
    if (dims.size() == 0) {
      error_ = invalid_argument(call.operation(), "x needs a leading axis of rows");
      return;
    }
    int64_t elements = 1;
    for (size_t i = 1; i < dims.size(); ++i) elements *= dims[i];
    if (elements > kMaxCount) {
      error_ = invalid_argument(call.operation(), "rows of more than 2^31 - 1 elements");
      return;
    }
    rows_ = dims[0];
    elements_ = elements;
    bytes_ = elements * static_cast<int64_t>(ffi::ByteWidth(x.element_type()));
    call.param("dtype", static_cast<int64_t>(x.element_type())).param("row", elements);
    auto [error, comm, type] = start(call, x);
    error_ = std::move(error);
    comm_ = comm;
    base_ = type;
  }
  ~Rows() {
    if (row_ != MPI_DATATYPE_NULL) MPI_Type_free(&row_);
  }
  Rows(const Rows&) = delete;
  Rows& operator=(const Rows&) = delete;

  // Chooses the unit of counts for an exchange in which this rank sends `sent`
  // rows and receives `received`: the element, as a C program would count,
  // unless that overflows an int; then a datatype of one row. (MPI matches the
  // elements either way.) Beyond 2^31 - 1 rows, elements in MPI 4's large counts
  // (the _c functions), or an error where the MPI library predates them.
  ffi::Error fit(int64_t sent, int64_t received) {
    const int64_t most = std::max(sent, received);
    if (most > kMaxCount) {
      if (!kLargeCounts)
        return invalid_argument(call_.operation(),
                                "more than 2^31 - 1 rows in one exchange (the MPI library has "
                                "no large-count functions: MPI 4's MPI_Alltoallv_c, ...)");
      large_ = true;
      return ffi::Error::Success();
    }
    if (most * elements_ > kMaxCount && row_ == MPI_DATATYPE_NULL) {
      MPI_Type_contiguous(static_cast<int>(elements_), base_, &row_);
      MPI_Type_commit(&row_);
    }
    return ffi::Error::Success();
  }
  MPI_Datatype type() const { return row_ != MPI_DATATYPE_NULL ? row_ : base_; }

  // Calls `exchange` with an empty Counted of the type whose counts MPI takes in
  // the unit that fit chose (IntCounts, or LargeCounts for the _c functions).
  template <typename Exchange>
  int in_units(Exchange&& exchange) const {
#if JAXCOMM_LARGE_COUNTS
    if (large_) return exchange(LargeCounts{});
#endif
    return exchange(IntCounts{});
  }
  // `rows` in the unit that fit chose, as a count of type Count.
  template <typename Count>
  Count unit(int64_t rows) const {
    return static_cast<Count>(row_ != MPI_DATATYPE_NULL ? rows : rows * elements_);
  }
  // Counts of rows, and where each rank's rows start, in that unit.
  template <typename Counts>
  Counts counted(std::span<const int> rows) const {
    Counts out;
    out.counts.reserve(rows.size());
    out.starts.reserve(rows.size());
    typename Counts::Start start = 0;
    for (int r : rows) {
      out.counts.push_back(unit<typename Counts::Count>(r));
      out.starts.push_back(start);
      start += out.counts.back();
    }
    return out;
  }

  ffi::Error take_error() { return std::move(error_); }
  MPI_Comm comm() const { return comm_; }
  int64_t rows() const { return rows_; }

  // Checking mode: whether any rank's given counts differ from what the others
  // send it, learnt by every rank before the exchange could wait for rows that
  // never come. `given` (the argument `name`) and `sent` describe this rank's
  // for the error.
  ffi::Error agree(bool differ, const char* name, const std::string& given,
                   const std::string& sent) {
    int any = differ ? 1 : 0;
    JAXCOMM_CHECK_MPI(MPI_Allreduce(MPI_IN_PLACE, &any, 1, MPI_INT, MPI_MAX, comm_),
                      call_.operation(), comm_);
    if (!any) return ffi::Error::Success();
    return ffi::Error(
        ffi::ErrorCode::kFailedPrecondition,
        "jaxcomm check: " + std::string(call_.operation()) + " on rank " +
            std::to_string(comm_rank(comm_)) +
            (differ ? ": " + std::string(name) + "=" + given + " but the ranks send " + sent
                    : ": another rank's " + std::string(name) + " differ from what is sent"));
  }

  // Where `total` incoming rows go: out, or a scratch buffer if they overflow it.
  char* destination(int64_t total) {
    if (total <= capacity()) return bytes(out_);
    scratch_.resize(static_cast<size_t>(total * bytes_));
    return scratch_.data();
  }

  // Ends the exchange: writes the counts received into `counts_out`, zeros out's
  // rows past the `total` received (all of them after an overflow), then gives
  // `outcome`'s error, if any.
  ffi::Error finish(Result& counts_out, std::span<const int> received, int64_t total, bool bad,
                    const char* name, std::span<const int> asked) {
    write_counts(counts_out, received);
    zero_rows_past(bytes(out_), total);
    return outcome(received, total, bad, name, asked);
  }

  void write_counts(Result& counts_out, std::span<const int> received) const {
    memory().copy(counts_out->untyped_data(), received.data(), received.size_bytes());
  }

  // Zeros the rows of a result at `result` past the `total` received (all of
  // them after an overflow).
  void zero_rows_past(char* result, int64_t total) const {
    const int64_t kept = total <= capacity() ? total : 0;
    static const char nothing = 0;
    memory().fill(result + kept * bytes_, &nothing, 1, (capacity() - kept) * bytes_);
  }

  // The error of an overflow, or of this rank's own invalid counts (`bad`: the
  // argument `name` was `asked`; it sent no rows), if any.
  ffi::Error outcome(std::span<const int> received, int64_t total, bool bad, const char* name,
                     std::span<const int> asked) const {
    if (total > capacity())
      return invalid_argument(call_.operation(),
                              "the counts received " + counts_text(received) + " add up to " +
                                  std::to_string(total) + " rows, more than capacity=" +
                                  std::to_string(capacity()) + " (the rows were not kept)");
    if (bad)
      return invalid_argument(call_.operation(),
                              std::string(name) + "=" + counts_text(asked) +
                                  " must be non-negative and add up to at most x's " +
                                  std::to_string(rows_) + " rows (this rank sent none)");
    return ffi::Error::Success();
  }

  int64_t row_bytes() const { return bytes_; }

 private:
  int64_t capacity() const { return out_->dimensions()[0]; }

  Call& call_;
  Result& out_;
  ffi::Error error_ = ffi::Error::Success();
  MPI_Comm comm_ = MPI_COMM_NULL;
  MPI_Datatype base_ = MPI_DATATYPE_NULL, row_ = MPI_DATATYPE_NULL;
  int64_t rows_ = 0, elements_ = 0, bytes_ = 0;
  bool large_ = false;  // counts beyond int: MPI 4's _c functions
  std::vector<char> scratch_;
};

// Counts that a rank may send from x's `rows`: none negative, their sum within.
bool valid(std::span<const int> counts, int64_t rows) {
  return std::all_of(counts.begin(), counts.end(), [](int c) { return c >= 0; }) &&
         sum(counts) <= rows;
}

// A rank's own count of rows to send (allgatherv, gatherv): `asked`, and what it
// sends, none if that is not between 0 and x's rows.
struct OwnCount {
  int asked, sending;
  bool bad;
};

OwnCount own_count(const Buffer& count, int64_t rows) {
  const int asked = counts_of(count, 1)[0];
  const bool bad = asked < 0 || asked > rows;
  return {asked, bad ? 0 : asked, bad};
}

}  // namespace

namespace {

// alltoallv's counts: what this rank asked to send (`bad` if invalid: then it
// sends none) and what it receives, given or exchanged.
struct AlltoallvCounts {
  std::span<const int> asked, sending;  // sending: asked, or `none` if asked is invalid
  std::vector<int> none, receiving;
  bool bad = false;
  int64_t total = 0;  // rows received
};

ffi::Error alltoallv_counts(Call& call, Rows& rows, const Buffer& send_counts,
                            const Buffer& given_counts, bool exchange, bool check,
                            AlltoallvCounts& counts) {
  MPI_Comm comm = rows.comm();
  const int size = comm_size(comm);
  counts.asked = counts_of(send_counts, size);
  counts.bad = !valid(counts.asked, rows.rows());
  if (counts.bad) counts.none.assign(size, 0);
  counts.sending = counts.bad ? counts.none : counts.asked;
  counts.receiving.assign(size, 0);
  if (exchange || check)
    JAXCOMM_CHECK_MPI(
        MPI_Alltoall(counts.sending.data(), 1, MPI_INT, counts.receiving.data(), 1, MPI_INT, comm),
        call.operation(), comm);
  if (!exchange) {
    const std::span<const int> given = counts_of(given_counts, size);
    if (check)
      if (auto err = rows.agree(!std::ranges::equal(given, counts.receiving), "recv_counts",
                                counts_text(given), counts_text(counts.receiving));
          err.failure())
        return err;
    counts.receiving.assign(given.begin(), given.end());
  }
  counts.total = sum(counts.receiving);
  return rows.fit(sum(counts.sending), counts.total);
}

// A copy of `values` in a buffer of `pending`'s, for MPI to read until it completes.
template <typename T>
const T* owned(Pending& pending, const std::vector<T>& values) {
  return reinterpret_cast<const T*>(pending.own_copy(values.data(), values.size() * sizeof(T)));
}

}  // namespace

ffi::Error Alltoallv(Token, Buffer x, Buffer send_counts, Buffer given_counts, TokenOut, Result out,
                     Result recv_counts, int64_t comm_key, bool check, int32_t exchange) {
  Call call(comm_key, check);
  Rows rows(call, x, out);
  if (auto err = rows.take_error(); err.failure()) return err;
  AlltoallvCounts counts;
  if (auto err = alltoallv_counts(call, rows, send_counts, given_counts, exchange, check, counts);
      err.failure())
    return err;
  char* into = rows.destination(counts.total);
  const int code = rows.in_units([&]<typename Counts>(Counts) {
    const Counts send = rows.counted<Counts>(counts.sending);
    const Counts recv = rows.counted<Counts>(counts.receiving);
    return Functions<Counts>::alltoallv(x.untyped_data(), send.counts.data(), send.starts.data(),
                                        rows.type(), into, recv.counts.data(), recv.starts.data(),
                                        rows.type(), rows.comm());
  });
  JAXCOMM_CHECK_MPI(code, call.operation(), rows.comm());
  return rows.finish(recv_counts, counts.receiving, counts.total, counts.bad, "send_counts",
                     counts.asked);
}

// Posts MPI_Ialltoallv on buffers the pending request owns (requests.h): a copy
// of x, the result, and the count and displacement arrays, which MPI reads until
// the request completes. The counts are known at the post (given, or exchanged
// then with a blocking MPI_Alltoall) and returned at once; an overflow or this
// rank's invalid counts are reported by the wait, after the exchange every rank
// took part in.
ffi::Error Ialltoallv(Token, Buffer x, Buffer send_counts, Buffer given_counts, TokenOut,
                      Result out, Result request, Result /*keep*/, Result recv_counts,
                      int64_t comm_key, bool check, int32_t exchange) {
  Call call(comm_key, check);
  Rows rows(call, x, out);
  if (auto err = rows.take_error(); err.failure()) return err;
  AlltoallvCounts counts;
  if (auto err = alltoallv_counts(call, rows, send_counts, given_counts, exchange, check, counts);
      err.failure())
    return err;
  rows.write_counts(recv_counts, counts.receiving);
  Pending pending{call.operation(), comm_key, check};
  const char* in = pending.own_copy(x.untyped_data(), x.size_bytes());
  char* result = pending.own_result(out->size_bytes());
  const bool overflow = counts.total > out->dimensions()[0];
  // Overflowing rows are received in full, then dropped.
  char* into =
      overflow ? pending.own(static_cast<size_t>(counts.total * rows.row_bytes())) : result;
  rows.zero_rows_past(result, counts.total);
  pending.finish = [error = rows.outcome(counts.receiving, counts.total, counts.bad, "send_counts",
                                         counts.asked)](Call&, const MPI_Status*, int32_t*) {
    return error;
  };
  const int code = rows.in_units([&]<typename Counts>(Counts) {
    const Counts send = rows.counted<Counts>(counts.sending);
    const Counts recv = rows.counted<Counts>(counts.receiving);
    return Functions<Counts>::ialltoallv(
        in, owned(pending, send.counts), owned(pending, send.starts), rows.type(), into,
        owned(pending, recv.counts), owned(pending, recv.starts), rows.type(), rows.comm(),
        &pending.requests.emplace_back());
  });
  JAXCOMM_CHECK_MPI(code, call.operation(), rows.comm());
  return post(request->untyped_data(), std::move(pending));
}

ffi::Error Allgatherv(Token, Buffer x, Buffer count, Buffer given_counts, TokenOut, Result out,
                      Result counts_out, int64_t comm_key, bool check, int32_t exchange) {
  Call call(comm_key, check);
  Rows rows(call, x, out);
  if (auto err = rows.take_error(); err.failure()) return err;
  MPI_Comm comm = rows.comm();
  const int size = comm_size(comm);
  auto [asked, sending, bad] = own_count(count, rows.rows());
  std::vector<int> counts(size, 0);
  if (exchange || check)
    JAXCOMM_CHECK_MPI(MPI_Allgather(&sending, 1, MPI_INT, counts.data(), 1, MPI_INT, comm),
                      call.operation(), comm);
  if (!exchange) {
    const std::span<const int> given = counts_of(given_counts, size);
    if (check)
      if (auto err = rows.agree(!std::ranges::equal(given, counts), "counts", counts_text(given),
                                counts_text(counts));
          err.failure())
        return err;
    counts.assign(given.begin(), given.end());
  }
  const int64_t total = sum(counts);
  if (auto err = rows.fit(sending, total); err.failure()) return err;
  char* into = rows.destination(total);
  const int code = rows.in_units([&]<typename Counts>(Counts) {
    const Counts recv = rows.counted<Counts>(counts);
    return Functions<Counts>::allgatherv(
        x.untyped_data(), rows.unit<typename Counts::Count>(sending), rows.type(), into,
        recv.counts.data(), recv.starts.data(), rows.type(), comm);
  });
  JAXCOMM_CHECK_MPI(code, call.operation(), comm);
  return rows.finish(counts_out, counts, total, bad, "count", {&asked, 1});
}

// Only the root's counts are exchanged and checked: the other ranks' counts
// output holds their own count at their rank and zeros elsewhere.
ffi::Error Gatherv(Token, Buffer x, Buffer count, Buffer given_counts, TokenOut, Result out,
                   Result counts_out, int64_t comm_key, bool check, int32_t root,
                   int32_t exchange) {
  Call call(comm_key, check);
  call.param("root", root);
  Rows rows(call, x, out);
  if (auto err = rows.take_error(); err.failure()) return err;
  MPI_Comm comm = rows.comm();
  const int size = comm_size(comm), rank = comm_rank(comm);
  const bool is_root = rank == root;
  auto [asked, sending, bad] = own_count(count, rows.rows());
  std::vector<int> counts(size, 0);
  if (exchange || check)
    JAXCOMM_CHECK_MPI(MPI_Gather(&sending, 1, MPI_INT, counts.data(), 1, MPI_INT, root, comm),
                      call.operation(), comm);
  if (!exchange) {
    const std::span<const int> given =
        is_root ? counts_of(given_counts, size) : std::span<const int>(counts);
    if (check)  // the root compares what was sent with what it was given
      if (auto err = rows.agree(!std::ranges::equal(given, counts), "counts", counts_text(given),
                                counts_text(counts));
          err.failure())
        return err;
    if (is_root) counts.assign(given.begin(), given.end());
  }
  const int64_t total = is_root ? sum(counts) : 0;
  if (auto err = rows.fit(sending, total); err.failure()) return err;
  char* into = rows.destination(total);
  const int code = rows.in_units([&]<typename Counts>(Counts) {
    const Counts recv = rows.counted<Counts>(counts);
    return Functions<Counts>::gatherv(x.untyped_data(), rows.unit<typename Counts::Count>(sending),
                                      rows.type(), into, recv.counts.data(), recv.starts.data(),
                                      rows.type(), root, comm);
  });
  JAXCOMM_CHECK_MPI(code, call.operation(), comm);
  if (!is_root) {
    counts.assign(size, 0);
    counts[rank] = sending;
  }
  return rows.finish(counts_out, counts, total, bad, "count", {&asked, 1});
}

ffi::Error Scatterv(Token, Buffer x, Buffer counts, Buffer given_count, TokenOut, Result out,
                    Result count_out, int64_t comm_key, bool check, int32_t root,
                    int32_t exchange) {
  Call call(comm_key, check);
  call.param("root", root);
  Rows rows(call, x, out);
  if (auto err = rows.take_error(); err.failure()) return err;
  MPI_Comm comm = rows.comm();
  const int size = comm_size(comm);
  const bool is_root = comm_rank(comm) == root;
  const std::span<const int> asked = is_root ? counts_of(counts, size) : std::span<const int>();
  const bool bad = is_root && !valid(asked, rows.rows());
  std::vector<int> sending(size, 0);
  if (is_root && !bad) std::ranges::copy(asked, sending.begin());
  int receiving = 0;
  if (exchange || check)
    JAXCOMM_CHECK_MPI(MPI_Scatter(sending.data(), 1, MPI_INT, &receiving, 1, MPI_INT, root, comm),
                      call.operation(), comm);
  if (!exchange) {
    const int given = counts_of(given_count, 1)[0];
    if (check)
      if (auto err = rows.agree(given != receiving, "count", counts_text({&given, 1}),
                                counts_text({&receiving, 1}));
          err.failure())
        return err;
    receiving = given;
  }
  if (auto err = rows.fit(sum(sending), receiving); err.failure()) return err;
  char* into = rows.destination(receiving);
  const int code = rows.in_units([&]<typename Counts>(Counts) {
    const Counts send = rows.counted<Counts>(sending);
    return Functions<Counts>::scatterv(
        x.untyped_data(), send.counts.data(), send.starts.data(), rows.type(), into,
        rows.unit<typename Counts::Count>(receiving), rows.type(), root, comm);
  });
  JAXCOMM_CHECK_MPI(code, call.operation(), comm);
  return rows.finish(count_out, {&receiving, 1}, receiving, bad, "counts", asked);
}

}  // namespace jaxcomm::mpi
