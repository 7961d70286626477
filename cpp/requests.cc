#include "requests.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <mutex>
#include <new>
#include <string>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <utility>

#include "binding.h"
#include "call.h"
#include "jaxcomm/jaxcomm.h"
#include "lockstep.h"
#include "memory.h"
#include "p2p.h"

namespace jaxcomm::mpi {
namespace {

struct Table {
  std::mutex mutex;
  std::unordered_map<const void*, Pending> pending;
  // Requests that will never be waited, kept with their buffers until MPI has
  // completed them.
  std::vector<Pending> orphans;
};

Table& table() {
  static Table t;
  return t;
}

thread_local bool (*interrupt_check)() = nullptr;
thread_local int64_t executing = 0;  // Executing's run

std::string wait_name(std::string_view operation) { return "wait(" + std::string(operation) + ")"; }

// Frees the orphans that MPI has completed. The caller holds the table's lock.
void reap(Table& t) {
  std::erase_if(t.orphans, [](Pending& orphan) {
    int done = 0;
    MPI_Testall(static_cast<int>(orphan.requests.size()), orphan.requests.data(), &done,
                MPI_STATUSES_IGNORE);
    return done != 0;
  });
}

// `pending` will never be waited: cancelled where MPI can, it stays an orphan
// until MPI has completed it. Returns whether it was a receive that had no
// message yet. The caller holds the table's lock.
bool orphan(Table& t, Pending pending) {
  bool unmatched = false;
  for (MPI_Request& request : pending.requests) {
    if (!pending.cancellable || request == MPI_REQUEST_NULL) continue;
    int arrived = 0;  // then MPI frees the request
    MPI_Test(&request, &arrived, MPI_STATUS_IGNORE);
    if (arrived) continue;
    MPI_Cancel(&request);
    unmatched = true;
  }
  t.orphans.push_back(std::move(pending));
  reap(t);
  return unmatched;
}

// After `operation` was orphaned as a receive that had no message yet.
void diverge_unmatched(std::string_view operation) {
  diverge(std::string(operation) +
          " was cancelled before its message came: a message sent for it would go to a "
          "later receive");
}

ffi::Error nothing_pending(std::string_view what) {
  return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                    "jaxcomm: " + std::string(what) +
                        ": no request is pending here (waited twice, or the request comes "
                        "from another call of a jitted function)");
}

// Room for the statuses of `pending`'s requests; with none (a message to or from
// MPI_PROC_NULL, or an empty array), one status that says nothing arrived.
MPI_Status* statuses_of(Pending& pending) {
  const size_t n = pending.requests.size();
  if (pending.statuses.size() < std::max<size_t>(n, 1)) {
    pending.statuses.resize(std::max<size_t>(n, 1));
    if (n == 0) {
      pending.statuses[0].MPI_SOURCE = MPI_PROC_NULL;
      pending.statuses[0].MPI_TAG = MPI_ANY_TAG;
    }
  }
  return pending.statuses.data();
}

// The first error among `statuses`, for MPI_ERR_IN_STATUS.
int first_error(int n, const MPI_Status* statuses, int code) {
  if (code != MPI_ERR_IN_STATUS) return code;
  for (int i = 0; i < n; ++i)
    if (statuses[i].MPI_ERROR != MPI_SUCCESS && statuses[i].MPI_ERROR != MPI_ERR_PENDING)
      return statuses[i].MPI_ERROR;
  return code;
}

// Released message buffers kept for reuse. A program with more messages in
// flight at once than this allocates the rest afresh; the bound keeps what
// jaxcomm holds between calls to the sizes of a program's own recent messages.
constexpr size_t kept_buffers = 16;

struct Kept {
  std::mutex mutex;
  std::vector<std::pair<char*, size_t>> buffers;  // (data, capacity)
};

Kept& kept() {
  static Kept k;
  return k;
}

constexpr size_t kAlignment = 64;

}  // namespace

MessageBuffer::MessageBuffer(size_t bytes) : size_(bytes) {
  {
    Kept& k = kept();
    std::lock_guard lock(k.mutex);
    // The smallest kept buffer that fits.
    auto best = k.buffers.end();
    for (auto it = k.buffers.begin(); it != k.buffers.end(); ++it)
      if (it->second >= bytes && (best == k.buffers.end() || it->second < best->second)) best = it;
    if (best != k.buffers.end()) {
      std::tie(data_, capacity_) = *best;
      k.buffers.erase(best);
      return;
    }
  }
  capacity_ = std::max(kAlignment, (bytes + kAlignment - 1) / kAlignment * kAlignment);
  data_ = static_cast<char*>(::operator new(capacity_, std::align_val_t(kAlignment)));
}

