// jaxcomm's operations on host memory: the MPI glue behind every XLA FFI handler,
// and the CPU handlers themselves. The CUDA module (mpi_cuda.cc) calls the same
// functions on staged host copies of device buffers.
//
// Every handler takes the ordered-effect token first and returns it first, so XLA
// keeps the calls in program order. Buffers are XLA's own: no staging copies. When
// XLA aliases an output with an input (donation), the op runs in place.

#include <mpi.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <complex>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "call.h"
#include "jaxcomm/jaxcomm.h"
#include "ops.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::host {

// ---------------------------------------------------------------------------
// Buffer contents

namespace {

thread_local const Memory* current_memory = nullptr;

template <typename T>
void fill_as(void* to, const void* element, int64_t count) {
  T value;
  std::memcpy(&value, element, sizeof value);
  std::fill_n(static_cast<T*>(to), count, value);
}

struct Bytes16 {
  unsigned char b[16];
};

}  // namespace

void Memory::copy(void* to, const void* from, size_t bytes) const {
  if (bytes > 0) std::memcpy(to, from, bytes);
}

void Memory::fill(void* to, const void* element, size_t width, int64_t count) const {
  switch (width) {
    case 1:
      std::memset(to, *static_cast<const unsigned char*>(element), static_cast<size_t>(count));
      return;
    case 2:
      return fill_as<uint16_t>(to, element, count);
    case 4:
      return fill_as<uint32_t>(to, element, count);
    case 8:
      return fill_as<uint64_t>(to, element, count);
    default:
      return fill_as<Bytes16>(to, element, count);
  }
}

void Memory::edit(void* data, size_t, const std::function<void(void*)>& change) const {
  change(data);
}

bool Memory::on_host() const { return true; }

const Memory& memory() {
  static const Memory host_memory;
  return current_memory ? *current_memory : host_memory;
}

UseMemory::UseMemory(const Memory& m) : previous_(current_memory) { current_memory = &m; }
UseMemory::~UseMemory() { current_memory = previous_; }

namespace {

char* bytes(const Buffer& b) { return static_cast<char*>(b.untyped_data()); }
char* bytes(Result& b) { return static_cast<char*>(b->untyped_data()); }

size_t element_size(const Buffer& b) { return ffi::ByteWidth(b.element_type()); }

int comm_size(MPI_Comm comm) {
  int size;
  MPI_Comm_size(comm, &size);
  return size;
}

void copy_if_distinct(Result& out, const Buffer& in) {
  if (bytes(out) != bytes(in)) memory().copy(bytes(out), bytes(in), in.size_bytes());
}

void zero(Result& out) {
  const unsigned char nothing = 0;
  memory().fill(out->untyped_data(), &nothing, 1, static_cast<int64_t>(out->size_bytes()));
}

ffi::Error datatype_of(const Buffer& x, std::string_view op, MPI_Datatype* type) {
  *type = mpi_datatype(x.element_type());
  if (*type == MPI_DATATYPE_NULL) return invalid_argument(op, "unsupported dtype");
  return ffi::Error::Success();
}

ffi::Error reduction_of(const Buffer& x, int32_t op, std::string_view name, MPI_Datatype* type,
                        MPI_Op* mpi) {
  if (auto err = datatype_of(x, name, type); err.failure()) return err;
  *mpi = mpi_op(static_cast<ReduceOp>(op), x.element_type());
  if (*mpi == MPI_OP_NULL) return invalid_argument(name, "reduction not supported for this dtype");
  return ffi::Error::Success();
}

// Element-wise reduction of `count` elements, in pieces that fit an int count.
template <typename Call>
int reduce_pieces(const void* in, void* out, int64_t count, MPI_Datatype type, Call&& call) {
  MPI_Aint lb, extent;
  MPI_Type_get_extent(type, &lb, &extent);
  const bool in_place = in == out;
  return for_each_piece(count, [&](int64_t offset, int piece) {
    char* o = static_cast<char*>(out) + offset * extent;
    const void* i = in_place ? MPI_IN_PLACE : static_cast<const char*>(in) + offset * extent;
    return call(i, o, piece);
  });
}

// One element holding the identity of a reduction: exscan's result on rank 0.
struct Element {
  alignas(16) unsigned char bytes[16] = {};
  size_t width = 1;
};

template <typename T>
Element element(T value) {
  static_assert(sizeof(T) <= sizeof(Element::bytes));
  Element e;
  std::memcpy(e.bytes, &value, sizeof value);
  e.width = sizeof value;
  return e;
}

template <typename T>
T identity_as(ReduceOp op) {
  switch (op) {
    case ReduceOp::kProd:
    case ReduceOp::kLand:
      return T(1);
    case ReduceOp::kBand:
      if constexpr (std::is_integral_v<T>) return static_cast<T>(~T(0));
      break;
    case ReduceOp::kMax:
      if constexpr (std::is_floating_point_v<T>) return -std::numeric_limits<T>::infinity();
      if constexpr (std::is_integral_v<T>) return std::numeric_limits<T>::lowest();
      break;
    case ReduceOp::kMin:
      if constexpr (std::is_floating_point_v<T>) return std::numeric_limits<T>::infinity();
      if constexpr (std::is_integral_v<T>) return std::numeric_limits<T>::max();
      break;
    default:
      break;
  }
  return T(0);
}

template <typename T>
constexpr bool is_complex = false;
template <typename T>
constexpr bool is_complex<std::complex<T>> = true;

Element identity(ffi::DataType dtype, ReduceOp op) {
  Element e;
  visit_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if constexpr (std::is_same_v<T, bool>) {
      e = element<bool>(op == ReduceOp::kLand || op == ReduceOp::kBand || op == ReduceOp::kMin);
    } else if constexpr (std::is_same_v<T, Float16Bits>) {
      e = element(half::float_to_f16(identity_as<float>(op)));
    } else if constexpr (std::is_same_v<T, Bfloat16Bits>) {
      e = element(half::float_to_bf16(identity_as<float>(op)));
    } else if constexpr (is_complex<T>) {
      e = element(T(op == ReduceOp::kProd ? 1 : 0));
    } else {
      e = element(identity_as<T>(op));
    }
  });
  return e;
}

void fill_identity(Result& out, ReduceOp op) {
  const Element e = identity(out->element_type(), op);
  memory().fill(out->untyped_data(), e.bytes, e.width,
                static_cast<int64_t>(out->size_bytes() / e.width));
}

// MPI's logical operators on integers pass a lone operand through unchanged (one
// rank, scan on rank 0); jaxcomm's logical results are always 0 or 1.
template <typename T>
void to_truth(void* out, int64_t n) {
  T* p = static_cast<T*>(out);
  for (int64_t i = 0; i < n; ++i) p[i] = p[i] != 0;
}

void to_truth(void* out, int64_t n, ffi::DataType dtype) {
  switch (ffi::ByteWidth(dtype)) {
    case 1:
      return to_truth<uint8_t>(out, n);
    case 2:
      return to_truth<uint16_t>(out, n);
    case 4:
      return to_truth<uint32_t>(out, n);
    default:
      return to_truth<uint64_t>(out, n);
  }
}

