#include "call.h"

#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "collectives.h"
#include "lockstep.h"

namespace jaxcomm {
namespace {

using Clock = std::chrono::steady_clock;

struct Settings {
  bool debug = false;
  double timeout = 0;  // seconds; 0 = no watchdog
};

// Set by configure() when jaxcomm is imported, before any handler is registered.
Settings current_settings;

const Settings& settings() { return current_settings; }

std::atomic<uint64_t> calls{0};

// What the watchdog sees: the call in flight (handlers run one at a time: the
// ordered effect serialises them) and the last one that completed.
struct Watch {
  std::mutex mutex;
  bool busy = false;
  std::string current, last = "none";
  Clock::time_point since;
  // Tests of a request that found it pending, with no call between them (polled).
  bool polling = false;
  std::string polled;
  Clock::time_point polling_since, polled_at;
};

// Where jaxcomm runs inside shard_map over several processes, a peer may instead
// wait in one of JAX's collectives that its program places elsewhere.
constexpr const char* kElsewhereInShardMap =
    ", or it waits in one of JAX's collectives that its compiled program places elsewhere among "
    "jaxcomm's calls (docs/sharded.md, \"One program on every process\")";

// Tests further apart than this part of JAXCOMM_TIMEOUT are not one wait: the
// rank did other work between them.
constexpr double kPollGapPart = 0.5;

Watch& watch() {
  static Watch w;
  return w;
}

void watchdog_loop(double timeout) {
  const auto limit = std::chrono::duration<double>(timeout);
  for (;;) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    Watch& w = watch();
    std::unique_lock lock(w.mutex);
    const bool still_polling = w.polling && Clock::now() - w.polled_at <= limit * kPollGapPart;
    const bool waiting = w.busy || still_polling;
    const Clock::time_point since = w.busy ? w.since : w.polling_since;
    if (!waiting || Clock::now() - since < limit) continue;
    const double waited = std::chrono::duration<double>(Clock::now() - since).count();
    char timing[96];
    std::snprintf(timing, sizeof timing, " for %.1f s (JAXCOMM_TIMEOUT=%g)", waited, timeout);
    const std::string how = w.busy ? " has been waiting in " + w.current : " has been " + w.polled;
    std::string message =
        "jaxcomm watchdog: rank " + std::to_string(world_rank()) + how + timing +
        (w.busy ? "" : ", making no other call") + "; last completed call: " + w.last +
        ". A peer has not made the matching call" +
        (sharded_over_processes() ? kElsewhereInShardMap : "") + ". Aborting the job.\n";
    lock.unlock();
    end_job(message);
  }
}

void start_watchdog() {
  static std::once_flag once;
  std::call_once(once, [] { std::thread(watchdog_loop, settings().timeout).detach(); });
}

uint64_t fnv1a(std::string_view text) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : text) h = (h ^ c) * 1099511628211ull;
  return h;
}

// Long enough for any description we compare; longer ones are cut (and still
// differ in their hash).
constexpr int kDescription = 160;

std::string human_bytes(double n) {
  char text[32];
  if (n < 1024)
    std::snprintf(text, sizeof text, "%.0f B", n);
  else if (n < 1 << 20)
    std::snprintf(text, sizeof text, "%.1f KiB", n / 1024);
  else
    std::snprintf(text, sizeof text, "%.1f MiB", n / (1 << 20));
  return text;
}

// A registered communicator: its handle and, for a Cartesian or graph
// communicator, its neighbours (shared with the calls that use them, so that a
// free during a call leaves the call's intact).
struct Registered {
  MPI_Comm comm = MPI_COMM_NULL;
  std::shared_ptr<const mpi::Neighborhood> neighborhood;
  int size = 0;  // ranks, kept after the communicator is freed (lockstep.h)
};

struct Registry {
  std::mutex mutex;
  std::unordered_map<int64_t, Registered> comms;
};

Registry& registry() {
  static Registry r;
  return r;
}

// What is registered under `key`: MPI_COMM_NULL if nothing (its communicator
// has been freed).
Registered registered(int64_t key) {
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  auto found = r.comms.find(key);
  return found == r.comms.end() ? Registered{} : found->second;
}

}  // namespace

void configure(bool debug, double timeout) { current_settings = {debug, timeout}; }

void polled(std::string_view before, std::string_view operation, std::string_view after,
            bool done) {
  const double timeout = settings().timeout;
  if (timeout <= 0) return;
  start_watchdog();
  Watch& w = watch();
  std::lock_guard lock(w.mutex);
  const Clock::time_point now = Clock::now();
  const auto gap = std::chrono::duration<double>(timeout * kPollGapPart);
  if (done) {
    w.polling = false;
  } else if (!w.polling || now - w.polled_at > gap) {
    w.polling = true;
    w.polled.assign(before).append(" ").append(operation).append(" ").append(after);
    w.polling_since = now;
  }
  w.polled_at = now;
}

