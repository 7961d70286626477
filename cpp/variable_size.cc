// The variable-size exchanges on host memory: alltoallv (and ialltoallv),
// allgatherv, gatherv and scatterv, each MPI's own function on rows of x (its
// elements past the leading axis), with a static capacity of rows for the
// result; and their neighbour forms (on a graph or grid: sources and
// destinations instead of every rank). The counts are integer buffers, so they
// may change from call to call; unless they are given (`exchange`: Counting),
// one small collective of the counts comes first. Checking mode compares given
// counts with the exchanged ones on every rank at once.
//
// Under vmap a call carries `members` batch members: x, the counts and the
// results gain a leading batch axis, and the call is still one exchange of
// counts and one of rows, each peer's rows packed member after member. A batch
// of one is the unbatched call, and its rows go to MPI where they lie.
//
// Every count operand is read and validated once (counts.h) before any buffer
// is touched. Every rank takes part in the data exchange whatever its own counts
// are, so that no rank waits for another: a rank whose counts are invalid sends
// no rows, and a rank whose incoming rows exceed its capacity receives them into
// a scratch buffer; each then returns an error that names its counts. (Given
// counts that no sender could match are the exception: received_counts.) Rows of
// the result past those received are zeros. Only beyond 2^31 - 1 rows, which no
// int counts, does a rank call MPI 4's large-count form (MPI_Alltoallv_c, ...).
#include "variable_size.h"

#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "call.h"
#include "collectives.h"
#include "counts.h"
#include "datatypes.h"
#include "jaxcomm/jaxcomm.h"
#include "lockstep.h"
#include "memory.h"
#include "pairing.h"
#include "requests.h"
#include "small_vector.h"
#include "started.h"

// MPI 4 has large-count forms of the variable-size functions (MPI_Alltoallv_c, ...).
#define JAXCOMM_LARGE_COUNTS (MPI_VERSION >= 4)

namespace jaxcomm::mpi {
namespace {

constexpr bool kLargeCounts = JAXCOMM_LARGE_COUNTS;

// The `exchange` attribute: where the counts received come from.
enum Counting : int32_t {
  kGiven = 0,      // the caller's, trusted
  kExchanged = 1,  // learnt from the senders first
  // The AD rules', from an exchange made before: the same again (a tangent's),
  // or back (an adjoint's). A count refused there sent no rows, so an invalid
  // one here reads as 0 and is this call's error too.
  kMirrored = 2,
  kReversed = 3,
  // The adjoint of a neighbor_allgatherv (a neighbor_alltoallv back): the given
  // counts are that exchange's one `count` per member, which every source here
  // got and sends back. Checked as that exchange checked it, so that a rank
  // without destinations, which no source sends anything back, still reports it.
  kRegathered = 4,
};

bool reverses(int32_t counting) { return counting == kReversed || counting == kRegathered; }
bool mirrors(int32_t counting) { return counting == kMirrored || reverses(counting); }

// A value per peer (of a batch: per peer and member), in place up to 64: made on
// every call, they would otherwise cost a small exchange a heap allocation each
// (small_vector.h).
template <typename T>
using PerPeer = SmallVector<T, 64>;

// Counts of rows and where each peer's rows start, of the types MPI's function
// takes: ints, or MPI 4's MPI_Count and MPI_Aint (the _c functions) beyond int.
template <typename C, typename S>
struct Counted {
  using Count = C;
  using Start = S;
  PerPeer<Count> counts;
  PerPeer<Start> starts;
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
  static constexpr auto neighbor_alltoallv = &MPI_Neighbor_alltoallv;
  static constexpr auto ineighbor_alltoallv = &MPI_Ineighbor_alltoallv;
  static constexpr auto neighbor_allgatherv = &MPI_Neighbor_allgatherv;
  static constexpr auto iallgatherv = &MPI_Iallgatherv;
  static constexpr auto igatherv = &MPI_Igatherv;
  static constexpr auto iscatterv = &MPI_Iscatterv;
  static constexpr auto ineighbor_allgatherv = &MPI_Ineighbor_allgatherv;
};

#if JAXCOMM_LARGE_COUNTS
template <>
struct Functions<LargeCounts> {
  static constexpr auto alltoallv = &MPI_Alltoallv_c;
  static constexpr auto ialltoallv = &MPI_Ialltoallv_c;
  static constexpr auto allgatherv = &MPI_Allgatherv_c;
  static constexpr auto gatherv = &MPI_Gatherv_c;
  static constexpr auto scatterv = &MPI_Scatterv_c;
  static constexpr auto neighbor_alltoallv = &MPI_Neighbor_alltoallv_c;
  static constexpr auto ineighbor_alltoallv = &MPI_Ineighbor_alltoallv_c;
  static constexpr auto neighbor_allgatherv = &MPI_Neighbor_allgatherv_c;
  static constexpr auto iallgatherv = &MPI_Iallgatherv_c;
  static constexpr auto igatherv = &MPI_Igatherv_c;
  static constexpr auto iscatterv = &MPI_Iscatterv_c;
  static constexpr auto ineighbor_allgatherv = &MPI_Ineighbor_allgatherv_c;
};
#endif

// `data`, or where it is null (an empty buffer) a byte that no one reads: Open
// MPI refuses a null buffer even where its count is zero.
template <typename T>
T* non_null(T* data) {
  static T nothing{};
  return data != nullptr ? data : &nothing;
}

// A call's batch: `members` batch members where the count operand `counts` has a
// leading batch axis beyond its `unbatched` dimensions (then x and the results
// have one too), else one.
struct Batch {
  int64_t members;
  bool batched;
};

Batch batch_of(const Buffer& counts, size_t unbatched) {
  const auto dims = counts.dimensions();
  const bool batched = dims.size() > unbatched;
  return {batched ? dims[0] : 1, batched};
}

// `values` (rows x cols, row-major) transposed, in `storage` unless one row is
// its own transpose; the count exchanges send each peer its counts of every
// member together.
std::span<const int> transposed(std::span<const int> values, int64_t rows, int64_t cols,
                                PerPeer<int>& storage) {
  if (rows == 1 || cols == 1) return values;
  storage.resize_for_overwrite(values.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) storage[c * rows + r] = values[r * cols + c];
  return storage;
}

// Rows to or from each peer: member b's counts[b][p] rows to (from) peer p,
// taken from (put at) member b's rows in peer order. MPI sees each peer's rows of
// all members together: in place for one member, packed for several.
class Blocks {
 public:
  Blocks(const Counts& counts) : counts_(counts) {}