void normalize_logical(Result& out, int32_t op) {
  auto reduce_op = static_cast<ReduceOp>(op);
  if (reduce_op != ReduceOp::kLand && reduce_op != ReduceOp::kLor && reduce_op != ReduceOp::kLxor)
    return;
  const ffi::DataType dtype = out->element_type();
  using D = ffi::DataType;
  for (D integer : {D::S8, D::S16, D::S32, D::S64, D::U8, D::U16, D::U32, D::U64}) {
    if (dtype != integer) continue;
    const int64_t n = out->element_count();
    return memory().edit(out->untyped_data(), out->size_bytes(),
                         [&](void* data) { to_truth(data, n, dtype); });
  }
}

}  // namespace

// ---------------------------------------------------------------------------
// Waiting for messages

namespace {

// Waits for `n` requests by polling MPI_Testall, yielding the core between
// polls once kPollsBeforeYield have found them unfinished, so that a rank that
// waits long leaves the core to ranks that share it. MPICH's own blocking
// waits cost more than a small message: with the MPICH wheel on 2 ranks,
// MPI_Sendrecv of 4 B took 1.08 us (MPI_THREAD_MULTIPLE; most of it in
// sched_yield) and 0.98 us (SERIALIZED), MPI_Irecv, MPI_Isend and this loop
// 0.30 and 0.24 us.
int wait_all(int n, MPI_Request* requests, MPI_Status* statuses) {
  constexpr int kPollsBeforeYield = 1000;
  for (int polls = 0;; ++polls) {
    int done = 0;
    const int code = MPI_Testall(n, requests, &done, statuses);
    if (code == MPI_ERR_IN_STATUS) {
      for (int i = 0; i < n; ++i)
        if (statuses[i].MPI_ERROR != MPI_SUCCESS && statuses[i].MPI_ERROR != MPI_ERR_PENDING)
          return statuses[i].MPI_ERROR;
    }
    if (code != MPI_SUCCESS || done) return code;
    if (polls >= kPollsBeforeYield) std::this_thread::yield();
  }
}

// Cancels and frees the first n requests, which were posted, when posting the
// next failed: none outlives the call.
void abandon(int n, MPI_Request* requests) {
  for (int i = 0; i < n; ++i) {
    MPI_Cancel(&requests[i]);
    MPI_Request_free(&requests[i]);
  }
}

// MPI_Send, MPI_Recv and MPI_Sendrecv, completed by wait_all.
int send(const void* data, int n, MPI_Datatype type, int dest, int tag, MPI_Comm comm) {
  MPI_Request request;
  MPI_Status status;
  const int code = MPI_Isend(data, n, type, dest, tag, comm, &request);
  return code == MPI_SUCCESS ? wait_all(1, &request, &status) : code;
}

int recv(void* data, int n, MPI_Datatype type, int source, int tag, MPI_Comm comm,
         MPI_Status* status) {
  MPI_Request request;
  const int code = MPI_Irecv(data, n, type, source, tag, comm, &request);
  return code == MPI_SUCCESS ? wait_all(1, &request, status) : code;
}

int sendrecv(const void* send_data, int send_n, MPI_Datatype send_type, int dest, int send_tag,
             void* recv_data, int recv_n, MPI_Datatype recv_type, int source, int recv_tag,
             MPI_Comm comm, MPI_Status* status) {
  MPI_Request requests[2];
  MPI_Status statuses[2];
  int code = MPI_Irecv(recv_data, recv_n, recv_type, source, recv_tag, comm, &requests[0]);
  if (code != MPI_SUCCESS) return code;
  code = MPI_Isend(send_data, send_n, send_type, dest, send_tag, comm, &requests[1]);
  if (code != MPI_SUCCESS) {
    abandon(1, requests);
    return code;
  }
  code = wait_all(2, requests, statuses);
  *status = statuses[0];
  return code;
}

}  // namespace

// ---------------------------------------------------------------------------
// jaxcomm's own exchanges in host memory. Allreduce, bcast, scan, exscan,
// allgather, alltoall and reduce_scatter of small host buffers, and allreduce,
// scan, allgather and alltoall of large ones, run as jaxcomm's own
// point-to-point messages rather than MPI's collectives: small ones so that
// they wait by polling (above), large ones so that jaxcomm decides where each
// outgoing piece is read from (see docs/performance.md, "Small messages" and
// "Large exchanges in host memory").

namespace {

// Messages from this size on (a block for alltoall and allgather, the whole
// array for allreduce and scan) take jaxcomm's own exchanges.
constexpr int64_t kExchangeBytes = int64_t{64} << 10;
// Their pieces: large enough that their latency does not show, small enough
// that a scratch stays in cache.
constexpr int64_t kPieceBytes = int64_t{1} << 20;

// The communicator that carries an exchange's messages: a duplicate of the
// program's, made by the first exchange on it and freed with it. On the
// program's own communicator, a recv from any source with any tag on one rank
// could take a piece that a third rank, already in an exchange, sent it.
int free_exchange_comm(MPI_Comm, int, void* attribute, void*) {
  auto* duplicate = static_cast<MPI_Comm*>(attribute);
  const int code = MPI_Comm_free(duplicate);
  delete duplicate;
  return code;
}

int exchange_comm(MPI_Comm comm, MPI_Comm* exchange) {
  static const int keyval = [] {
    int k = MPI_KEYVAL_INVALID;
    MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, free_exchange_comm, &k, nullptr);
    return k;
  }();
  MPI_Comm* duplicate = nullptr;
  int found = 0;
  if (int code = MPI_Comm_get_attr(comm, keyval, &duplicate, &found); code != MPI_SUCCESS)
    return code;
  if (!found) {
    duplicate = new MPI_Comm(MPI_COMM_NULL);
    if (int code = MPI_Comm_dup(comm, duplicate); code != MPI_SUCCESS) {
      delete duplicate;
      return code;
    }
    if (int code = MPI_Comm_set_attr(comm, keyval, duplicate); code != MPI_SUCCESS) {
      free_exchange_comm(comm, keyval, duplicate, nullptr);
      return code;
    }
  }
  *exchange = *duplicate;
  return MPI_SUCCESS;
}

constexpr int kExchangeTag = 0;

// memcpy with non-temporal stores where the target has them: the data goes to
// memory without displacing the cache or claiming the lines from the other
// core that last read them.
void streaming_copy(char* to, const char* from, size_t n) {
#if defined(__SSE2__)
  const size_t head = std::min(n, (16 - reinterpret_cast<uintptr_t>(to) % 16) % 16);
  std::memcpy(to, from, head);
  size_t i = head;
  for (; i + 64 <= n; i += 64) {
    for (size_t j = i; j < i + 64; j += 16) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(from + j));
      _mm_stream_si128(reinterpret_cast<__m128i*>(to + j), v);
    }
  }
  std::memcpy(to + i, from + i, n - i);
  _mm_sfence();
#else
  std::memcpy(to, from, n);
#endif
}

// How an exchange writes the data that a partner then reads: with plain stores
// (or not at all, sending straight from the operand), or with streaming stores
// into a scratch. Which is faster depends on where the partner runs, and on a
// VM that can change within minutes. When the two cores share a cache, a plain
// copy, or none, leaves the data in the cache that the partner reads it from.
// When they do not, the partner's reads of lines this core has just written,
// and this core's later writes to lines the partner has read, cost several
// times a copy; streaming stores, which write around the cache, avoid both. So
// each process times its exchanges and keeps the faster copy for each exchange
// and size, trying the other now and then. The choice is local: the messages
// are the same either way.
enum class Copy { kPlain, kStreaming };
enum class Exchange { kAlltoall, kAllgather, kAllreduce, kScan };
constexpr int kExchanges = 4;