void register_comm(int64_t key, int64_t handle) {
  const MPI_Comm comm = comm_from_handle(handle);
  int size = 0;
  MPI_Comm_size(comm, &size);
  Registered entry{comm, mpi::neighborhood_of(comm), size};
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  r.comms[key] = std::move(entry);
}

void unregister_comm(int64_t key) {
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  auto found = r.comms.find(key);
  if (found == r.comms.end()) return;
  // Its handle goes, so that a call finds it freed; its number of ranks stays
  // for that call's error (lockstep.h).
  found->second = Registered{MPI_COMM_NULL, nullptr, found->second.size};
}

namespace {
constexpr char kMagic[8] = "jaxcomm";
}

uint64_t call_count() { return calls.load(std::memory_order_relaxed); }

const char* reduce_op_name(int32_t op) {
  static const char* names[] = {"sum", "prod", "max",  "min", "land",
                                "lor", "lxor", "band", "bor", "bxor"};
  static_assert(std::size(names) == static_cast<size_t>(ReduceOp::kBxor) + 1);
  return op >= 0 && op < static_cast<int32_t>(std::size(names)) ? names[op] : "?";
}

const char* dtype_name(ffi::DataType dtype) { return dtype_info(dtype).name; }

std::string describe_array(ffi::DataType dtype, ffi::Span<const int64_t> dims) {
  std::string text = dtype_name(dtype);
  text += '[';
  for (size_t i = 0; i < dims.size(); ++i) {
    if (i) text += ',';
    text += std::to_string(dims[i]);
  }
  return text + ']';
}

namespace {
// The operation this thread runs, and its notes: one thread_local, since finding
// one costs a call on every operation.
struct Running {
  std::string_view operation = "jaxcomm";
  Notes notes;
};
thread_local Running running;
}  // namespace

Entered::Entered(std::string_view operation) {
  Running& r = running;
  outer_ = r.operation;
  r.operation = operation;
  r.notes = Notes{};
}
Entered::~Entered() { running.operation = outer_; }
std::string_view current_operation() { return running.operation; }
Notes& notes() { return running.notes; }

Call::Call(int64_t comm_key, bool check) : check_(check) {
  Running& r = running;
  operation_ = r.operation;
  Registered found = registered(comm_key);
  comm_ = found.comm;
  neighborhood_ = std::move(found.neighborhood);
  r.notes.ranks = found.size;
  calls.fetch_add(1, std::memory_order_relaxed);
  const Settings& s = settings();
  recording_ = check_ || s.debug || s.timeout > 0;
  if (s.debug) start_ = Clock::now();
  if (s.timeout > 0) {
    start_watchdog();
    Watch& w = watch();
    std::lock_guard lock(w.mutex);
    w.busy = true;
    w.polling = false;                    // the rank makes a call: it is not only polling
    w.current = std::string(operation_);  // refined as parameters arrive
    w.since = Clock::now();
  }
}

Call::Call(int64_t comm_key, bool check, const ffi::AnyBuffer& data) : Call(comm_key, check) {
  has_array_ = true;
  dtype_ = data.element_type();
  dims_ = data.dimensions();
  show_watchdog();
}

void Call::show_watchdog() const {
  if (settings().timeout <= 0) return;
  std::lock_guard lock(watch().mutex);
  watch().current = description() + peers_;
}

Call& Call::record(std::string_view name, std::string_view value) {
  params_.append(", ").append(name).append("=").append(value);
  show_watchdog();
  return *this;
}

Call& Call::reduce_op(int32_t op) {
  const Settings& s = settings();
  if (!(check_ || s.debug || s.timeout > 0)) return *this;
  // First, whenever it is recorded: jaxcomm's methods and MPI's take op before root.
  params_.insert(0, std::string(", op=") + reduce_op_name(op));
  show_watchdog();
  return *this;
}

Call& Call::per_block() {
  per_block_ = true;
  show_watchdog();
  return *this;
}

Call& Call::peer(std::string_view name, int64_t value) {
  const Settings& s = settings();
  if (!(s.debug || s.timeout > 0)) return *this;
  peers_.append(", ").append(name).append("=");
  const bool is_tag = name.find("tag") != std::string_view::npos;
  const bool any = value == (is_tag ? MPI_ANY_TAG : MPI_ANY_SOURCE);
  peers_.append(any ? "any" : !is_tag && value == MPI_PROC_NULL ? "null" : std::to_string(value));
  show_watchdog();
  return *this;
}