  // Rows to or from each peer, all members together.
  std::span<const int64_t> per_peer() {
    if (per_peer_.empty()) {
      per_peer_.resize(counts_.per_member(), 0);
      for (int64_t b = 0; b < counts_.members(); ++b) {
        const auto member = counts_.member(b);
        for (size_t p = 0; p < member.size(); ++p) per_peer_[p] += member[p];
      }
    }
    return per_peer_;
  }
  bool packed() const { return counts_.members() > 1; }

  // Copies the blocks out of `members` of `member_rows` rows each into `out`,
  // peer after peer.
  void pack(const char* members, int64_t member_rows, int64_t row_bytes, char* out) const {
    each_block([&](int64_t b, int64_t at, int64_t rows) {
      memory().copy(out, members + (b * member_rows + at) * row_bytes,
                    static_cast<size_t>(rows * row_bytes));
      out += rows * row_bytes;
    });
  }
  // The reverse: blocks packed peer after peer at `in` to their members' rows.
  void unpack(const char* in, char* members, int64_t member_rows, int64_t row_bytes) const {
    each_block([&](int64_t b, int64_t at, int64_t rows) {
      memory().copy(members + (b * member_rows + at) * row_bytes, in,
                    static_cast<size_t>(rows * row_bytes));
      in += rows * row_bytes;
    });
  }

 private:
  // f(member, its first row, rows) for each block, peer after peer.
  template <typename F>
  void each_block(F&& f) const {
    const int64_t members = counts_.members(), peers = counts_.per_member();
    PerPeer<int64_t> at(members, 0);
    for (int64_t p = 0; p < peers; ++p)
      for (int64_t b = 0; b < members; ++b) {
        const int rows = counts_.member(b)[p];
        f(b, at[b], rows);
        at[b] += rows;
      }
  }

  const Counts& counts_;
  PerPeer<int64_t> per_peer_;
};

// Whom a rank exchanges rows with: every rank of the communicator, or (the
// neighbour exchanges, MPI_Neighbor_*) the sources and destinations of a graph
// or grid in MPI's order, as many as it has. Counts are one per peer of each
// member, and the count exchanges send each peer its counts of every member
// together.
class Peers {
 public:
  // An error naming the operation if `neighbors` and the call's communicator
  // has no topology.
  static ffi::Error of(const Call& call, bool neighbors, Peers* found) {
    found->neighbors_ = neighbors;
    if (neighbors) return call.neighborhood(&found->hood_);
    found->every_rank_.sources = found->every_rank_.destinations = comm_size(call.comm());
    found->hood_ = &found->every_rank_;
    return ffi::Error::Success();
  }
  Peers() = default;
  Peers(const Peers&) = delete;  // hood_ may point into it
  Peers& operator=(const Peers&) = delete;

  bool neighbors() const { return neighbors_; }
  int sources() const { return hood_->sources; }
  int destinations() const { return hood_->destinations; }

  // `n` ints to each destination from `out`, n from each source into `in`
  // (MPI_Alltoall, MPI_Neighbor_alltoall). From beyond a grid's edge nothing
  // arrives: `in` keeps its zeros there.
  int alltoall(const int* out, int* in, int n, MPI_Comm comm) const {
    return neighbors_ ? MPI_Neighbor_alltoall(out, n, MPI_INT, in, n, MPI_INT, comm)
                      : MPI_Alltoall(out, n, MPI_INT, in, n, MPI_INT, comm);
  }
  // The same `n` ints to every destination (MPI_Allgather, MPI_Neighbor_allgather).
  int allgather(const int* mine, int* in, int n, MPI_Comm comm) const {
    return neighbors_ ? MPI_Neighbor_allgather(mine, n, MPI_INT, in, n, MPI_INT, comm)
                      : MPI_Allgather(mine, n, MPI_INT, in, n, MPI_INT, comm);
  }

  // Zeros where the rows of a source beyond a grid's edge (MPI_PROC_NULL) go:
  // MPI keeps their place in the layout but writes nothing there. `rows`: how
  // many each source's place holds, in order, at `into`.
  template <typename T>
  void zero_missing(char* into, std::span<const T> rows, int64_t row_bytes) const {
    static const char nothing = 0;
    const std::vector<int>& grid = hood_->grid;
    int64_t at = 0;
    for (size_t k = 0; k < rows.size(); ++k) {
      if (k < grid.size() && grid[k] == MPI_PROC_NULL)
        memory().fill(into + at * row_bytes, &nothing, 1, rows[k] * row_bytes);
      at += rows[k];
    }
  }

  // A posted exchange's counts `sent` and where they start, of the two blocks of
  // a grid dimension swapped where the library pairs them otherwise than MPI's
  // standard (pairing.h): each leaves from the other's place, and so arrives
  // where the standard puts it.
  template <typename Counted>
  void pair_posted_as_standard(Counted& sent) const {
    pair_as_standard(hood_->grid, [&](size_t lower) {
      std::swap(sent.counts[lower], sent.counts[lower + 1]);
      std::swap(sent.starts[lower], sent.starts[lower + 1]);
    });
  }