class CopyChooser {
 public:
  Copy choose(Exchange exchange, int64_t bytes) {
    if (const char* forced = std::getenv("JAXCOMM_COPY")) {
      if (std::strcmp(forced, "plain") == 0) return Copy::kPlain;
      if (std::strcmp(forced, "streaming") == 0) return Copy::kStreaming;
    }
    std::lock_guard<std::mutex> lock(mutex_);
    SizeClass& size_class = class_of(exchange, bytes);
    const uint64_t call = size_class.calls++;
    for (Copy copy : {Copy::kPlain, Copy::kStreaming})
      if (size_class.seconds[index(copy)] == 0) return copy;
    const bool streaming_faster =
        size_class.seconds[index(Copy::kStreaming)] < size_class.seconds[index(Copy::kPlain)];
    const bool explore = call % kExploreEvery == 0;
    return streaming_faster != explore ? Copy::kStreaming : Copy::kPlain;
  }

  void record(Exchange exchange, int64_t bytes, Copy copy, double seconds) {
    std::lock_guard<std::mutex> lock(mutex_);
    SizeClass& size_class = class_of(exchange, bytes);
    if (size_class.calls <= 1) return;  // the first call also touches the scratch's new pages
    double& estimate = size_class.seconds[index(copy)];
    // Quick to follow a faster time; slow, and clamped, to follow a slower one,
    // which may be a partner arriving late rather than the copy.
    if (estimate == 0 || seconds < estimate)
      estimate = estimate == 0 ? seconds : (estimate + seconds) / 2;
    else
      estimate += (std::min(seconds, 2 * estimate) - estimate) / 4;
  }

 private:
  // Rare enough to cost little when the other copy is much slower (2.7x in the
  // worst case measured), often enough to follow a change within a few hundred
  // calls.
  static constexpr uint64_t kExploreEvery = 32;
  struct SizeClass {
    double seconds[2] = {0, 0};
    uint64_t calls = 0;
  };
  SizeClass& class_of(Exchange exchange, int64_t bytes) {  // sizes by powers of 4
    return classes_[static_cast<int>(exchange)][std::bit_width(static_cast<uint64_t>(bytes)) / 2];
  }
  static int index(Copy copy) { return copy == Copy::kStreaming ? 1 : 0; }

  std::mutex mutex_;
  SizeClass classes_[kExchanges][33];
};

// The copy chosen for one exchange, whose time it records when it goes.
class ChosenCopy {
 public:
  ChosenCopy(Exchange exchange, int64_t bytes)
      : exchange_(exchange), bytes_(bytes), copy_(chooser().choose(exchange, bytes)) {}
  ~ChosenCopy() {
    const std::chrono::duration<double> took = std::chrono::steady_clock::now() - started_;
    chooser().record(exchange_, bytes_, copy_, took.count());
  }
  // Copies n bytes with the chosen stores.
  void copy(char* to, const char* from, size_t n) const {
    if (copy_ == Copy::kStreaming)
      streaming_copy(to, from, n);
    else
      std::memcpy(to, from, n);
  }

  // Where to send n bytes at `from` from: there, or a streaming copy in `scratch`.
  const char* outgoing(const char* from, size_t n, std::vector<char>& scratch) const {
    if (copy_ == Copy::kPlain) return from;
    scratch.resize(std::max(scratch.size(), static_cast<size_t>(kPieceBytes)));
    streaming_copy(scratch.data(), from, n);
    return scratch.data();
  }

 private:
  static CopyChooser& chooser() {
    static CopyChooser instance;
    return instance;
  }
  Exchange exchange_;
  int64_t bytes_;
  Copy copy_;
  std::chrono::steady_clock::time_point started_ = std::chrono::steady_clock::now();
};

// Small allgather, alltoall and reduce_scatter send p - 1 messages at once
// (below); beyond this many ranks, MPI's collectives, which take log p rounds
// of fewer messages, stay theirs.
constexpr int kMostPostedRanks = 8;

// Which exchange an op of `bytes` (as kExchangeBytes counts them) takes: MPI's
// collective, or jaxcomm's own for small messages or for large ones. Only in
// host memory: CUDA-aware calls hand device pointers to MPI's collectives.
// `posted` marks the small exchanges whose messages are all posted at once.
enum class Route { kMpi, kSmall, kLarge };
Route route(int64_t bytes, MPI_Comm comm, bool posted = false) {
  const int size = comm_size(comm);
  if (size == 1 || !memory().on_host()) return Route::kMpi;
  if (bytes >= kExchangeBytes) return Route::kLarge;
  return posted && size > kMostPostedRanks ? Route::kMpi : Route::kSmall;
}

// Every rank has to choose alike; the choice follows from the array's shape and
// dtype, which checking mode compares, and from where it lives, which this adds
// to the call's description.
void describe_memory(Call& call) {
  if (!memory().on_host()) call.param("device", 1);
}

// This thread's scratch for one incoming piece, kept from call to call.
char* incoming_scratch() {
  thread_local std::vector<char> scratch(kPieceBytes);
  return scratch.data();
}

// Calls fn(offset, n) for consecutive pieces of at most kPieceBytes of `bytes`
// bytes of `width`-byte elements, each piece whole elements.
template <typename Fn>
int for_each_exchange_piece(int64_t bytes, size_t width, Fn&& fn) {
  const int64_t step = std::max<int64_t>(1, kPieceBytes / static_cast<int64_t>(width)) * width;
  for (int64_t offset = 0; offset < bytes; offset += step)
    if (int code = fn(offset, static_cast<int>(std::min(step, bytes - offset)));
        code != MPI_SUCCESS)
      return code;
  return MPI_SUCCESS;
}

// Allreduce in place of a small array by recursive doubling: in round k, rank
// r swaps its partial result with rank r xor 2^k, and both compute (lower
// rank's) op (higher rank's), so every rank ends with the same bits even for
// an op that does not commute bit for bit (max of a NaN). When p is not a power
// of two, the first 2e ranks (e = p - 2^floor(log2 p)) pair up first: each even
// one hands its array to the odd one above, which takes part for both and
// hands the result back.
int doubling_allreduce(char* data, int count, int bytes, MPI_Datatype type, MPI_Op op,
                       MPI_Comm comm) {
  const int rank = comm_rank(comm), size = comm_size(comm);
  MPI_Comm messages;
  if (int code = exchange_comm(comm, &messages); code != MPI_SUCCESS) return code;
  char* incoming = incoming_scratch();
  MPI_Status status;
  const int participants = static_cast<int>(std::bit_floor(static_cast<unsigned>(size)));
  const int paired = 2 * (size - participants);
  auto exchange = [&](int partner, bool lower) {
    int code = sendrecv(data, bytes, MPI_BYTE, partner, kExchangeTag, incoming, bytes, MPI_BYTE,
                        partner, kExchangeTag, messages, &status);
    if (code != MPI_SUCCESS) return code;
    if (!lower) return MPI_Reduce_local(incoming, data, count, type, op);
    code = MPI_Reduce_local(data, incoming, count, type, op);
    std::memcpy(data, incoming, static_cast<size_t>(bytes));
    return code;
  };
  if (rank < paired && rank % 2 == 0) {
    if (int code = send(data, bytes, MPI_BYTE, rank + 1, kExchangeTag, messages);
        code != MPI_SUCCESS)
      return code;
    return recv(data, bytes, MPI_BYTE, rank + 1, kExchangeTag, messages, &status);
  }
  if (rank < paired) {
    if (int code = recv(incoming, bytes, MPI_BYTE, rank - 1, kExchangeTag, messages, &status);
        code != MPI_SUCCESS)
      return code;
    if (int code = MPI_Reduce_local(incoming, data, count, type, op); code != MPI_SUCCESS)
      return code;
  }
  const int me = rank < paired ? rank / 2 : rank - paired / 2;
  auto rank_of = [&](int participant) {
    return participant < paired / 2 ? 2 * participant + 1 : participant + paired / 2;
  };
  for (int mask = 1; mask < participants; mask <<= 1) {
    const int partner = me ^ mask;
    if (int code = exchange(rank_of(partner), me < partner); code != MPI_SUCCESS) return code;
  }
  if (rank < paired) return send(data, bytes, MPI_BYTE, rank - 1, kExchangeTag, messages);
  return MPI_SUCCESS;
}

