// MPI requests: waiting for them, abandoning them, and the requests that a
// non-blocking operation's start leaves pending for its wait.
//
// A pending request is known by the address of the one-element buffer that the
// start returns and the wait takes: XLA keeps that buffer alive, at one address,
// from the start to the wait, and no other live buffer shares it.
#ifndef JAXCOMM_REQUESTS_H_
#define JAXCOMM_REQUESTS_H_

#include <mpi.h>

#include <cstdint>
#include <functional>
#include <string_view>
#include <vector>

#include "call.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::host {

namespace ffi = xla::ffi;

// Waits for `n` requests by polling MPI_Testall, leaving the core to other ranks
// between polls once the wait is long. Returns an MPI error code; MPI_ERR_OTHER
// if this thread's interrupt check (below) fired, after cancelling the requests
// (only point-to-point requests are `cancellable`: MPI cannot cancel collectives).
int wait_all(int n, MPI_Request* requests, MPI_Status* statuses, bool cancellable = true);

// MPI_Testall, with the error of the first failed request rather than
// MPI_ERR_IN_STATUS. `*done` is whether all `n` have completed.
int test_all(int n, MPI_Request* requests, MPI_Status* statuses, int* done);

// While it lives, waits on this thread ask `interrupted()` now and then whether
// to give up (the eager path: a KeyboardInterrupt on the Python thread).
class CheckInterrupts {
 public:
  explicit CheckInterrupts(bool (*interrupted)());
  ~CheckInterrupts();
  CheckInterrupts(const CheckInterrupts&) = delete;
  CheckInterrupts& operator=(const CheckInterrupts&) = delete;

 private:
  bool (*previous_)();
};

// Cancels a request and waits until it is cancelled or complete: until then MPI
// may still use its buffer. A completed (null) request is left as it is.
void abandon(MPI_Request* request);

// What a start leaves for its wait.
struct Pending {
  std::string_view operation;  // "iallreduce", ...: a static name
  int64_t comm_key = 0;
  bool check = false;
  std::vector<MPI_Request> requests;
  bool cancellable = false;   // point to point (MPI cannot cancel a collective)
  const void* out = nullptr;  // where MPI writes the result, if anywhere
  // Set once `test` has found every request complete, with their statuses: MPI
  // has released the requests, so the wait only finishes.
  bool done = false;
  std::vector<MPI_Status> statuses;
  // Runs once the requests are complete, with their statuses: checks the
  // received count, normalises logical results, fills in the status.
  std::function<ffi::Error(Call& wait, const MPI_Status* statuses, int32_t* status)> finish;
};

// Records `pending` under `key`. A request already pending there was never
// waited (its buffer was freed and the address reused): it is abandoned and the
// error says so.
ffi::Error post(const void* key, Pending pending);

// Drops the requests recorded under `key`, if any: cancels them where MPI can,
// and waits until MPI no longer uses their buffers.
void discard(const void* key);

// Whether the requests recorded under `key` have completed, without waiting;
// polling this also lets MPI progress them. The wait must still follow.
ffi::Error test(const void* key, bool* done);

// Waits for the requests recorded under `key` and finishes them. `out` is where
// the caller expects the result (null: anywhere); `status` receives (source, tag)
// of a receive, if not null.
ffi::Error complete(const void* key, const void* out, int32_t* status);

}  // namespace jaxcomm::host

#endif  // JAXCOMM_REQUESTS_H_
