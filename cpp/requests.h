// MPI requests: waiting for them, abandoning them, and the requests that a
// non-blocking operation's start leaves pending for its wait.
//
// A pending operation's messages live in memory that jaxcomm owns (MessageBuffer)
// from the start until MPI has finished with them: the start copies what MPI
// reads into it, the wait copies what MPI wrote out of it. So MPI never touches a
// buffer that XLA or the user can free, donate or reuse, whatever the program
// does with the request (drops it, waits in one branch only, fails before the
// wait). A request that is never waited becomes an orphan: cancelled where MPI can,
// and kept with its buffers until MPI has completed it.
//
// A pending request is known by the address of the one-element buffer that the
// start returns and the wait takes.
#ifndef JAXCOMM_REQUESTS_H_
#define JAXCOMM_REQUESTS_H_

#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string_view>
#include <vector>

#include "call.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::mpi {

namespace ffi = xla::ffi;

// Waits for `n` requests. Off the Python thread (inside XLA) this is MPI_Waitall:
// the MPI library's own waiting policy, which its settings tune. On the Python
// thread (eager calls) it polls, so that Ctrl-C can end the wait, and leaves the
// core to other processes between polls. Returns an MPI error code, with the
// error of the first failed request rather than MPI_ERR_IN_STATUS; MPI_ERR_OTHER
// if this thread's interrupt check (below) fired. Then the requests that are not
// complete are still active: `on_interrupt` takes them (cancelled where
// `cancellable`), or, if it is null, they are cancelled and waited for.
int wait_all(int n, MPI_Request* requests, MPI_Status* statuses, bool cancellable = true,
             const std::function<void()>& on_interrupt = nullptr);

// Whether waits on this thread poll, to let Ctrl-C end them (an eager call on the
// Python thread), rather than call MPI's blocking functions.
bool interruptible();

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

// Cancels a receive's request and waits until it is cancelled or complete: until
// then MPI may still use its buffer. A completed (null) request is left as it is.
// A receive cancelled before its message came puts this rank out of step
// (lockstep.h): a message sent for it would go to a later receive.
void abandon(MPI_Request* request);

// Memory of `bytes` bytes that jaxcomm owns, for the messages of a pending
// operation; 64-byte aligned, as XLA's buffers are. Released buffers are kept
// for reuse (kept_buffers in requests.cc), so that a loop posting the same
// messages neither allocates nor faults in fresh pages on each post.
class MessageBuffer {
 public:
  explicit MessageBuffer(size_t bytes);
  ~MessageBuffer();
  MessageBuffer(MessageBuffer&&) noexcept;
  MessageBuffer& operator=(MessageBuffer&&) noexcept;
  MessageBuffer(const MessageBuffer&) = delete;
  MessageBuffer& operator=(const MessageBuffer&) = delete;

  char* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  char* data_ = nullptr;
  size_t size_ = 0;
  size_t capacity_ = 0;
};

// What a start leaves for its wait.
struct Pending {
  std::string_view operation;  // "iallreduce", ...: a static name
  int64_t comm_key = 0;
  bool check = false;
  std::vector<MPI_Request> requests;
  // A receive, which an orphan cancels. (A send is not cancelled: like a request
  // freed with MPI_Request_free, it still leaves whole when its receiver takes it.
  // MPI cannot cancel a collective.)
  bool cancellable = false;
  bool compiled = false;  // posted inside XLA (not by an eager call): set by post()
  int64_t run = 0;        // then the XLA execution that posted it (Executing)
  // The memory MPI reads and writes until the requests complete.
  std::vector<MessageBuffer> buffers;
  // Where, among `buffers`, the result is: copied to the wait's output.
  const char* result = nullptr;
  size_t result_bytes = 0;
  // Set once `test` has found every request complete, with their statuses: MPI
  // has released the requests, so the wait only finishes.
  bool done = false;
  std::vector<MPI_Status> statuses;
  // Runs once the requests are complete, with their statuses, before the result
  // is copied out: checks the received count, normalises logical results, fills
  // in the status.
  std::function<ffi::Error(Call& wait, const MPI_Status* statuses, int32_t* status)> finish;
  // Runs when the wait fails, with the statuses MPI_Waitall left (MPI_ERR_PENDING
  // where a request did not complete): a better error than MPI's, if it has one.
  std::function<ffi::Error(Call& wait, const MPI_Status* statuses)> explain;

  // A buffer of `bytes` bytes that lives as long as the requests need it.
  char* own(size_t bytes);
  // The same holding a copy of `bytes` bytes at `from`.
  char* own_copy(const void* from, size_t bytes);
  // Owns the result buffer: MPI writes `bytes` bytes there, the wait copies them out.
  char* own_result(size_t bytes);
};

// Records `pending` under `key`. A request still pending there was never waited
// (the computation that posted it failed before its wait): it becomes an orphan.
ffi::Error post(const void* key, Pending pending);

// `pending` will never be waited: it becomes an orphan. A receive is cancelled,
// so that it takes no later message; one that had no message yet puts this rank
// out of step (lockstep.h), since a message sent to it would go to a later
// receive (a dropped request, `discard`, is the program's own choice and does not).
void orphan(Pending pending);

// Drops the requests recorded under `key`, if any, without waiting: they become
// orphans (a receive is cancelled).
void discard(const void* key);

// Whether the requests recorded under `key` have completed, without waiting;
// polling this also lets MPI progress them. The wait must still follow.
ffi::Error test(const void* key, bool* done);

// Waits for the requests recorded under `key`, finishes them and copies the
// result to `out` (null: nowhere); `status` receives (source, tag) of a receive,
// if not null. Interrupted, the requests become orphans. `tangent_of`, if not
// null, is the status of the message whose tangent this receive from
// MPI_ANY_TAG takes: a message with another tag is an error (its tangent
// receive is posted with the message's, before the tag is known).
ffi::Error complete(const void* key, void* out, int32_t* status,
                    const int32_t* tangent_of = nullptr);

// While it lives, the requests that this thread posts belong to XLA execution
// `run` (its RunId): set by the wrapper of a compiled handler.
class Executing {
 public:
  explicit Executing(int64_t run);
  ~Executing();
  Executing(const Executing&) = delete;
  Executing& operator=(const Executing&) = delete;

 private:
  int64_t outer_;
};

// A handler of XLA execution `run` failed: the execution ends before the waits of
// the requests it posted, which become orphans (a request never outlives the
// execution that posted it; other executions' requests are left alone).
void abandon_compiled(int64_t run);

// Orphans that MPI has not completed by now (each is cancelled where MPI can, and
// tested once more), at exit. They keep their buffers: at exit, MPI_Finalize may still
// complete them.
int unfinished_orphans();

// How many requests posted on the communicator `comm_key` MPI has not completed
// yet, each tested once (which drives MPI's progress): those not waited, and
// orphans. A request found complete keeps its result and statuses for its wait.
// Freeing a communicator while one is in flight crashes some MPI libraries
// (Open MPI 5's non-blocking collectives), though the standard allows it.
int in_flight(int64_t comm_key);

}  // namespace jaxcomm::mpi

#endif  // JAXCOMM_REQUESTS_H_
