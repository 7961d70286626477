// Keeping ranks in step after an error (docs/troubleshooting.md, "After an
// error").
//
// A computation whose operation fails stops there: XLA runs none of its later
// operations, and JAX gives a computation that failed after its call returned
// (asynchronously) to the next call with jaxcomm's effect as that call's error,
// instead of running it. The peers run all of theirs. A rank that went on could
// pair its next call with a peer's call that it skipped, and both would compute
// wrong values. So a rank whose operation fails goes *out of step*, and refuses
// every later operation without communicating, unless nothing its peers run can
// have been skipped:
// - the operation failed inside the call that dispatched its computation, which
//   then raises and leaves JAX's ordering token as it was; and
// - every rank of the job got the same error at this operation, so all skip the
//   same later operations (`on_every_rank`); or no peer waits for this rank in
//   it (`paired`) and it was the last jaxcomm operation of its computation.
#ifndef JAXCOMM_LOCKSTEP_H_
#define JAXCOMM_LOCKSTEP_H_

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "xla/ffi/api/ffi.h"

namespace jaxcomm {

namespace ffi = xla::ffi;

// `error`, returned where no peer waits for this rank in the operation that
// returns it: this rank took part in all of the operation's exchanges first (a
// refused count, an overflow, a message that does not fit). Other errors (an
// MPI call that failed half-way) leave this rank out of step.
ffi::Error paired(ffi::Error error);

// `error`, which every rank of the operation's communicator returns at this
// operation (checking mode's mismatches, a freed communicator): paired, and on
// a communicator of every rank of the job, every rank skips what this one does.
ffi::Error on_every_rank(ffi::Error error);

// How an operation's error leaves its peers (above).
enum class Ending { kUnpaired, kPaired, kEveryRank };

// What this thread notes of the operation it runs, for `failed`: the last error
// marked (a hash of its message: the wrapper compares it with the error the
// operation returns, so that an error marked and then replaced by another is not
// taken for the marked one), and how; and how many ranks its communicator has
// (0: unknown; with none but this one, no peer waits for it whatever its error).
// Kept by call.h with the operation's name, which clears them on entry. Plain
// values: a thread_local with a constructor costs more to reach, on every call.
struct Notes {
  uint64_t marked = 0;
  Ending ending = Ending::kUnpaired;
  int ranks = 0;
};

// What the wrapper that entered `operation` (a handler, an eager call) does with
// its `error`: this rank goes out of step but as above, `last` saying that no
// jaxcomm operation that a peer waits for can follow in the same computation and
// `synchronous` that the operation runs inside the call that dispatched it.
void failed(std::string_view operation, const ffi::Error& error, bool last, bool synchronous);

// This rank goes out of step: `why` says what its peers may be waiting for. The
// first reason is kept.
void diverge(std::string why);

// From now on, going out of step ends the job at once (MPI_Abort), with a
// message: for a process that runs jaxcomm operations inside shard_map over
// several processes, where a failed computation also skips JAX's own
// collectives, which jaxcomm cannot refuse.
void end_job_when_out_of_step();

// Writes `message` to stderr and ends the job (MPI_Abort), after a pause that
// lets the launcher forward the message.
[[noreturn]] void end_job(const std::string& message);
// Whether this rank is in step. Every wrapper asks first, before the operation
// starts, and if not returns the error that refuses `operation`.
bool in_step();
ffi::Error refusal(std::string_view operation);

// Why this rank is out of step, if it is.
std::optional<std::string> out_of_step();

// Back in step: for a test that has made the calls its peers waited for.
void resume();

// Whether this thread is one of Python's. An XLA computation whose handler runs
// on it runs inside the call that dispatched it (XLA runs asynchronous ones on
// its own threads); so does an eager call.
bool on_python_thread();

// The handler that runs before a user's kernel (jaxcomm._kernels), token ->
// token: refuses it while this rank is out of step.
XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxcomm_in_step);

// The state shared by every jaxcomm module of the process (the CPU and CUDA
// extensions each link their own copy of this code): `share(state())` of one
// makes the other use its state.
void* state();
void share(void* state);

}  // namespace jaxcomm

#endif  // JAXCOMM_LOCKSTEP_H_