// Bcast of a small array down a binomial tree from `root`.
int tree_bcast(char* data, int bytes, int root, MPI_Comm comm) {
  const int rank = comm_rank(comm), size = comm_size(comm);
  MPI_Comm messages;
  if (int code = exchange_comm(comm, &messages); code != MPI_SUCCESS) return code;
  const int me = (rank - root + size) % size;
  int mask = 1;
  for (; mask < size; mask <<= 1) {
    if ((me & mask) == 0) continue;
    MPI_Status status;
    if (int code =
            recv(data, bytes, MPI_BYTE, (me - mask + root) % size, kExchangeTag, messages, &status);
        code != MPI_SUCCESS)
      return code;
    break;
  }
  for (mask >>= 1; mask > 0; mask >>= 1) {
    if (me + mask >= size) continue;
    if (int code = send(data, bytes, MPI_BYTE, (me + mask + root) % size, kExchangeTag, messages);
        code != MPI_SUCCESS)
      return code;
  }
  return MPI_SUCCESS;
}

// Small scan or exscan by recursive doubling: in round k, rank r swaps with
// rank r xor 2^k the reduction of the block of ranks it has covered so far;
// what comes from below also goes into r's result. log p rounds on any p.
int doubling_scan(const char* in, char* out, int count, int bytes, MPI_Datatype type, MPI_Op op,
                  bool exclusive, MPI_Comm comm) {
  const int rank = comm_rank(comm), size = comm_size(comm);
  MPI_Comm messages;
  if (int code = exchange_comm(comm, &messages); code != MPI_SUCCESS) return code;
  char* incoming = incoming_scratch();
  thread_local std::vector<char> covered;
  covered.assign(in, in + bytes);
  if (!exclusive && in != out) std::memcpy(out, in, static_cast<size_t>(bytes));
  bool out_written = !exclusive;
  for (int mask = 1; mask < size; mask <<= 1) {
    const int partner = rank ^ mask;
    if (partner >= size) continue;
    MPI_Status status;
    if (int code = sendrecv(covered.data(), bytes, MPI_BYTE, partner, kExchangeTag, incoming, bytes,
                            MPI_BYTE, partner, kExchangeTag, messages, &status);
        code != MPI_SUCCESS)
      return code;
    if (partner < rank) {
      if (!out_written) {
        std::memcpy(out, incoming, static_cast<size_t>(bytes));
        out_written = true;
      } else if (int code = MPI_Reduce_local(incoming, out, count, type, op); code != MPI_SUCCESS) {
        return code;
      }
    }
    if (int code = MPI_Reduce_local(incoming, covered.data(), count, type, op); code != MPI_SUCCESS)
      return code;
  }
  return MPI_SUCCESS;
}

// Allgather, alltoall and reduce_scatter of small blocks: every receive and
// send posted at once, then one polled wait. `outgoing(partner)` is the block
// for partner, `incoming(partner)` where partner's block goes.
template <typename Outgoing, typename Incoming>
int posted_exchange(int block_bytes, MPI_Comm comm, Outgoing&& outgoing, Incoming&& incoming) {
  const int rank = comm_rank(comm), size = comm_size(comm);
  MPI_Comm messages;
  if (int code = exchange_comm(comm, &messages); code != MPI_SUCCESS) return code;
  MPI_Request requests[2 * kMostPostedRanks];
  MPI_Status statuses[2 * kMostPostedRanks];
  int posted = 0;
  auto post = [&](int code) {
    if (code == MPI_SUCCESS)
      ++posted;
    else
      abandon(posted, requests);
    return code == MPI_SUCCESS;
  };
  for (int k = 1; k < size; ++k) {
    const int partner = (rank + size - k) % size;
    if (int code = MPI_Irecv(incoming(partner), block_bytes, MPI_BYTE, partner, kExchangeTag,
                             messages, &requests[posted]);
        !post(code))
      return code;
  }
  for (int k = 1; k < size; ++k) {
    const int partner = (rank + k) % size;
    if (int code = MPI_Isend(outgoing(partner), block_bytes, MPI_BYTE, partner, kExchangeTag,
                             messages, &requests[posted]);
        !post(code))
      return code;
  }
  return wait_all(posted, requests, statuses);
}

// Alltoall and allgather as p rounds of pairwise exchanges: round k pairs rank r
// with (k - r) mod p, so every pair meets once and a round's pairs run at once.
// `block(buffer, partner)` is where in `buffer` the block for or from `partner`
// lies. In place (alltoall only), each piece for a partner is first copied into
// a small scratch that is reused from call to call, sent from there, and the
// partner's piece received straight into its place. MPI's own in-place alltoall
// allocates a block-sized temporary on every call (MPICH and Open MPI both), whose
// fresh pages cost more than the exchange itself for large blocks; and MPICH pairs
// the ranks one pair at a time. MPI's allgather sends each rank's block from the
// output, just after copying it there; sending it from the input is faster
// whether the cores share a cache or not (at 64 KiB-1 MiB blocks, 1.2-1.8x when
// they do, 4-5x when they do not), and the copy to the output is the chosen one.
template <typename BlockOf>
int pairwise_exchange(Exchange exchange, const char* in, char* out, int64_t block_bytes,
                      MPI_Comm comm, BlockOf&& block) {
  const int rank = comm_rank(comm), size = comm_size(comm);
  const bool in_place = in == out;
  const ChosenCopy chosen(exchange, block_bytes);
  if (!in_place) chosen.copy(out + rank * block_bytes, block(in, rank), block_bytes);
  thread_local std::vector<char> scratch;
  if (in_place) scratch.resize(std::max<size_t>(scratch.size(), kPieceBytes));
  MPI_Comm messages;
  if (int code = exchange_comm(comm, &messages); code != MPI_SUCCESS) return code;
  for (int round = 0; round < size; ++round) {
    const int partner = ((round - rank) % size + size) % size;
    if (partner == rank) continue;
    const char* send = block(in, partner);
    char* recv = out + partner * block_bytes;
    const int code = for_each_exchange_piece(block_bytes, 1, [&](int64_t offset, int n) {
      const char* from = send + offset;
      if (in_place) {
        chosen.copy(scratch.data(), from, n);
        from = scratch.data();
      }
      MPI_Status status;
      return sendrecv(from, n, MPI_BYTE, partner, kExchangeTag, recv + offset, n, MPI_BYTE, partner,
                      kExchangeTag, messages, &status);
    });
    if (code != MPI_SUCCESS) return code;
  }
  return MPI_SUCCESS;
}