MessageBuffer::~MessageBuffer() {
  if (data_ == nullptr) return;
  std::pair<char*, size_t> dropped{data_, capacity_};
  {
    Kept& k = kept();
    std::lock_guard lock(k.mutex);
    k.buffers.emplace_back(data_, capacity_);
    if (k.buffers.size() <= kept_buffers) return;
    dropped = k.buffers.front();  // the one released longest ago
    k.buffers.erase(k.buffers.begin());
  }
  ::operator delete(dropped.first, std::align_val_t(kAlignment));
}

MessageBuffer::MessageBuffer(MessageBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      capacity_(std::exchange(other.capacity_, 0)) {}

MessageBuffer& MessageBuffer::operator=(MessageBuffer&& other) noexcept {
  MessageBuffer old(std::move(*this));
  data_ = std::exchange(other.data_, nullptr);
  size_ = std::exchange(other.size_, 0);
  capacity_ = std::exchange(other.capacity_, 0);
  return *this;
}

char* Pending::own(size_t bytes) { return buffers.emplace_back(bytes).data(); }

char* Pending::own_copy(const void* from, size_t bytes) {
  char* to = own(bytes);
  if (bytes > 0) std::memcpy(to, from, bytes);
  return to;
}

char* Pending::own_result(size_t bytes) {
  char* to = own(bytes);
  result = to;
  result_bytes = bytes;
  return to;
}

// Off the Python thread: MPI's own wait. On it: polls, yielding the core between
// polls and, once the wait has lasted kSpinFor, sleeping kNap between them, so a
// rank waiting for another on a shared core leaves it the core. A poll that
// checks for Ctrl-C takes the GIL (a few microseconds), every kCheckEvery.
int wait_all(int n, MPI_Request* requests, MPI_Status* statuses, bool cancellable,
             const std::function<void()>& on_interrupt) {
  if (!interruptible()) return first_error(n, statuses, MPI_Waitall(n, requests, statuses));
  using Clock = std::chrono::steady_clock;
  // Long enough for a small message's round trip, short against a person's reaction.
  constexpr auto kSpinFor = std::chrono::microseconds(200);
  constexpr auto kNap = std::chrono::microseconds(50);
  constexpr auto kCheckEvery = std::chrono::milliseconds(20);
  const auto start = Clock::now();
  auto checked = start;
  for (;;) {
    int done = 0;
    const int code = test_all(n, requests, statuses, &done);
    if (code != MPI_SUCCESS || done) return code;
    const auto now = Clock::now();
    if (now - start < kSpinFor) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(kNap);
    }
    if (now - checked < kCheckEvery) continue;
    checked = now;
    if (!cancellable || !interrupt_check()) continue;
    if (on_interrupt) {
      on_interrupt();
    } else {
      for (int i = 0; i < n; ++i) abandon(&requests[i]);
    }
    return MPI_ERR_OTHER;
  }
}

bool interruptible() { return interrupt_check != nullptr; }

int test_all(int n, MPI_Request* requests, MPI_Status* statuses, int* done) {
  return first_error(n, statuses, MPI_Testall(n, requests, done, statuses));
}

CheckInterrupts::CheckInterrupts(bool (*interrupted)()) : previous_(interrupt_check) {
  interrupt_check = interrupted;
}

CheckInterrupts::~CheckInterrupts() { interrupt_check = previous_; }

void abandon(MPI_Request* request) {
  if (*request == MPI_REQUEST_NULL) return;
  MPI_Cancel(request);
  MPI_Status status;
  MPI_Wait(request, &status);
  int cancelled = 0;
  MPI_Test_cancelled(&status, &cancelled);
  if (cancelled) diverge_unmatched(current_operation());
}

ffi::Error post(const void* key, Pending pending) {
  pending.compiled = interrupt_check == nullptr;
  pending.run = executing;
  Table& t = table();
  std::lock_guard lock(t.mutex);
  auto [at, inserted] = t.pending.try_emplace(key, std::move(pending));
  if (!inserted) {
    const std::string_view earlier = at->second.operation;
    if (orphan(t, std::exchange(at->second, std::move(pending)))) diverge_unmatched(earlier);
  }
  if (!t.orphans.empty()) reap(t);
  return ffi::Error::Success();
}

void orphan(Pending pending) {
  Table& t = table();
  std::lock_guard lock(t.mutex);
  const std::string_view operation = pending.operation;
  if (orphan(t, std::move(pending))) diverge_unmatched(operation);
}

void discard(const void* key) {
  Table& t = table();
  std::lock_guard lock(t.mutex);
  auto at = t.pending.find(key);
  if (at == t.pending.end()) return;
  orphan(t, std::move(at->second));
  t.pending.erase(at);
}

Executing::Executing(int64_t run) : outer_(executing) { executing = run; }
Executing::~Executing() { executing = outer_; }