std::string Call::description() const {
  std::string text(operation_);
  text += '(';
  if (has_array_ && per_block_ && dims_.size() > 0) {  // "float32[*,3]"
    std::string block = describe_array(dtype_, dims_.last(dims_.size() - 1));
    text += block.insert(block.find('[') + 1, dims_.size() > 1 ? "*," : "*");
  } else if (has_array_) {
    text += describe_array(dtype_, dims_);
  }
  // Without an array the params come first: "alltoallv(dtype=float32, row=1)".
  text += has_array_ || params_.empty() ? std::string_view(params_)
                                        : std::string_view(params_).substr(2);
  return text + ')';
}

Call::~Call() {
  const Settings& s = settings();
  if (s.timeout > 0) {
    Watch& w = watch();
    std::lock_guard lock(w.mutex);
    w.busy = false;
    w.last = w.current;
  }
  if (s.debug) {
    const double us = std::chrono::duration<double, std::micro>(Clock::now() - start_).count();
    const int rank = comm_ == MPI_COMM_NULL ? world_rank() : comm_rank(comm_);
    std::string line = "jaxcomm[rank " + std::to_string(rank) + "] " + description();
    if (!peers_.empty()) line += " " + peers_.substr(2);
    int64_t elements = 1;
    for (int64_t d : dims_) elements *= d;
    if (has_array_)
      line += " " + human_bytes(static_cast<double>(elements) * ffi::ByteWidth(dtype_));
    char tail[48];
    std::snprintf(tail, sizeof tail, " %.1f us\n", us);
    line += tail;
    std::fwrite(line.data(), 1, line.size(), stderr);
  }
}

ffi::Error Call::live() const {
  if (comm_ != MPI_COMM_NULL) return ffi::Error::Success();
  // free() is collective: every rank finds its communicator gone.
  return on_every_rank(
      ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                 "jaxcomm: " + std::string(operation_) +
                     " on a communicator that has been freed (a function compiled with "
                     "a JaxComm was called after its free())"));
}

ffi::Error Call::neighborhood(const mpi::Neighborhood** found) const {
  *found = neighborhood_.get();
  if (neighborhood_) return ffi::Error::Success();
  // The same communicator, without a topology, on every rank.
  return on_every_rank(invalid_argument(
      operation_, "needs a Cartesian or graph communicator (create_cart, create_dist_graph)"));
}

ffi::Error Call::agree() {
  if (auto err = live(); err.failure()) return err;
  if (!check_) return ffi::Error::Success();
  const std::string mine = description();
  const uint64_t h = fnv1a(mine);
  uint64_t seen[2] = {h, ~h};  // max of h and of ~h: the largest and smallest hash
  JAXCOMM_CHECK_MPI(MPI_Allreduce(MPI_IN_PLACE, seen, 2, MPI_UINT64_T, MPI_MAX, comm_), "check",
                    comm_);
  if (seen[0] == h && ~seen[1] == h) return ffi::Error::Success();
  int size = 0;
  MPI_Comm_size(comm_, &size);
  std::vector<char> all(static_cast<size_t>(size) * kDescription, '\0');
  char own[kDescription] = {};
  std::strncpy(own, mine.c_str(), kDescription - 1);
  JAXCOMM_CHECK_MPI(
      MPI_Allgather(own, kDescription, MPI_CHAR, all.data(), kDescription, MPI_CHAR, comm_),
      "check", comm_);
  auto of = [&](int r) { return std::string(all.data() + static_cast<size_t>(r) * kDescription); };
  int other = 1;
  while (other < size && of(other) == of(0)) ++other;
  if (other == size) other = 1;  // only the hashes differ: descriptions were cut
  return on_every_rank(
      ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                 "jaxcomm check: rank " + std::to_string(other) + " called " + of(other) +
                     " while rank 0 called " + of(0) +
                     " (every rank must make the same collective calls, in the same order)"));
}

Call::MessageHeader Call::make_header(int64_t pieces) const {
  MessageHeader h{};
  std::memcpy(h.magic, kMagic, sizeof kMagic);
  h.dtype = static_cast<int32_t>(dtype_);
  h.pieces = static_cast<int32_t>(pieces);
  h.count = 1;
  for (int64_t d : dims_) h.count *= d;
  std::strncpy(h.array, describe_array(dtype_, dims_).c_str(), sizeof h.array - 1);
  return h;
}

ffi::Error Call::check_header(const MPI_Status& status) const {
  int bytes = 0;
  MPI_Get_count(&status, MPI_BYTE, &bytes);
  if (bytes == sizeof incoming_ && std::memcmp(incoming_.magic, kMagic, sizeof kMagic) == 0)
    return ffi::Error::Success();
  return invalid_argument(
      operation_, "checking mode: the message from rank " + std::to_string(status.MPI_SOURCE) +
                      " carries no jaxcomm header; checking mode must be on for every rank "
                      "of the communicator (JAXCOMM_CHECK=1 or JaxComm(..., check=True))");
}