// Allreduce in place on `count` elements as a ring: p - 1 steps of reduce-scatter
// leave each rank with one fully reduced p-th of the array, and p - 1 steps of
// allgather pass those around. Every chunk is reduced once, on one rank, so all
// ranks get the same bits. The ops are commutative (all of MPI's predefined ones
// and jaxcomm's half-precision ones), so the order MPI_Reduce_local applies does
// not matter beyond rounding.
int ring_allreduce(char* data, int64_t count, size_t width, MPI_Datatype type, MPI_Op op,
                   MPI_Comm comm) {
  const int rank = comm_rank(comm), size = comm_size(comm);
  const ChosenCopy chosen(Exchange::kAllreduce, count * static_cast<int64_t>(width));
  char* incoming = incoming_scratch();
  thread_local std::vector<char> outgoing;
  const int right = (rank + 1) % size, left = (rank + size - 1) % size;
  MPI_Comm messages;
  if (int code = exchange_comm(comm, &messages); code != MPI_SUCCESS) return code;
  auto chunk_start = [&](int c) { return count * c / size * static_cast<int64_t>(width); };
  auto chunk_bytes = [&](int c) { return chunk_start(c + 1) - chunk_start(c); };
  auto chunk_at = [&](int k) { return ((k % size) + size) % size; };
  // Sends chunk `send` to the right while receiving chunk `recv` from the left,
  // piece by piece, and calls arrived(piece, offset in chunk, n) with each
  // received piece. Chunks differ by up to one element, so one may have a piece
  // more than the other: that piece goes one way only, as the neighbour, which
  // splits the same chunk alike, expects.
  auto step = [&](int send, int recv, char* into, auto&& arrived) {
    const int64_t longest = std::max(chunk_bytes(send), chunk_bytes(recv));
    return for_each_exchange_piece(longest, width, [&](int64_t offset, int n) {
      const int sent = static_cast<int>(std::clamp<int64_t>(chunk_bytes(send) - offset, 0, n));
      const int got = static_cast<int>(std::clamp<int64_t>(chunk_bytes(recv) - offset, 0, n));
      const char* from = chosen.outgoing(data + chunk_start(send) + offset, sent, outgoing);
      char* to = into ? into : data + chunk_start(recv) + offset;
      MPI_Status status;
      const int code =
          sendrecv(from, sent, MPI_BYTE, sent > 0 ? right : MPI_PROC_NULL, kExchangeTag, to, got,
                   MPI_BYTE, got > 0 ? left : MPI_PROC_NULL, kExchangeTag, messages, &status);
      if (code != MPI_SUCCESS || got == 0) return code;
      return arrived(to, offset, got);
    });
  };
  for (int k = 0; k < size - 1; ++k) {
    const int recv = chunk_at(rank - k - 1);
    const int code =
        step(chunk_at(rank - k), recv, incoming, [&](const char* piece, int64_t offset, int n) {
          return MPI_Reduce_local(piece, data + chunk_start(recv) + offset,
                                  n / static_cast<int>(width), type, op);
        });
    if (code != MPI_SUCCESS) return code;
  }
  for (int k = 0; k < size - 1; ++k) {
    const int code = step(chunk_at(rank + 1 - k), chunk_at(rank - k), nullptr,
                          [](const char*, int64_t, int) { return MPI_SUCCESS; });
    if (code != MPI_SUCCESS) return code;
  }
  return MPI_SUCCESS;
}

// Inclusive scan of `count` elements as a pipeline along the ranks: each piece
// of the prefix arrives from the left, is combined with this rank's piece, and
// goes on to the right while the next piece arrives.
int pipelined_scan(const char* in, char* out, int64_t count, size_t width, MPI_Datatype type,
                   MPI_Op op, MPI_Comm comm) {
  const int rank = comm_rank(comm), size = comm_size(comm);
  const int64_t bytes = count * static_cast<int64_t>(width);
  const ChosenCopy chosen(Exchange::kScan, bytes);
  char* incoming = incoming_scratch();
  thread_local std::vector<char> outgoing;
  MPI_Comm messages;
  if (int code = exchange_comm(comm, &messages); code != MPI_SUCCESS) return code;
  return for_each_exchange_piece(bytes, width, [&](int64_t offset, int n) {
    char* piece = out + offset;
    if (in != out) std::memcpy(piece, in + offset, n);
    if (rank > 0) {
      MPI_Status status;
      if (int code = recv(incoming, n, MPI_BYTE, rank - 1, kExchangeTag, messages, &status);
          code != MPI_SUCCESS)
        return code;
      if (int code = MPI_Reduce_local(incoming, piece, static_cast<int>(n / width), type, op);
          code != MPI_SUCCESS)
        return code;
    }
    if (rank == size - 1) return MPI_SUCCESS;
    return send(chosen.outgoing(piece, n, outgoing), n, MPI_BYTE, rank + 1, kExchangeTag, messages);
  });
}

}  // namespace

// ---------------------------------------------------------------------------
// Reductions

ffi::Error Allreduce(Token, Buffer x, TokenOut, Result out, int64_t comm_handle, bool check,
                     int32_t op) {
  Call call(comm_handle, check, "allreduce", x.element_type(), x.dimensions());
  MPI_Comm comm = call.comm();
  const int64_t size_bytes = static_cast<int64_t>(x.size_bytes());
  call.reduce_op(op);
  describe_memory(call);
  if (auto err = call.agree(); err.failure()) return err;
  MPI_Datatype type;
  MPI_Op mpi;
  if (auto err = reduction_of(x, op, "allreduce", &type, &mpi); err.failure()) return err;
  const Route how = route(size_bytes, comm);
  if (how == Route::kSmall) {
    copy_if_distinct(out, x);
    JAXCOMM_CHECK_MPI(doubling_allreduce(bytes(out), static_cast<int>(x.element_count()),
                                         static_cast<int>(size_bytes), type, mpi, comm),
                      "allreduce", comm);
  } else if (how == Route::kLarge) {
    copy_if_distinct(out, x);
    JAXCOMM_CHECK_MPI(
        ring_allreduce(bytes(out), x.element_count(), element_size(x), type, mpi, comm),
        "allreduce", comm);
  } else {
    JAXCOMM_CHECK_MPI(reduce_pieces(x.untyped_data(), out->untyped_data(), x.element_count(), type,
                                    [&](const void* i, void* o, int n) {
                                      return MPI_Allreduce(i, o, n, type, mpi, comm);
                                    }),
                      "allreduce", comm);
  }
  normalize_logical(out, op);
  return ffi::Error::Success();
}

ffi::Error Reduce(Token, Buffer x, TokenOut, Result out, int64_t comm_handle, bool check,
                  int32_t op, int32_t root) {
  Call call(comm_handle, check, "reduce", x.element_type(), x.dimensions());
  if (auto err = call.reduce_op(op).param("root", root).agree(); err.failure()) return err;
  MPI_Comm comm = call.comm();
  MPI_Datatype type;
  MPI_Op mpi;
  if (auto err = reduction_of(x, op, "reduce", &type, &mpi); err.failure()) return err;
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
                    "reduce", comm);
  if (is_root) normalize_logical(out, op);
  return ffi::Error::Success();
}

