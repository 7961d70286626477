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
//
// A computation may also stop for a reason jaxcomm does not see (a host callback
// that raises, a custom kernel's error, XLA's own, memory) after an operation
// that later ones of the same computation follow. So each operation of a
// computation that has later ones owes them on the communicators that its
// computation uses, until an operation that no other follows (`last`) has run:
// an operation of another computation, or an eager call, on one of them finds
// them owed, and this rank goes out of step then. The lowering says what each
// operation leaves owed (jaxcomm/_lockstep.py, `owing`): where operations lie
// in a loop, a conditional or a nested function, the calls `jaxcomm_entered`
// before it and `jaxcomm_settled` after it own up for them.
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
// Returns whether this rank stays in step: then the peers skip the same later
// operations, and its computation owes them nothing.
bool failed(std::string_view operation, const ffi::Error& error, bool last, bool synchronous);

// This rank goes out of step: `why` says what its peers may be waiting for. The
// first reason is kept.
void diverge(std::string why);

// Whether an operation may run: false if this rank is out of step, or goes out of
// step now because an earlier computation owes a later operation on one of
// `comms` (the communicators of the operation's computation). `run` is the
// operation's XLA execution (RunId), or none for an eager call.
bool may_run(std::optional<int64_t> run, ffi::Span<const int64_t> comms);

// `operation` of execution `run` has run, in a computation that uses `comms`:
// unless it is its computation's `last`, the computation owes later
// operations on them; if it is, it owes nothing more.
void ran(int64_t run, ffi::Span<const int64_t> comms, bool last, std::string_view operation);

// Out of step if a computation still owes operations (ran): at exit, once every
// computation has ended, when none will ever run them.
void diverge_if_owed();

// From now on, going out of step ends the job at once (MPI_Abort), with a
// message: for a process that runs jaxcomm operations inside shard_map over
// several processes, where a failed computation also skips JAX's own
// collectives, which jaxcomm cannot refuse.
void end_job_when_out_of_step();
// Whether it has been called: this process runs jaxcomm operations inside
// shard_map over several processes.
bool sharded_over_processes();

// Writes `message` to stderr and ends the job (MPI_Abort), after a pause that
// lets the launcher forward the message.
[[noreturn]] void end_job(const std::string& message);
// What an operation that has run leaves its computation owing (the attribute
// `owing`): nothing of its own, where it lies in a loop, a conditional or a
// nested function, whose jaxcomm_entered and jaxcomm_settled calls say it;
// the later operations, on `comms`; or nothing more, where none follows.
enum Owing : int32_t { kInside = 0, kOwes = 1, kSettles = 2 };

// The attributes that every jaxcomm handler takes after its operation's own
// (jaxcomm/_lockstep.py gives them): `last`, no jaxcomm operation that a peer
// waits for follows it in its computation; `comms`, the communicators of its
// computation's operations that peers wait for; `owing` (Owing: ran).
#define JAXCOMM_BIND_LOCKSTEP_ATTRIBUTES \
  .Attr<bool>("last").Attr<ffi::Span<const int64_t>>("comms").Attr<int32_t>("owing")

// Whether this rank is in step. Every wrapper asks first, before the operation
// starts, and if not returns the error that refuses `operation`.
bool in_step();
ffi::Error refusal(std::string_view operation);

// Why this rank is out of step, if it is.
std::optional<std::string> out_of_step();

// An operation that failed after the call that dispatched its computation had
// returned, where it would otherwise have left this rank in step: JAX refuses
// the next call with jaxcomm's effect instead of running it (which its peers
// run), so the rank goes out of step at its next operation, which comes after
// such a refusal. Why, if one did and the rank has made no operation since.
std::optional<std::string> refusal_pending();
// Whether that refusal did happen, where jaxcomm can tell (at exit: the error
// still waits in JAX's token, which no call has taken): the rank goes out of
// step, or forgets it.
void refusal_known(bool refused);

// Back in step: for a test that has made the calls its peers waited for.
void resume();

// Whether this thread is one of Python's. An XLA computation whose handler runs
// on it runs inside the call that dispatched it (XLA runs asynchronous ones on
// its own threads); so does an eager call.
bool on_python_thread();

// The handler that runs before a user's kernel (jaxcomm._kernels), token ->
// token: refuses it while this rank is out of step, or as may_run does; the
// kernel then owes its peers what ran() says.
XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxcomm_in_step);
// token -> token, after a user's kernel, and after a loop, a conditional or a
// nested function that has jaxcomm operations: what the computation owes once
// they are done (ran()).
XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxcomm_settled);
// token -> token, before such a loop, conditional or nested function: refuses it
// as may_run does; from then on the computation owes its operations (which
// XLA may run any number of times, or none), until the jaxcomm_settled after it.
XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxcomm_entered);

// The state shared by every jaxcomm module of the process (the CPU and CUDA
// extensions each link their own copy of this code): `share(state())` of one
// makes the other use its state.
void* state();
void share(void* state);

// This process's rank in MPI_COMM_WORLD for messages, or -1 outside MPI's life.
int world_rank();

}  // namespace jaxcomm

#endif  // JAXCOMM_LOCKSTEP_H_