 private:
  bool neighbors_ = false;
  const Neighborhood* hood_ = nullptr;  // the call's (Call::neighborhood), or every_rank_
  Neighborhood every_rank_;             // every rank of the communicator: no grid
};

// x's rows: how many each member has, the unit in which MPI counts them (fit),
// and where `out` is; what every variable-size exchange starts with. Checking
// mode agrees on the dtype, the row's size, the batch, whether counts are
// exchanged, and the params.
void place(char* result, const char* arrived, const Counts& received, int64_t capacity,
           int64_t row_bytes);
void write_counts(Result& counts_out, const Counts& counts);

class Rows {
 public:
  // `given` names the counts a caller may give instead of their exchange, for
  // checking mode's fingerprint: every rank must give them, or none.
  Rows(Call& call, const Buffer& x, Result& out, Batch batch, bool exchange, const char* given)
      : call_(call), out_(out), members_(batch.members) {
    const auto dims = x.dimensions();
    const size_t first = batch.batched ? 1 : 0;  // the axis of rows
    if (dims.size() <= first) {
      error_ = invalid_argument(call.operation(), "x needs a leading axis of rows");
      return;
    }
    int64_t elements = 1;
    for (size_t i = first + 1; i < dims.size(); ++i) elements *= dims[i];
    if (elements > kMaxCount) {
      error_ = invalid_argument(call.operation(), "rows of more than 2^31 - 1 elements");
      return;
    }
    rows_ = dims[first];
    capacity_ = out->dimensions()[first];
    elements_ = elements;
    bytes_ = elements * static_cast<int64_t>(ffi::ByteWidth(x.element_type()));
    call.param("dtype", x.element_type()).param("row", elements);
    if (members_ > 1) call.param("batch", members_);
    call.param(given, exchange ? "exchanged" : "given");
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
  // Counts of rows, and where each peer's rows start, in that unit.
  template <typename Counted, typename T>
  Counted counted(std::span<const T> rows) const {
    Counted out;  // never a null array for MPI, even for a rank without neighbours (PerPeer)
    out.counts.resize_for_overwrite(rows.size());
    out.starts.resize_for_overwrite(rows.size());
    typename Counted::Start start = 0;
    for (size_t i = 0; i < rows.size(); ++i) {
      out.counts[i] = unit<typename Counted::Count>(rows[i]);
      out.starts[i] = start;
      start += out.counts[i];
    }
    return out;
  }

  ffi::Error take_error() { return std::move(error_); }
  MPI_Comm comm() const { return comm_; }
  int64_t rows() const { return rows_; }
  int64_t members() const { return members_; }
  int64_t capacity() const { return capacity_; }
  int64_t row_bytes() const { return bytes_; }
  char* result() const { return bytes(out_); }

  // Checking mode: whether any rank's given counts differ from what the others
  // send it, learnt by every rank before the exchange could wait for rows that
  // never come. `given` (the argument `name`: "recv_counts=[1, 2]") and `sent`
  // describe this rank's for the error.
  ffi::Error agree(bool differ, const char* name, const std::string& given,
                   std::span<const int> sent) {
    int any = differ ? 1 : 0;
    JAXCOMM_CHECK_MPI(MPI_Allreduce(MPI_IN_PLACE, &any, 1, MPI_INT, MPI_MAX, comm_),
                      call_.operation(), comm_);
    if (!any) return ffi::Error::Success();
    return on_every_rank(ffi::Error(
        ffi::ErrorCode::kFailedPrecondition,
        "jaxcomm check: " + std::string(call_.operation()) + " on rank " +
            std::to_string(comm_rank(comm_)) +
            (differ ? ": " + given + " but the ranks send " + counts_text(sent)
                    : ": another rank's " + std::string(name) + " differ from what is sent")));
  }

  ffi::Error refuse(const std::string& why) const {
    return invalid_argument(call_.operation(), why);
  }

  // This rank's `outcome`, or with `agree` whether any rank's failed, learnt by
  // every rank (one MPI_Allreduce) before a row moves, so that all raise: a
  // derivative's later exchanges (the tangent's, the cotangent's) may run in
  // another computation, or never, and no rank may keep a wrong result meanwhile.
  ffi::Error agreed_outcome(const Counts& sent, bool padded, const Counts& received, bool agree) {
    ffi::Error own = outcome(sent, padded, received);
    if (!agree) return own;
    // The first rank that failed, and how: 2 * rank, plus 1 for rows beyond its
    // capacity (outcome's error where the counts themselves were valid).
    const int size = comm_size(comm_);
    const bool overflow = padded || (sent.valid() && received.valid());
    int first = own.failure() ? 2 * comm_rank(comm_) + (overflow ? 1 : 0) : 2 * size;
    JAXCOMM_CHECK_MPI(MPI_Allreduce(MPI_IN_PLACE, &first, 1, MPI_INT, MPI_MIN, comm_),
                      call_.operation(), comm_);
    if (first == 2 * size) return ffi::Error::Success();
    if (own.failure()) return on_every_rank(std::move(own));
    const std::string rank = "rank " + std::to_string(first / 2);
    return on_every_rank(refuse((first % 2 ? rank + " received more rows than its capacity"
                                           : rank + "'s counts were refused") +
                                "; under a derivative every rank raises with it"));
  }

  // Whether the rows `received` (per member) fit the result.
  bool fits(const Counts& received) const {
    return received.valid() && received.most() <= capacity_;
  }

  // Where the incoming rows go: the result itself for one member that fits, else a
  // buffer of `scratch` (packed, or dropped after an overflow).
  char* destination(const Counts& received, std::vector<char>& scratch) {
    if (!Blocks(received).packed() && fits(received)) return non_null(bytes(out_));
    scratch.resize(static_cast<size_t>(received.total() * bytes_));
    return non_null(scratch.data());
  }

  // Ends the exchange: the rows that arrived at `arrived` go to out (place), and
  // the counts received to `counts_out`.
  void settle(const char* arrived, const Counts& received, Result& counts_out) const {
    place(bytes(out_), arrived, received, capacity_, bytes_);
    write_counts(counts_out, received);
  }

  // The error of this call, if any: this rank's own invalid counts (it sent
  // none, or zeros in place of rows it lacks), invalid given counts (it kept no
  // rows), or more rows than capacity (it kept none).
  ffi::Error outcome(const Counts& sent, bool padded, const Counts& received) const {
    if (padded)  // an adjoint's: what the exchange it reverses said
      return overflow(sent.asked(), capacity_);
    if (!sent.valid())
      return invalid_argument(call_.operation(), sent.error() + " (this rank sent no rows)");
    if (!received.valid())  // given or mirrored counts refused (received_counts)
      return invalid_argument(call_.operation(), received.error() + " (no rows were kept)");
    if (!fits(received)) return overflow(received.values(), capacity_);
    return ffi::Error::Success();
  }

  // The error of rows arriving for `capacity`, `received` of them from each peer.
  ffi::Error overflow(std::span<const int> received, int64_t capacity) const {
    const Counts counts =
        Counts::view(received, members_, static_cast<int64_t>(received.size()) / members_);
    std::string what = "the counts received " + counts_text(received) + " add up to " +
                       std::to_string(counts.most()) + " rows";
    if (members_ > 1) what += " in a batch member";
    return invalid_argument(
        call_.operation(),
        what + ", more than capacity=" + std::to_string(capacity) + " (the rows were not kept)");
  }

 private:
  Call& call_;
  Result& out_;
  int64_t members_;
  ffi::Error error_ = ffi::Error::Success();
  MPI_Comm comm_ = MPI_COMM_NULL;
  MPI_Datatype base_ = MPI_DATATYPE_NULL, row_ = MPI_DATATYPE_NULL;
  int64_t rows_ = 0, capacity_ = 0, elements_ = 0, bytes_ = 0;
  bool large_ = false;  // counts beyond int: MPI 4's _c functions
};

// Puts the rows received into `result` (out, or a buffer the request owns), each
// member's `capacity` rows of `row_bytes`: those that arrived packed at `arrived`
// go to their members, and the rows past those received are zeros (all of them
// after an overflow).
void place(char* result, const char* arrived, const Counts& received, int64_t capacity,
           int64_t row_bytes) {
  const bool kept = received.valid() && received.most() <= capacity;
  if (kept && arrived != result) Blocks(received).unpack(arrived, result, capacity, row_bytes);
  static const char nothing = 0;
  for (int64_t b = 0; b < received.members(); ++b) {
    const auto member = received.member(b);
    const int64_t filled = kept ? std::accumulate(member.begin(), member.end(), int64_t{0}) : 0;
    memory().fill(result + (b * capacity + filled) * row_bytes, &nothing, 1,
                  (capacity - filled) * row_bytes);
  }
}

void write_counts(Result& counts_out, const Counts& counts) {
  memory().copy(counts_out->untyped_data(), counts.values().data(), counts.values().size_bytes());
}

// Whether a rank whose counts were refused for adding up to more rows than x has
// sends zeros in their place: in an adjoint's exchange, where it sends back the
// rows it received before, more than its capacity (an overflow, which it
// reported, keeping none: so their cotangents are zeros), and its peers wait for
// as many.
bool pads(const Counts& sent, int32_t counting) {
  return !sent.valid() && reverses(counting) && !sent.asked().empty();
}

// What this rank sends: x's rows as MPI takes them (in place for one member whose
// counts are valid; packed for several), or the zeros that pads() sends.
struct Sending {
  const char* data;
  std::vector<char> packed;
};

Sending sending(const Rows& rows, const Buffer& x, const Counts& sent, int32_t counting) {
  const char* data = non_null(static_cast<char*>(x.untyped_data()));
  if (pads(sent, counting)) {
    const Counts asked = Counts::view(sent.asked(), sent.members(), sent.per_member());
    Sending s{nullptr, std::vector<char>(static_cast<size_t>(asked.total() * rows.row_bytes()))};
    s.data = s.packed.data();
    return s;
  }
  if (!Blocks(sent).packed()) return {data, {}};
  Sending s{nullptr, std::vector<char>(static_cast<size_t>(sent.total() * rows.row_bytes()))};
  Blocks(sent).pack(data, rows.rows(), rows.row_bytes(), s.packed.data());
  s.data = non_null(s.packed.data());
  return s;
}

// The counts MPI sends: the asked ones where a refused rank pads with zeros
// (viewed by `padded`), else `own` itself.
std::span<const int> sent_values(const Counts& own, int32_t counting) {
  return pads(own, counting) ? own.asked() : own.values();
}
const Counts& sent_counts(const Counts& own, int32_t counting, std::optional<Counts>& padded) {
  if (!pads(own, counting)) return own;
  return padded.emplace(Counts::Viewed{}, own.asked(), own.members(), own.per_member());
}

// The counts this rank receives: `exchanged` (what the senders said, viewed: they
// outlive `out`), unless given (`given`, the argument `name`). In checking mode
// every rank compares its given counts with the exchanged ones. Given counts
// that no exchange could match (negative, beyond int32) are refused before the
// exchange, as a bad root is: rows would arrive for which this rank has no
// count, and MPI cannot take them without leaving messages that a later
// collective would match.
ffi::Error received_counts(Rows& rows, int32_t counting, bool check, const Buffer& given,
                           const char* name, std::span<const int> exchanged, int64_t per_member,
                           std::optional<Counts>& out) {
  if (counting == kExchanged) {
    out.emplace(Counts::Viewed{}, exchanged, rows.members(), per_member);
    return ffi::Error::Success();
  }
  if (counting == kRegathered) {  // capacity: one block of x's rows per source, at least one
    Counts count(given, name, rows.members(), 1);
    count.within(rows.capacity() / std::max<int64_t>(per_member, 1));
    out.emplace(count.repeated(per_member));
    return ffi::Error::Success();
  }
  Counts& counts = out.emplace(given, name, rows.members(), per_member);
  // Counts that were refused in the exchange mirrored sent no rows: they read as
  // zeros, and the refusal is this call's error. An adjoint receives what x's
  // rows were (its capacity): counts beyond them were refused too.
  if (counting == kReversed) counts.within(rows.capacity());
  if (mirrors(counting)) return ffi::Error::Success();
  if (check)
    if (auto err =
            rows.agree(!counts.valid() || !std::ranges::equal(counts.values(), exchanged), name,
                       counts.valid() ? std::string(name) + "=" + counts_text(counts.values())
                                      : counts.error(),
                       exchanged);
        err.failure())
      return err;
  // Given counts that no sender could match (negative, beyond int32) leave this
  // rank without the counts its peers send, and MPI cannot take rows it has no
  // count for without leaving messages that a later collective would match (or
  // waiting for them). So it refuses them before the exchange, as a bad root;
  // its peers then wait for it (checking mode makes every rank raise instead).
  if (!counts.valid())
    return rows.refuse(counts.error() +
                       " (given counts are trusted: this rank did not take "
                       "part in the exchange, which its peers wait for)");
  return ffi::Error::Success();
}

// alltoallv's counts: this rank's own (refused, and so none, if invalid), one
// per destination, and those it receives, one per source, given or exchanged
// (into `exchanged`, which `received` views).
ffi::Error alltoallv_counts(Call& call, Rows& rows, const Peers& peers, const Buffer& send_counts,
                            const Buffer& given_counts, int32_t counting, bool check,
                            std::optional<Counts>& own, PerPeer<int>& exchanged,
                            std::optional<Counts>& received) {
  const bool exchange = counting == kExchanged;
  MPI_Comm comm = rows.comm();
  const int64_t members = rows.members();
  Counts& sent = own.emplace(send_counts, "send_counts", members, peers.destinations());
  sent.within(rows.rows());
  exchanged.resize(static_cast<size_t>(members * peers.sources()), 0);
  if (exchange || check) {
    // Each peer gets its counts of every member together, and they arrive in
    // `exchanged`, transposed back for several members. (Never a null buffer: MPI
    // may refuse one even where no peer reads it.)
    PerPeer<int> storage;
    const auto out =
        transposed(sent_values(sent, counting), members, peers.destinations(), storage);
    JAXCOMM_CHECK_MPI(
        peers.alltoall(non_null(out.data()), exchanged.data(), static_cast<int>(members), comm),
        call.operation(), comm);
    const auto back = transposed(exchanged, peers.sources(), members, storage);
    if (back.data() != exchanged.data()) std::copy(back.begin(), back.end(), exchanged.begin());
  }
  // An adjoint's recv_counts are the send_counts (or count) of the exchange it reverses.
  const char* given_name = counting == kReversed     ? "send_counts"
                           : counting == kRegathered ? "count"
                                                     : "recv_counts";
  return received_counts(rows, counting, check, given_counts, given_name, exchanged,
                         peers.sources(), received);
}

// Where an exchange's rows go from and to. A blocking call: MPI's blocking
// function on x and out themselves (Rows::destination). A start (`request` not
// null): MPI's non-blocking function on buffers that the pending request owns
// (requests.h): a copy of what this rank sends, the result, the rows arriving
// (packed for a batch, or beyond capacity) and the count arrays, which MPI uses
// until the request completes; the wait places the rows and reports the call's
// error, after the exchange every rank took part in.
class Transfer {
 public:
  Transfer(Call& call, int64_t comm_key, Rows& rows, const Buffer& x, const Sending& from,
           const Counts& arriving, Result& out, Result* request)
      : rows_(rows),
        arriving_(arriving),
        request_(request),
        pending_{call.operation(), comm_key, call.checking()} {
    if (!posting()) {
      in = from.data;
      into = rows.destination(arriving, scratch_);
      return;
    }
    // (A batch with no rows to send packs none: x then, as for one member.)
    in = from.packed.empty() ? pending_.own_copy(x.untyped_data(), x.size_bytes())
                             : pending_.own_copy(from.packed.data(), from.packed.size());
    result_ = pending_.own_result(out->size_bytes());
    direct_ = !Blocks(arriving).packed() && rows.fits(arriving);
    into =
        direct_ ? result_ : pending_.own(static_cast<size_t>(arriving.total() * rows.row_bytes()));
    if (direct_) place(result_, result_, arriving, rows.capacity(), rows.row_bytes());
  }

