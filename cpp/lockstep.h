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

// Call (call.h) says how many ranks the communicator of the operation this
// thread runs has: with none but this one, no peer waits for it whatever its
// error.
void running_on(int ranks);

// What the wrapper that entered `operation` (a handler, an eager call) does with
// its `error`: this rank goes out of step but as above, `last` saying that no
// jaxcomm operation that a peer waits for can follow in the same computation and
// `synchronous` that the operation runs inside the call that dispatched it.
void failed(std::string_view operation, const ffi::Error& error, bool last, bool synchronous);

// This rank goes out of step: `why` says what its peers may be waiting for. The
// first reason is kept.
void diverge(std::string why);

// Success while this rank is in step; else the error that refuses `operation`.
// Every wrapper asks first, before the operation starts: this thread's notes
// for `failed` start afresh.
ffi::Error in_step(std::string_view operation);

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