ffi::Error Call::send_header(int dest, int tag, int64_t pieces) {
  if (auto err = live(); err.failure()) return err;
  if (!check_ || dest == MPI_PROC_NULL) return ffi::Error::Success();
  MessageHeader h = make_header(pieces);
  JAXCOMM_CHECK_MPI(MPI_Send(&h, sizeof h, MPI_BYTE, dest, tag, comm_), operation_, comm_);
  return ffi::Error::Success();
}

ffi::Error Call::post_header(int dest, int tag, int64_t pieces, MessageHeader* header,
                             std::vector<MPI_Request>* requests) {
  if (auto err = live(); err.failure()) return err;
  if (!check_ || dest == MPI_PROC_NULL) return ffi::Error::Success();
  *header = make_header(pieces);
  JAXCOMM_CHECK_MPI(
      MPI_Isend(header, sizeof *header, MPI_BYTE, dest, tag, comm_, &requests->emplace_back()),
      operation_, comm_);
  return ffi::Error::Success();
}

// The sender's data is received into scratch space and dropped.
ffi::Error Call::mismatch(int source, int tag) {
  for (int64_t i = 0; i < incoming_.pieces; ++i) {
    MPI_Message message;
    MPI_Status status;
    JAXCOMM_CHECK_MPI(MPI_Mprobe(source, tag, comm_, &message, &status), operation_, comm_);
    int bytes = 0;
    MPI_Get_count(&status, MPI_BYTE, &bytes);
    std::vector<char> scratch(static_cast<size_t>(bytes));
    JAXCOMM_CHECK_MPI(MPI_Mrecv(scratch.data(), bytes, MPI_BYTE, &message, MPI_STATUS_IGNORE),
                      operation_, comm_);
  }
  return mismatch_error(source, tag);
}

// The message has been received or drained: its sender waits for nothing.
ffi::Error Call::mismatch_error(int source, int tag) const {
  return paired(ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                           "jaxcomm check: " + std::string(operation_) + " on rank " +
                               std::to_string(comm_rank(comm_)) + " receives into " + receiving_ +
                               " but rank " + std::to_string(source) + " sent " +
                               std::string(incoming_.array) + " (tag " + std::to_string(tag) +
                               "); the dtype and number of elements must match"));
}

bool Call::header_matches(ffi::DataType dtype, ffi::Span<const int64_t> dims) {
  receiving_ = describe_array(dtype, dims);
  int64_t count = 1;
  for (int64_t d : dims) count *= d;
  return incoming_.dtype == static_cast<int32_t>(dtype) && incoming_.count == count;
}

ffi::Error Call::check_received(const MessageHeader& header, const MPI_Status& status,
                                ffi::DataType dtype, ffi::Span<const int64_t> dims) {
  incoming_ = header;
  if (auto err = check_header(status); err.failure()) return err;
  return header_matches(dtype, dims) ? ffi::Error::Success()
                                     : mismatch_error(status.MPI_SOURCE, status.MPI_TAG);
}

ffi::Error Call::recv_header(int* source, int* tag, ffi::DataType dtype,
                             ffi::Span<const int64_t> dims) {
  if (auto err = live(); err.failure()) return err;
  if (!check_ || *source == MPI_PROC_NULL) return ffi::Error::Success();
  MPI_Status status;
  JAXCOMM_CHECK_MPI(MPI_Recv(&incoming_, sizeof incoming_, MPI_BYTE, *source, *tag, comm_, &status),
                    operation_, comm_);
  if (auto err = check_header(status); err.failure()) return err;
  *source = status.MPI_SOURCE;
  *tag = status.MPI_TAG;
  return header_matches(dtype, dims) ? ffi::Error::Success() : mismatch(*source, *tag);
}

ffi::Error Call::sendrecv_header(int dest, int sendtag, int64_t send_pieces, int* source,
                                 int* recvtag, ffi::DataType dtype, ffi::Span<const int64_t> dims,
                                 bool* matches) {
  *matches = true;
  if (auto err = live(); err.failure()) return err;
  if (!check_) return ffi::Error::Success();
  MessageHeader out = make_header(send_pieces);
  MPI_Status status;
  JAXCOMM_CHECK_MPI(MPI_Sendrecv(&out, sizeof out, MPI_BYTE, dest, sendtag, &incoming_,
                                 sizeof incoming_, MPI_BYTE, *source, *recvtag, comm_, &status),
                    operation_, comm_);
  if (*source == MPI_PROC_NULL) return ffi::Error::Success();
  if (auto err = check_header(status); err.failure()) return err;
  *source = status.MPI_SOURCE;
  *recvtag = status.MPI_TAG;
  *matches = header_matches(dtype, dims);
  return ffi::Error::Success();
}

}  // namespace jaxcomm