  bool posting() const { return request_ != nullptr; }
  // What MPI's function reads `values` from: a copy the request owns for a start.
  template <typename T>
  const T* keep(const PerPeer<T>& values) {
    if (!posting()) return values.data();
    return reinterpret_cast<const T*>(pending_.own_copy(values.data(), values.size() * sizeof(T)));
  }
  // MPI's function `blocking`, or `start` with the request, on `args`.
  template <typename Blocking, typename Start, typename... Args>
  int call(Blocking blocking, Start start, Args... args) {
    return posting() ? start(args..., &pending_.requests.emplace_back()) : blocking(args...);
  }

  // Ends the call after MPI's function returned `code`: `counts` go to
  // counts_out; the rows are placed now, or by the wait, which reports `error`
  // (a start's own failure is only MPI's). `error` comes after the exchange: it
  // is paired (lockstep.h).
  ffi::Error end(int code, Result& counts_out, const Counts& counts, ffi::Error error) {
    JAXCOMM_CHECK_MPI(code, pending_.operation, rows_.comm());
    write_counts(counts_out, counts);
    if (!posting()) {
      place(rows_.result(), into, arriving_, rows_.capacity(), rows_.row_bytes());
      return paired(std::move(error));
    }
    pending_.finish = [result = result_, into = into, direct = direct_, capacity = rows_.capacity(),
                       row_bytes = rows_.row_bytes(), members = arriving_.members(),
                       per_member = arriving_.per_member(),
                       values =
                           std::vector<int>(arriving_.values().begin(), arriving_.values().end()),
                       error = std::move(error)](Call&, const MPI_Status*, int32_t*) mutable {
      if (!direct)
        place(result, into, Counts(std::move(values), members, per_member), capacity, row_bytes);
      return paired(std::move(error));
    };
    return post((*request_)->untyped_data(), std::move(pending_));
  }