namespace {

template <bool kExclusive>
ffi::Error scan(Buffer x, Result out, int64_t comm_handle, bool check, int32_t op) {
  constexpr std::string_view name = kExclusive ? "exscan" : "scan";
  Call call(comm_handle, check, name, x.element_type(), x.dimensions());
  MPI_Comm comm = call.comm();
  const Route how = route(static_cast<int64_t>(x.size_bytes()), comm);
  call.reduce_op(op);
  describe_memory(call);
  if (auto err = call.agree(); err.failure()) return err;
  MPI_Datatype type;
  MPI_Op mpi;
  if (auto err = reduction_of(x, op, name, &type, &mpi); err.failure()) return err;
  if (how == Route::kSmall) {
    JAXCOMM_CHECK_MPI(doubling_scan(bytes(x), bytes(out), static_cast<int>(x.element_count()),
                                    static_cast<int>(x.size_bytes()), type, mpi, kExclusive, comm),
                      name, comm);
  } else if (how == Route::kLarge && !kExclusive) {
    JAXCOMM_CHECK_MPI(
        pipelined_scan(bytes(x), bytes(out), x.element_count(), element_size(x), type, mpi, comm),
        name, comm);
  } else {
    JAXCOMM_CHECK_MPI(reduce_pieces(x.untyped_data(), out->untyped_data(), x.element_count(), type,
                                    [&](const void* i, void* o, int n) {
                                      return kExclusive ? MPI_Exscan(i, o, n, type, mpi, comm)
                                                        : MPI_Scan(i, o, n, type, mpi, comm);
                                    }),
                      name, comm);
  }
  // MPI leaves exscan's rank-0 result undefined; ours is the identity of op.
  if (kExclusive && comm_rank(comm) == 0) {
    fill_identity(out, static_cast<ReduceOp>(op));
  } else {
    normalize_logical(out, op);
  }
  return ffi::Error::Success();
}

}  // namespace

ffi::Error Scan(Token, Buffer x, TokenOut, Result out, int64_t comm_handle, bool check,
                int32_t op) {
  return scan<false>(x, out, comm_handle, check, op);
}

ffi::Error Exscan(Token, Buffer x, TokenOut, Result out, int64_t comm_handle, bool check,
                  int32_t op) {
  return scan<true>(x, out, comm_handle, check, op);
}