void abandon_compiled(int64_t run) {
  Table& t = table();
  std::lock_guard lock(t.mutex);
  for (auto at = t.pending.begin(); at != t.pending.end();) {
    if (!at->second.compiled || at->second.run != run) {
      ++at;
      continue;
    }
    const std::string_view operation = at->second.operation;
    if (orphan(t, std::move(at->second))) diverge_unmatched(operation);
    at = t.pending.erase(at);
  }
}

int unfinished_orphans() {
  Table& t = table();
  std::lock_guard lock(t.mutex);
  for (auto& [key, pending] : t.pending) orphan(t, std::move(pending));
  t.pending.clear();
  reap(t);
  return static_cast<int>(t.orphans.size());
}

int in_flight(int64_t comm_key) {
  Table& t = table();
  // MPI_Testall returns at once, so holding the table meanwhile delays no one.
  std::lock_guard lock(t.mutex);
  reap(t);
  int left = 0;
  std::string_view first;  // for the watchdog: one of those still in flight
  for (auto& [key, pending] : t.pending) {
    if (pending.comm_key != comm_key || pending.done) continue;
    int flag = 0;
    const int n = static_cast<int>(pending.requests.size());
    // A failed request is over too: its wait reports the error.
    const int code = test_all(n, pending.requests.data(), statuses_of(pending), &flag);
    pending.done = code == MPI_SUCCESS && flag != 0;
    if (code != MPI_SUCCESS || pending.done) continue;
    ++left;
    if (first.empty()) first = pending.operation;
  }
  for (const Pending& orphan : t.orphans) {
    if (orphan.comm_key != comm_key) continue;
    ++left;
    if (first.empty()) first = orphan.operation;
  }
  polled("waiting for", first, "before freeing its communicator", left == 0);
  return left;
}

ffi::Error test(const void* key, bool* done) {
  Table& t = table();
  // MPI_Testall returns at once, so holding the table meanwhile delays no one.
  std::lock_guard lock(t.mutex);
  auto at = t.pending.find(key);
  if (at == t.pending.end()) return nothing_pending(current_operation());
  Pending& pending = at->second;
  if (!pending.done) {
    int flag = 0;
    const int n = static_cast<int>(pending.requests.size());
    const std::string name = "test(" + std::string(pending.operation) + ")";
    JAXCOMM_CHECK_MPI(test_all(n, pending.requests.data(), statuses_of(pending), &flag), name,
                      MPI_COMM_WORLD);
    pending.done = flag != 0;
  }
  *done = pending.done;
  polled("polling", pending.operation, "with test()", pending.done);
  return ffi::Error::Success();
}

ffi::Error complete(const void* key, void* out, int32_t* status, const int32_t* tangent_of) {
  Pending pending;
  {
    Table& t = table();
    std::lock_guard lock(t.mutex);
    auto at = t.pending.find(key);
    if (at == t.pending.end()) return nothing_pending(current_operation());
    pending = std::move(at->second);
    t.pending.erase(at);
    if (!t.orphans.empty()) reap(t);
  }
  const std::string name = wait_name(pending.operation);
  Entered entered(name);  // the wait of this operation
  Call call(pending.comm_key, pending.check);
  MPI_Status* statuses = statuses_of(pending);
  if (!pending.done) {
    const int n = static_cast<int>(pending.requests.size());
    for (int i = 0; i < n; ++i) statuses[i].MPI_ERROR = MPI_ERR_PENDING;
    bool interrupted = false;
    // Interrupting is safe for every operation: an orphan keeps its buffers.
    const int code = wait_all(n, pending.requests.data(), statuses, /*cancellable=*/true,
                              [&] { interrupted = true; });
    if (interrupted) {
      orphan(std::move(pending));
      return ffi::Error(ffi::ErrorCode::kCancelled, "jaxcomm: " + name + ": interrupted");
    }
    if (code != MPI_SUCCESS && pending.explain)
      if (auto err = pending.explain(call, statuses); err.failure()) return err;
    // Every request has completed: a message longer than its buffer came whole.
    if (auto err = check_received(code, name, call.comm(), /*whole=*/true); err.failure())
      return err;
  }
  if (pending.finish)
    if (auto err = pending.finish(call, statuses, status); err.failure()) return err;
  if (tangent_of != nullptr && status != nullptr && status[1] != tangent_of[1])
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "jaxcomm: " + name + ": the tangent of a message received from MPI.ANY_TAG " +
                          "came with tag " + std::to_string(status[1]) + ", its message with tag " +
                          std::to_string(tangent_of[1]) + ": another message from rank " +
                          std::to_string(status[0]) +
                          " came between them (ranks send and receive in different orders "
                          "around jax.linearize's parts, or a receive does not differentiate "
                          "what its sender differentiates)");
  if (out != nullptr && pending.result_bytes > 0)
    memory().copy(out, pending.result, pending.result_bytes);
  return ffi::Error::Success();
}

}  // namespace jaxcomm::mpi