  const char* in = nullptr;  // the rows this rank sends
  char* into = nullptr;      // where the rows arriving go

 private:
  Rows& rows_;
  const Counts& arriving_;
  Result* request_;
  Pending pending_;
  std::vector<char> scratch_;
  char* result_ = nullptr;
  bool direct_ = false;
};

// Counts of rows per peer in the unit of `rows.fit`: a batch's per peer (all
// members together, as they travel), or the one member's.
template <typename C>
C per_peer(const Rows& rows, const Counts& counts, Blocks& blocks) {
  return counts.members() > 1 ? rows.counted<C>(blocks.per_peer())
                              : rows.counted<C>(counts.member(0));
}

// Zeros where rows from beyond a grid's edge would arrive at `into`.
void zero_missing(const Peers& peers, const Rows& rows, const Counts& received, Blocks& blocks,
                  char* into) {
  if (received.members() > 1)
    peers.zero_missing(into, blocks.per_peer(), rows.row_bytes());
  else
    peers.zero_missing(into, received.member(0), rows.row_bytes());
}

// alltoallv and neighbor_alltoallv: send_counts[j] rows to destination j, of
// every rank (neighbors false) or of the graph's or grid's. With `request`, the
// start of ialltoallv (ineighbor_alltoallv): the counts are known at the post
// (given, or exchanged then with a blocking MPI_Alltoall) and returned at once.
ffi::Error exchange_rows(bool neighbors, const Buffer& x, const Buffer& send_counts,
                         const Buffer& given_counts, Result& out, Result& recv_counts,
                         Result* request, int64_t comm_key, bool check, int32_t counting,
                         int32_t agree) {
  Call call(comm_key, check);
  const bool exchange = counting == kExchanged;
  Rows rows(call, x, out, batch_of(send_counts, 1), exchange, "recv_counts");
  if (auto err = rows.take_error(); err.failure()) return err;
  Peers peers;
  if (auto err = Peers::of(call, neighbors, &peers); err.failure()) return err;
  PerPeer<int> exchanged;  // viewed by received_counts
  std::optional<Counts> own, received_counts;
  if (auto err = alltoallv_counts(call, rows, peers, send_counts, given_counts, counting, check,
                                  own, exchanged, received_counts);
      err.failure())
    return err;
  std::optional<Counts> padded;
  const Counts& sent = sent_counts(*own, counting, padded);
  const Counts& received = *received_counts;
  if (auto err = rows.fit(sent.total(), received.total()); err.failure()) return err;
  auto error = rows.agreed_outcome(*own, pads(*own, counting), received, agree);
  if (agree && error.failure()) return error;
  const Sending from = sending(rows, x, *own, counting);
  Transfer t(call, comm_key, rows, x, from, received, out, request);
  Blocks out_blocks(sent), in_blocks(received);
  zero_missing(peers, rows, received, in_blocks, t.into);
  const int code = rows.in_units([&]<typename C>(C) {
    C send = per_peer<C>(rows, sent, out_blocks);
    if (t.posting()) peers.pair_posted_as_standard(send);
    const C recv = per_peer<C>(rows, received, in_blocks);
    return t.call(neighbors ? Functions<C>::neighbor_alltoallv : Functions<C>::alltoallv,
                  neighbors ? Functions<C>::ineighbor_alltoallv : Functions<C>::ialltoallv, t.in,
                  t.keep(send.counts), t.keep(send.starts), rows.type(), t.into,
                  t.keep(recv.counts), t.keep(recv.starts), rows.type(), rows.comm());
  });
  return t.end(code, recv_counts, received, std::move(error));
}

}  // namespace

ffi::Error Alltoallv(Token, Buffer x, Buffer send_counts, Buffer given_counts, TokenOut, Result out,
                     Result recv_counts, int64_t comm_key, bool check, int32_t counting,
                     int32_t agree) {
  return exchange_rows(false, x, send_counts, given_counts, out, recv_counts, nullptr, comm_key,
                       check, counting, agree);
}

ffi::Error NeighborAlltoallv(Token, Buffer x, Buffer send_counts, Buffer given_counts, TokenOut,
                             Result out, Result recv_counts, int64_t comm_key, bool check,
                             int32_t counting, int32_t agree) {
  return exchange_rows(true, x, send_counts, given_counts, out, recv_counts, nullptr, comm_key,
                       check, counting, agree);
}

ffi::Error Ialltoallv(Token, Buffer x, Buffer send_counts, Buffer given_counts, TokenOut,
                      Result out, Result request, Result /*keep*/, Result recv_counts,
                      int64_t comm_key, bool check, int32_t counting, int32_t agree) {
  return exchange_rows(false, x, send_counts, given_counts, out, recv_counts, &request, comm_key,
                       check, counting, agree);
}

ffi::Error IneighborAlltoallv(Token, Buffer x, Buffer send_counts, Buffer given_counts, TokenOut,
                              Result out, Result request, Result /*keep*/, Result recv_counts,
                              int64_t comm_key, bool check, int32_t counting, int32_t agree) {
  return exchange_rows(true, x, send_counts, given_counts, out, recv_counts, &request, comm_key,
                       check, counting, agree);
}

// allgatherv, neighbor_allgatherv and gatherv: each member's first `count` rows
// of x from every rank, to every rank (neighbors: from each source, to every
// destination; gatherv: to root only). `root` < 0: allgatherv.
namespace {

ffi::Error gather_rows(Call& call, bool neighbors, const Buffer& x, const Buffer& count,
                       const Buffer& given_counts, Result& out, Result& counts_out, Result* request,
                       int64_t comm_key, bool check, int32_t counting, bool agree, int root) {
  const bool exchange = counting == kExchanged;
  Rows rows(call, x, out, batch_of(count, 0), exchange, "counts");
  if (auto err = rows.take_error(); err.failure()) return err;
  MPI_Comm comm = rows.comm();
  Peers peers;
  if (auto err = Peers::of(call, neighbors, &peers); err.failure()) return err;
  const int size = peers.sources(), rank = comm_rank(comm);
  const bool everyone = root < 0, receives = everyone || rank == root;
  const int64_t members = rows.members();
  Counts own(count, "count", members, 1);
  own.within(rows.rows());
  std::optional<Counts> padded;
  const Counts& sent = sent_counts(own, counting, padded);
  PerPeer<int> exchanged(static_cast<size_t>(members * size), 0);  // viewed by `counts`
  // allgatherv's result is one value on every rank: where it lacks a rank's
  // rows (a refused count) or does not fit a rank's capacity, every rank raises.
  // So each rank sends its capacity beside each count, and -1 for a refused one.
  // (A neighbour's result is its own, as alltoallv's: a refused count is 0.)
  const bool replicated = everyone && !neighbors;
  std::string everyone_fails;
  if (exchange || check) {
    const int per_rank = static_cast<int>(replicated ? 2 * members : members);
    // Never a null buffer (PerPeer's never is): MPI may refuse one even where no
    // peer reads it.
    PerPeer<int> mine(per_rank), in(static_cast<size_t>(per_rank) * size);
    for (int64_t b = 0; b < members; ++b) {
      const int c = replicated && !own.valid() ? -1 : sent.member(b)[0];
      if (replicated) {
        mine[2 * b] = c;
        mine[2 * b + 1] = static_cast<int>(std::min<int64_t>(rows.capacity(), kMaxCount));
      } else {
        mine[b] = c;
      }
    }
    JAXCOMM_CHECK_MPI(everyone ? peers.allgather(mine.data(), in.data(), per_rank, comm)
                               : MPI_Gather(mine.data(), per_rank, MPI_INT, in.data(), per_rank,
                                            MPI_INT, root, comm),
                      call.operation(), comm);
    if (replicated) {  // counts and capacities apart; who makes every rank fail
      PerPeer<int> capacities(size), totals(members, 0);
      for (int r = 0; r < size; ++r)
        for (int64_t b = 0; b < members; ++b) {
          int& c = in[(r * members + b) * 2];
          if (c < 0 && everyone_fails.empty())
            everyone_fails = "rank " + std::to_string(r) +
                             "'s count was refused, so every rank's rows lack its rows";
          c = std::max(c, 0);
          totals[b] += c;
          capacities[r] = in[(r * members + b) * 2 + 1];
          in[r * members + b] = c;  // compacted in place: index <= the pair's
        }
      const int64_t most = *std::max_element(totals.begin(), totals.end());
      for (int r = 0; r < size && everyone_fails.empty(); ++r)
        if (capacities[r] < most)
          everyone_fails = "rank " + std::to_string(r) +
                           "'s capacity=" + std::to_string(capacities[r]) + " is less than the " +
                           std::to_string(most) + " rows gathered";
      in.resize(static_cast<size_t>(members) * size);
    }
    PerPeer<int> storage;
    const auto back = transposed(in, size, members, storage);
    std::copy(back.begin(), back.end(), exchanged.begin());
  }
  std::optional<Counts> counts;
  if (receives) {
    if (auto err =
            received_counts(rows, counting, check, given_counts, "counts", exchanged, size, counts);
        err.failure())
      return err;
  } else {
    // Only the root receives: elsewhere the counts output holds this rank's own
    // count at its rank and zeros elsewhere. Checking mode agrees with the root.
    std::vector<int> mine(static_cast<size_t>(members * size), 0);
    for (int64_t b = 0; b < members; ++b) mine[b * size + rank] = sent.member(b)[0];
    if (check && counting == kGiven)  // as received_counts on the root
      if (auto err = rows.agree(false, "counts", "", {}); err.failure()) return err;
    counts.emplace(std::move(mine), members, size);
  }
  const Counts& received = *counts;
  std::optional<Counts> none;  // what arrives off the root
  if (!receives)
    none.emplace(std::vector<int>(static_cast<size_t>(members * size), 0), members, size);
  const Counts& arriving = receives ? received : *none;
  if (auto err = rows.fit(sent.total(), arriving.total()); err.failure()) return err;
  // Off the root the counts output holds this rank's own count (received).
  // allgatherv's error is every rank's already (everyone_fails): no agreement.
  auto error = rows.agreed_outcome(own, pads(own, counting), arriving, agree && !replicated);
  if (!everyone_fails.empty())  // then every rank fails: with its own error, or this one
    error = on_every_rank(error.success() ? rows.refuse(everyone_fails) : std::move(error));
  if (agree && error.failure()) return error;
  const Sending from = sending(rows, x, own, counting);
  Transfer t(call, comm_key, rows, x, from, arriving, out, request);
  Blocks in_blocks(arriving);
  zero_missing(peers, rows, arriving, in_blocks, t.into);
  const int code = rows.in_units([&]<typename C>(C) {
    const C recv = per_peer<C>(rows, arriving, in_blocks);
    const auto mine = rows.unit<typename C::Count>(sent.total());
    if (everyone)
      return t.call(neighbors ? Functions<C>::neighbor_allgatherv : Functions<C>::allgatherv,
                    neighbors ? Functions<C>::ineighbor_allgatherv : Functions<C>::iallgatherv,
                    t.in, mine, rows.type(), t.into, t.keep(recv.counts), t.keep(recv.starts),
                    rows.type(), comm);
    return t.call(Functions<C>::gatherv, Functions<C>::igatherv, t.in, mine, rows.type(), t.into,
                  t.keep(recv.counts), t.keep(recv.starts), rows.type(), root, comm);
  });
  return t.end(code, counts_out, received, std::move(error));
}

}  // namespace

ffi::Error Allgatherv(Token, Buffer x, Buffer count, Buffer given_counts, TokenOut, Result out,
                      Result counts_out, int64_t comm_key, bool check, int32_t exchange,
                      int32_t agree) {
  Call call(comm_key, check);
  return gather_rows(call, false, x, count, given_counts, out, counts_out, nullptr, comm_key, check,
                     exchange, agree, -1);
}

ffi::Error NeighborAllgatherv(Token, Buffer x, Buffer count, Buffer given_counts, TokenOut,
                              Result out, Result counts_out, int64_t comm_key, bool check,
                              int32_t exchange, int32_t agree) {
  Call call(comm_key, check);
  return gather_rows(call, true, x, count, given_counts, out, counts_out, nullptr, comm_key, check,
                     exchange, agree, -1);
}

ffi::Error Gatherv(Token, Buffer x, Buffer count, Buffer given_counts, TokenOut, Result out,
                   Result counts_out, int64_t comm_key, bool check, int32_t root, int32_t exchange,
                   int32_t agree) {
  Call call(comm_key, check);
  call.param("root", root);
  return gather_rows(call, false, x, count, given_counts, out, counts_out, nullptr, comm_key, check,
                     exchange, agree, root);
}

namespace {

// scatterv: root's counts[i] rows of each member to rank i.
ffi::Error scatter_rows(const Buffer& x, const Buffer& counts, const Buffer& given_count,
                        Result& out, Result& count_out, Result* request, int64_t comm_key,
                        bool check, int32_t root, int32_t counting, int32_t agree) {
  Call call(comm_key, check);
  const bool exchange = counting == kExchanged;
  call.param("root", root);
  Rows rows(call, x, out, batch_of(counts, 1), exchange, "count");
  if (auto err = rows.take_error(); err.failure()) return err;
  MPI_Comm comm = rows.comm();
  const int size = comm_size(comm);
  const bool is_root = comm_rank(comm) == root;
  const int64_t members = rows.members();
  // Only the root's counts are read; elsewhere they are none.
  const PerPeer<int> none(is_root ? 0 : static_cast<size_t>(members * size), 0);
  std::optional<Counts> own;
  if (is_root) {
    own.emplace(counts, "counts", members, size).within(rows.rows());
  } else {
    own.emplace(Counts::Viewed{}, none, members, size);
  }
  std::optional<Counts> padded;
  const Counts& sent = sent_counts(*own, counting, padded);
  PerPeer<int> exchanged(static_cast<size_t>(members), 0);  // viewed by received_list
  if (exchange || check) {
    PerPeer<int> storage;
    const auto out_counts = transposed(sent.values(), members, size, storage);
    const int n = static_cast<int>(members);
    JAXCOMM_CHECK_MPI(
        MPI_Scatter(out_counts.data(), n, MPI_INT, exchanged.data(), n, MPI_INT, root, comm),
        call.operation(), comm);
  }
  std::optional<Counts> received_list;
  if (auto err =
          received_counts(rows, counting, check, given_count, "count", exchanged, 1, received_list);
      err.failure())
    return err;
  const Counts& received = *received_list;
  if (auto err = rows.fit(sent.total(), received.total()); err.failure()) return err;
  auto error = rows.agreed_outcome(*own, pads(*own, counting), received, agree);
  if (agree && error.failure()) return error;
  const Sending from = is_root ? sending(rows, x, *own, counting)
                               : Sending{static_cast<const char*>(x.untyped_data()), {}};
  Transfer t(call, comm_key, rows, x, from, received, out, request);
  Blocks out_blocks(sent);
  const int code = rows.in_units([&]<typename C>(C) {
    const C send =
        members > 1 ? rows.counted<C>(out_blocks.per_peer()) : rows.counted<C>(sent.member(0));
    return t.call(Functions<C>::scatterv, Functions<C>::iscatterv, t.in, t.keep(send.counts),
                  t.keep(send.starts), rows.type(), t.into,
                  rows.unit<typename C::Count>(received.total()), rows.type(), root, comm);
  });
  return t.end(code, count_out, received, std::move(error));
}

}  // namespace

ffi::Error Scatterv(Token, Buffer x, Buffer counts, Buffer given_count, TokenOut, Result out,
                    Result count_out, int64_t comm_key, bool check, int32_t root, int32_t counting,
                    int32_t agree) {
  return scatter_rows(x, counts, given_count, out, count_out, nullptr, comm_key, check, root,
                      counting, agree);
}

ffi::Error Iallgatherv(Token, Buffer x, Buffer count, Buffer given_counts, TokenOut, Result out,
                       Result request, Result /*keep*/, Result counts_out, int64_t comm_key,
                       bool check, int32_t exchange, int32_t agree) {
  Call call(comm_key, check);
  return gather_rows(call, false, x, count, given_counts, out, counts_out, &request, comm_key,
                     check, exchange, agree, -1);
}

ffi::Error IneighborAllgatherv(Token, Buffer x, Buffer count, Buffer given_counts, TokenOut,
                               Result out, Result request, Result /*keep*/, Result counts_out,
                               int64_t comm_key, bool check, int32_t exchange, int32_t agree) {
  Call call(comm_key, check);
  return gather_rows(call, true, x, count, given_counts, out, counts_out, &request, comm_key, check,
                     exchange, agree, -1);
}

ffi::Error Igatherv(Token, Buffer x, Buffer count, Buffer given_counts, TokenOut, Result out,
                    Result request, Result /*keep*/, Result counts_out, int64_t comm_key,
                    bool check, int32_t root, int32_t exchange, int32_t agree) {
  Call call(comm_key, check);
  call.param("root", root);
  return gather_rows(call, false, x, count, given_counts, out, counts_out, &request, comm_key,
                     check, exchange, agree, root);
}

ffi::Error Iscatterv(Token, Buffer x, Buffer counts, Buffer given_count, TokenOut, Result out,
                     Result request, Result /*keep*/, Result count_out, int64_t comm_key,
                     bool check, int32_t root, int32_t counting, int32_t agree) {
  return scatter_rows(x, counts, given_count, out, count_out, &request, comm_key, check, root,
                      counting, agree);
}

}  // namespace jaxcomm::mpi