ffi::Error ReduceScatter(Token, Buffer x, TokenOut, Result out, int64_t comm_handle, bool check,
                         int32_t op) {
  Call call(comm_handle, check, "reduce_scatter", x.element_type(), x.dimensions());
  MPI_Comm comm = call.comm();
  const int64_t block = out->element_count();
  const int64_t block_bytes = static_cast<int64_t>(out->size_bytes());
  const Route how = route(block_bytes, comm, /*posted=*/true);
  call.reduce_op(op);
  describe_memory(call);
  if (auto err = call.agree(); err.failure()) return err;
  MPI_Datatype type;
  MPI_Op mpi;
  if (auto err = reduction_of(x, op, "reduce_scatter", &type, &mpi); err.failure()) return err;
  if (how == Route::kSmall) {
    const int rank = comm_rank(comm), size = comm_size(comm);
    thread_local std::vector<char> rows;
    rows.resize(std::max(rows.size(), static_cast<size_t>(size * block_bytes)));
    JAXCOMM_CHECK_MPI(posted_exchange(
                          static_cast<int>(block_bytes), comm,
                          [&](int partner) { return bytes(x) + partner * block_bytes; },
                          [&](int partner) { return rows.data() + partner * block_bytes; }),
                      "reduce_scatter", comm);
    std::memcpy(bytes(out), bytes(x) + rank * block_bytes, block_bytes);
    for (int partner = 0; partner < size; ++partner) {
      if (partner == rank) continue;
      JAXCOMM_CHECK_MPI(MPI_Reduce_local(rows.data() + partner * block_bytes, bytes(out),
                                         static_cast<int>(block), type, mpi),
                        "reduce_scatter", comm);
    }
    normalize_logical(out, op);
    return ffi::Error::Success();
  }
  if (block <= kMaxCount) {
    JAXCOMM_CHECK_MPI(MPI_Reduce_scatter_block(x.untyped_data(), out->untyped_data(),
                                               static_cast<int>(block), type, mpi, comm),
                      "reduce_scatter", comm);
    normalize_logical(out, op);
    return ffi::Error::Success();
  }
  // Blocks too large for an int count: one chunked reduce per destination rank.
  int size;
  MPI_Comm_size(comm, &size);
  const int64_t row_bytes = block * element_size(x);
  for (int root = 0; root < size; ++root) {
    const char* row = bytes(x) + root * row_bytes;
    JAXCOMM_CHECK_MPI(for_each_piece(block,
                                     [&](int64_t offset, int n) {
                                       const char* i = row + offset * element_size(x);
                                       char* o = bytes(out) + offset * element_size(x);
                                       return MPI_Reduce(i, o, n, type, mpi, root, comm);
                                     }),
                      "reduce_scatter", comm);
  }
  normalize_logical(out, op);
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------
// Data movement

ffi::Error Bcast(Token, Buffer x, TokenOut, Result out, int64_t comm_handle, bool check,
                 int32_t root) {
  Call call(comm_handle, check, "bcast", x.element_type(), x.dimensions());
  call.param("root", root);
  describe_memory(call);
  if (auto err = call.agree(); err.failure()) return err;
  MPI_Comm comm = call.comm();
  MPI_Datatype type;
  if (auto err = datatype_of(x, "bcast", &type); err.failure()) return err;
  if (comm_rank(comm) == root) copy_if_distinct(out, x);
  if (route(static_cast<int64_t>(x.size_bytes()), comm) == Route::kSmall) {
    JAXCOMM_CHECK_MPI(tree_bcast(bytes(out), static_cast<int>(x.size_bytes()), root, comm), "bcast",
                      comm);
    return ffi::Error::Success();
  }
  JAXCOMM_CHECK_MPI(for_each_piece(x.element_count(),
                                   [&](int64_t offset, int n) {
                                     return MPI_Bcast(bytes(out) + offset * element_size(x), n,
                                                      type, root, comm);
                                   }),
                    "bcast", comm);
  return ffi::Error::Success();
}

ffi::Error Gather(Token, Buffer x, TokenOut, Result out, int64_t comm_handle, bool check,
                  int32_t root) {
  Call call(comm_handle, check, "gather", x.element_type(), x.dimensions());
  if (auto err = call.param("root", root).agree(); err.failure()) return err;
  MPI_Comm comm = call.comm();
  MPI_Datatype type;
  if (auto err = datatype_of(x, "gather", &type); err.failure()) return err;
  Block block(x.element_count(), type);
  if (comm_rank(comm) == root) {
    JAXCOMM_CHECK_MPI(MPI_Gather(x.untyped_data(), block.count(), block.type(), out->untyped_data(),
                                 block.count(), block.type(), root, comm),
                      "gather", comm);
  } else {
    copy_if_distinct(out, x);  // non-root ranks get their input back
    JAXCOMM_CHECK_MPI(MPI_Gather(x.untyped_data(), block.count(), block.type(), nullptr, 0,
                                 block.type(), root, comm),
                      "gather", comm);
  }
  return ffi::Error::Success();
}

ffi::Error Allgather(Token, Buffer x, TokenOut, Result out, int64_t comm_handle, bool check) {
  Call call(comm_handle, check, "allgather", x.element_type(), x.dimensions());
  MPI_Comm comm = call.comm();
  const int64_t block_bytes = static_cast<int64_t>(x.size_bytes());
  const Route how = route(block_bytes, comm, /*posted=*/true);
  describe_memory(call);
  if (auto err = call.agree(); err.failure()) return err;
  MPI_Datatype type;
  if (auto err = datatype_of(x, "allgather", &type); err.failure()) return err;
  if (how == Route::kSmall) {
    std::memcpy(bytes(out) + comm_rank(comm) * block_bytes, bytes(x), block_bytes);
    JAXCOMM_CHECK_MPI(posted_exchange(
                          static_cast<int>(block_bytes), comm, [&](int) { return bytes(x); },
                          [&](int partner) { return bytes(out) + partner * block_bytes; }),
                      "allgather", comm);
    return ffi::Error::Success();
  }
  if (how == Route::kLarge) {
    JAXCOMM_CHECK_MPI(pairwise_exchange(Exchange::kAllgather, bytes(x), bytes(out), block_bytes,
                                        comm, [](const char* in, int) { return in; }),
                      "allgather", comm);
    return ffi::Error::Success();
  }
  Block block(x.element_count(), type);
  JAXCOMM_CHECK_MPI(MPI_Allgather(x.untyped_data(), block.count(), block.type(),
                                  out->untyped_data(), block.count(), block.type(), comm),
                    "allgather", comm);
  return ffi::Error::Success();
}

ffi::Error Scatter(Token, Buffer x, TokenOut, Result out, int64_t comm_handle, bool check,
                   int32_t root) {
  Call call(comm_handle, check, "scatter", out->element_type(), out->dimensions());
  if (auto err = call.param("root", root).agree(); err.failure()) return err;
  MPI_Comm comm = call.comm();
  MPI_Datatype type;
  if (auto err = datatype_of(x, "scatter", &type); err.failure()) return err;
  Block block(out->element_count(), type);
  const bool is_root = comm_rank(comm) == root;
  JAXCOMM_CHECK_MPI(MPI_Scatter(is_root ? x.untyped_data() : nullptr, block.count(), block.type(),
                                out->untyped_data(), block.count(), block.type(), root, comm),
                    "scatter", comm);
  return ffi::Error::Success();
}

ffi::Error Alltoall(Token, Buffer x, TokenOut, Result out, int64_t comm_handle, bool check) {
  Call call(comm_handle, check, "alltoall", x.element_type(), x.dimensions());
  MPI_Comm comm = call.comm();
  int size;
  MPI_Comm_size(comm, &size);
  const int64_t block_bytes = static_cast<int64_t>(x.size_bytes()) / size;
  const Route how = route(block_bytes, comm, /*posted=*/true);
  describe_memory(call);
  if (auto err = call.agree(); err.failure()) return err;
  MPI_Datatype type;
  if (auto err = datatype_of(x, "alltoall", &type); err.failure()) return err;
  const bool in_place = bytes(out) == bytes(x);
  if (how == Route::kSmall) {
    // In place, the blocks to send are read from a copy: their places receive.
    thread_local std::vector<char> copy;
    const char* blocks = bytes(x);
    if (in_place) {
      copy.assign(blocks, blocks + x.size_bytes());
      blocks = copy.data();
    } else {
      const int64_t own = comm_rank(comm) * block_bytes;
      std::memcpy(bytes(out) + own, blocks + own, block_bytes);
    }
    JAXCOMM_CHECK_MPI(posted_exchange(
                          static_cast<int>(block_bytes), comm,
                          [&](int partner) { return blocks + partner * block_bytes; },
                          [&](int partner) { return bytes(out) + partner * block_bytes; }),
                      "alltoall", comm);
    return ffi::Error::Success();
  }
  if (how == Route::kLarge) {
    JAXCOMM_CHECK_MPI(
        pairwise_exchange(Exchange::kAlltoall, bytes(x), bytes(out), block_bytes, comm,
                          [&](const char* in, int partner) { return in + partner * block_bytes; }),
        "alltoall", comm);
    return ffi::Error::Success();
  }
  Block block(x.element_count() / size, type);
  JAXCOMM_CHECK_MPI(
      MPI_Alltoall(in_place ? MPI_IN_PLACE : x.untyped_data(), block.count(), block.type(),
                   out->untyped_data(), block.count(), block.type(), comm),
      "alltoall", comm);
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------
// Point to point. Received data from MPI_PROC_NULL is zeros, so the output is
// always written; the status output holds the sender's rank and the tag.

namespace {

// How many messages for_each_piece splits `count` elements into.
int64_t pieces(int64_t count) { return count == 0 ? 1 : (count + kMaxCount - 1) / kMaxCount; }

void write_status(Status& status, const MPI_Status& s) {
  status->typed_data()[0] = s.MPI_SOURCE;
  status->typed_data()[1] = s.MPI_TAG;
}

// A message shorter than the buffer is an error, not a partly written result.
ffi::Error check_count(const MPI_Status& s, MPI_Datatype type, int expected, std::string_view op) {
  if (s.MPI_SOURCE == MPI_PROC_NULL) return ffi::Error::Success();
  int count = 0;
  MPI_Get_count(&s, type, &count);
  if (count == expected) return ffi::Error::Success();
  return invalid_argument(op, "received " + std::to_string(count) + " elements from rank " +
                                  std::to_string(s.MPI_SOURCE) + " but the receive buffer holds " +
                                  std::to_string(expected) +
                                  " (the sender's array and the template differ in size)");
}

}  // namespace

ffi::Error Send(Token, Buffer x, TokenOut, int64_t comm_handle, bool check, int32_t dest,
                int32_t tag) {
  Call call(comm_handle, check, "send", x.element_type(), x.dimensions());
  call.peer("dest", dest).peer("tag", tag);
  MPI_Comm comm = call.comm();
  MPI_Datatype type;
  if (auto err = datatype_of(x, "send", &type); err.failure()) return err;
  if (auto err = call.send_header(dest, tag, pieces(x.element_count())); err.failure()) return err;
  JAXCOMM_CHECK_MPI(for_each_piece(x.element_count(),
                                   [&](int64_t offset, int n) {
                                     return send(bytes(x) + offset * element_size(x), n, type, dest,
                                                 tag, comm);
                                   }),
                    "send", comm);
  return ffi::Error::Success();
}

// `like` is the template: its shape and dtype are the result's; its data is unused.
ffi::Error Recv(Token, Buffer /*like*/, TokenOut, Result out, Status status, int64_t comm_handle,
                bool check, int32_t source, int32_t tag) {
  Call call(comm_handle, check, "recv", out->element_type(), out->dimensions());
  call.peer("source", source).peer("tag", tag);
  MPI_Comm comm = call.comm();
  MPI_Datatype type = mpi_datatype(out->element_type());
  if (type == MPI_DATATYPE_NULL) return invalid_argument("recv", "unsupported dtype");
  if (auto err = call.recv_header(&source, &tag, out->element_type(), out->dimensions());
      err.failure())
    return err;
  if (source == MPI_PROC_NULL) zero(out);
  const size_t width = ffi::ByteWidth(out->element_type());
  MPI_Status s{};
  ffi::Error piece_error = ffi::Error::Success();
  const int result = for_each_piece(out->element_count(), [&](int64_t offset, int n) {
    int code = recv(bytes(out) + offset * width, n, type, source, tag, comm, &s);
    // Later pieces come from the sender of the first.
    if (offset == 0 && source != MPI_PROC_NULL) {
      source = s.MPI_SOURCE;
      tag = s.MPI_TAG;
    }
    if (code == MPI_SUCCESS) piece_error = check_count(s, type, n, "recv");
    return piece_error.failure() ? MPI_ERR_OTHER : code;
  });
  if (piece_error.failure()) return piece_error;
  JAXCOMM_CHECK_MPI(result, "recv", comm);
  write_status(status, s);
  return ffi::Error::Success();
}

ffi::Error Sendrecv(Token, Buffer x, TokenOut, Result out, Status status, int64_t comm_handle,
                    bool check, int32_t source, int32_t dest, int32_t sendtag, int32_t recvtag) {
  Call call(comm_handle, check, "sendrecv", x.element_type(), x.dimensions());
  call.peer("source", source).peer("dest", dest);
  MPI_Comm comm = call.comm();
  MPI_Datatype send_type, recv_type = mpi_datatype(out->element_type());
  if (auto err = datatype_of(x, "sendrecv", &send_type); err.failure()) return err;
  if (recv_type == MPI_DATATYPE_NULL) return invalid_argument("sendrecv", "unsupported dtype");
  const int64_t send_pieces = pieces(std::max(x.element_count(), out->element_count()));
  bool matches = true;
  if (auto err = call.sendrecv_header(dest, sendtag, send_pieces, &source, &recvtag,
                                      out->element_type(), out->dimensions(), &matches);
      err.failure())
    return err;
  if (!matches) {
    // The peer still waits for our data: send it while draining theirs.
    std::vector<MPI_Request> requests;
    for_each_piece(std::max(x.element_count(), out->element_count()), [&](int64_t offset, int n) {
      int sn = static_cast<int>(std::clamp<int64_t>(x.element_count() - offset, 0, n));
      requests.emplace_back();
      return MPI_Isend(bytes(x) + offset * element_size(x), sn, send_type, dest, sendtag, comm,
                       &requests.back());
    });
    ffi::Error error = call.mismatch(source, recvtag);
    MPI_Waitall(static_cast<int>(requests.size()), requests.data(), MPI_STATUSES_IGNORE);
    return error;
  }
  if (source == MPI_PROC_NULL) zero(out);
  const size_t send_width = element_size(x), recv_width = ffi::ByteWidth(out->element_type());
  const int64_t send_count = x.element_count(), recv_count = out->element_count();
  const int64_t pieces_of = std::max(send_count, recv_count);
  MPI_Status s{};
  ffi::Error piece_error = ffi::Error::Success();
  // Both sides split at the same element offsets, so pieces pair up across ranks
  // even when send and receive counts differ.
  const int result = for_each_piece(pieces_of, [&](int64_t offset, int n) {
    int sn = static_cast<int>(std::clamp<int64_t>(send_count - offset, 0, n));
    int rn = static_cast<int>(std::clamp<int64_t>(recv_count - offset, 0, n));
    int code = sendrecv(bytes(x) + offset * send_width, sn, send_type, dest, sendtag,
                        bytes(out) + offset * recv_width, rn, recv_type, source, recvtag, comm, &s);
    if (offset == 0 && source != MPI_PROC_NULL) {
      source = s.MPI_SOURCE;
      recvtag = s.MPI_TAG;
    }
    if (code == MPI_SUCCESS) piece_error = check_count(s, recv_type, rn, "sendrecv");
    return piece_error.failure() ? MPI_ERR_OTHER : code;
  });
  if (piece_error.failure()) return piece_error;
  JAXCOMM_CHECK_MPI(result, "sendrecv", comm);
  write_status(status, s);
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------
// Checking mode: is x identical on every rank? Used where the gradient convention
// assumes a replicated cotangent.

namespace {

// Values as doubles; a complex number is compared as its two parts.
template <typename T>
double as_double(T v) {
  return static_cast<double>(v);
}
double as_double(Float16Bits h) { return half::f16_to_float(h.bits); }
double as_double(Bfloat16Bits h) { return half::bf16_to_float(h.bits); }

template <typename T>
struct Part {
  using type = T;
};
template <typename R>
struct Part<std::complex<R>> {
  using type = R;
};

struct Difference {
  double largest = 0.0;
  int64_t where = -1;  // in parts: complex elements count twice
};

// Where x differs most from rank 0's copy (equal NaNs are no difference).
template <typename P>
Difference largest_difference(const P* mine, const P* first, int64_t n) {
  Difference d;
  for (int64_t i = 0; i < n; ++i) {
    const double a = as_double(mine[i]), b = as_double(first[i]);
    if (a == b || (std::isnan(a) && std::isnan(b))) continue;
    const double gap = std::isnan(a - b) ? INFINITY : std::fabs(a - b);
    if (d.where < 0 || gap > d.largest) d = {gap, i};
  }
  if (d.where >= 0 && d.largest == 0.0) d.largest = INFINITY;
  return d;
}

}  // namespace

ffi::Error CheckReplicated(Token, Buffer x, TokenOut, Result out, int64_t comm_handle, bool check,
                           std::string_view operation) {
  Call call(comm_handle, check, "check_replicated", x.element_type(), x.dimensions());
  MPI_Comm comm = call.comm();
  copy_if_distinct(out, x);
  std::vector<char> first(x.size_bytes());
  std::memcpy(first.data(), bytes(x), first.size());
  JAXCOMM_CHECK_MPI(for_each_piece(static_cast<int64_t>(first.size()),
                                   [&](int64_t offset, int piece) {
                                     return MPI_Bcast(first.data() + offset, piece, MPI_BYTE, 0,
                                                      comm);
                                   }),
                    "check", comm);
  Difference mine;
  int parts_per_element = 1;
  visit_dtype(x.element_type(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    using P = typename Part<T>::type;
    parts_per_element = sizeof(T) / sizeof(P);
    mine = largest_difference(reinterpret_cast<const P*>(bytes(x)),
                              reinterpret_cast<const P*>(first.data()),
                              x.element_count() * parts_per_element);
  });
  struct {
    double difference;
    int rank;
  } local{mine.largest, comm_rank(comm)}, worst{};
  JAXCOMM_CHECK_MPI(MPI_Allreduce(&local, &worst, 1, MPI_DOUBLE_INT, MPI_MAXLOC, comm), "check",
                    comm);
  if (worst.difference == 0.0) return ffi::Error::Success();
  std::string message =
      "jaxcomm check: the cotangent reaching the transpose of " + std::string(operation) +
      " is not identical on every rank (largest difference from rank 0: " +
      std::to_string(worst.difference) + ", on rank " + std::to_string(worst.rank);
  if (mine.where >= 0 && worst.rank == local.rank)
    message += ", at flat index " + std::to_string(mine.where / parts_per_element);
  message +=
      "). Its result is treated as one replicated value; mark a replicated value that "
      "feeds rank-dependent code with comm.pvary(x).";
  return ffi::Error(ffi::ErrorCode::kFailedPrecondition, message);
}

ffi::Error Barrier(Token, TokenOut, int64_t comm_handle, bool check) {
  Call call(comm_handle, check, "barrier");
  if (auto err = call.agree(); err.failure()) return err;
  MPI_Comm comm = call.comm();
  JAXCOMM_CHECK_MPI(MPI_Barrier(comm), "barrier", comm);
  return ffi::Error::Success();
}

}  // namespace jaxcomm::host

namespace jaxcomm {

#define JAXCOMM_DEFINE_CPU_HANDLER(name, function, binding) \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxcomm_##name, host::function, binding);
JAXCOMM_OPERATIONS(JAXCOMM_DEFINE_CPU_HANDLER, ffi::Ffi::Bind())
#undef JAXCOMM_DEFINE_CPU_HANDLER

}  // namespace jaxcomm
