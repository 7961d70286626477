#include "requests.h"

#include <algorithm>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>

#include "call.h"
#include "jaxcomm/jaxcomm.h"
#include "ops.h"

namespace jaxcomm::host {
namespace {

struct Table {
  std::mutex mutex;
  std::unordered_map<const void*, Pending> pending;
};

Table& table() {
  static Table t;
  return t;
}

thread_local bool (*interrupt_check)() = nullptr;

std::string wait_name(std::string_view operation) { return "wait(" + std::string(operation) + ")"; }

void drop(Pending& pending) {
  for (MPI_Request& request : pending.requests) {
    if (pending.cancellable && request != MPI_REQUEST_NULL) MPI_Cancel(&request);
    MPI_Wait(&request, MPI_STATUS_IGNORE);
  }
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

}  // namespace

// MPICH's blocking waits yield the core on every poll under MPI_THREAD_MULTIPLE,
// which costs more than a small message itself; polling MPI_Testall does not,
// and yielding after kPollsBeforeYield leaves a shared core to the other ranks
// when the wait is long.
// An interrupt check takes the GIL: a few microseconds every kPollsPerCheck
// polls (a millisecond or so) costs a long wait nothing and answers Ctrl-C at once.
int wait_all(int n, MPI_Request* requests, MPI_Status* statuses, bool cancellable) {
  constexpr int kPollsBeforeYield = 1000;
  constexpr int kPollsPerCheck = 4096;
  for (int polls = 0;; ++polls) {
    int done = 0;
    const int code = test_all(n, requests, statuses, &done);
    if (code != MPI_SUCCESS || done) return code;
    if (polls >= kPollsBeforeYield) std::this_thread::yield();
    if (cancellable && interrupt_check != nullptr && polls % kPollsPerCheck == kPollsPerCheck - 1 &&
        interrupt_check()) {
      // Cancelled requests complete locally; then MPI no longer uses the buffers.
      for (int i = 0; i < n; ++i) abandon(&requests[i]);
      return MPI_ERR_OTHER;
    }
  }
}

int test_all(int n, MPI_Request* requests, MPI_Status* statuses, int* done) {
  const int code = MPI_Testall(n, requests, done, statuses);
  if (code == MPI_ERR_IN_STATUS) {
    for (int i = 0; i < n; ++i)
      if (statuses[i].MPI_ERROR != MPI_SUCCESS && statuses[i].MPI_ERROR != MPI_ERR_PENDING)
        return statuses[i].MPI_ERROR;
  }
  return code;
}

CheckInterrupts::CheckInterrupts(bool (*interrupted)()) : previous_(interrupt_check) {
  interrupt_check = interrupted;
}

CheckInterrupts::~CheckInterrupts() { interrupt_check = previous_; }

void abandon(MPI_Request* request) {
  if (*request == MPI_REQUEST_NULL) return;
  MPI_Cancel(request);
  MPI_Wait(request, MPI_STATUS_IGNORE);
}

ffi::Error post(const void* key, Pending pending) {
  Pending stale;
  bool found = false;
  {
    Table& t = table();
    std::lock_guard lock(t.mutex);
    auto [at, inserted] = t.pending.try_emplace(key, std::move(pending));
    if (!inserted) {
      found = true;
      stale = std::exchange(at->second, std::move(pending));
    }
  }
  if (!found) return ffi::Error::Success();
  drop(stale);
  return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                    "jaxcomm: a request of " + std::string(stale.operation) +
                        " was never waited (wait for every request before the function "
                        "that posted it returns); it has been dropped");
}

void discard(const void* key) {
  Pending pending;
  {
    Table& t = table();
    std::lock_guard lock(t.mutex);
    auto at = t.pending.find(key);
    if (at == t.pending.end()) return;
    pending = std::move(at->second);
    t.pending.erase(at);
  }
  drop(pending);
}

ffi::Error test(const void* key, bool* done) {
  Table& t = table();
  // MPI_Testall returns at once, so holding the table meanwhile delays no one.
  std::lock_guard lock(t.mutex);
  auto at = t.pending.find(key);
  if (at == t.pending.end()) return nothing_pending("test");
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
  return ffi::Error::Success();
}

ffi::Error complete(const void* key, const void* out, int32_t* status) {
  Pending pending;
  {
    Table& t = table();
    std::lock_guard lock(t.mutex);
    auto at = t.pending.find(key);
    if (at == t.pending.end()) return nothing_pending("wait");
    pending = std::move(at->second);
    t.pending.erase(at);
  }
  const std::string name = wait_name(pending.operation);
  Call call(pending.comm_key, pending.check, name);
  MPI_Status* statuses = statuses_of(pending);
  if (!pending.done) {
    const int n = static_cast<int>(pending.requests.size());
    JAXCOMM_CHECK_MPI(wait_all(n, pending.requests.data(), statuses, pending.cancellable), name,
                      call.comm());
  }
  if (out != nullptr && pending.out != nullptr && out != pending.out)
    return ffi::Error(ffi::ErrorCode::kInternal,
                      "jaxcomm: " + name +
                          ": XLA moved the result buffer between the start and the wait; "
                          "the result is lost. Please report this.");
  return pending.finish ? pending.finish(call, statuses, status) : ffi::Error::Success();
}

}  // namespace jaxcomm::host

namespace jaxcomm::host {

ffi::Error Wait(Token, Buffer request, ffi::RemainingArgs, TokenOut, ffi::RemainingRets results) {
  const void* out = nullptr;
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
  return complete(request.untyped_data(), out, status);
}

ffi::Error Test(Token, Buffer request, TokenOut, ffi::Result<ffi::BufferR0<ffi::PRED>> done) {
  return test(request.untyped_data(), done->typed_data());
}

}  // namespace jaxcomm::host
