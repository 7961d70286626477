#include "lockstep.h"

#include <Python.h>
#include <mpi.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>

#include "call.h"

namespace jaxcomm {
namespace {

// What one communicator is owed: by which execution, after which operation.
struct Owed {
  int64_t run;
  std::string_view operation;  // a name of the table of operations: static
};

// `sole` is the one execution that owes operations, or one of these.
constexpr int64_t kNobody = std::numeric_limits<int64_t>::min();
constexpr int64_t kSeveral = kNobody + 1;

struct State {
  std::atomic<bool> diverged{false};
  std::atomic<bool> end_job{false};  // end_job_when_out_of_step()
  std::mutex mutex;
  std::string why;
  std::atomic<bool> refusal_due{false};  // `pending` says why
  std::string pending;                   // refusal_pending(), under `mutex`
  // What computations owe (ran), by communicator key, under `owed_mutex`; `sole`
  // lets an operation of the execution that owes pass without the lock.
  std::mutex owed_mutex;
  std::unordered_map<int64_t, Owed> owed;
  std::atomic<int64_t> sole{kNobody};
};

State own_state;
State* shared = &own_state;

uint64_t fingerprint(const ffi::Error& error) {
  return std::hash<std::string>{}(error.message()) | 1;  // never 0: nothing marked
}

// Marks `error` as ending so, or as marked already if that says more.
ffi::Error mark(ffi::Error error, Ending ending) {
  if (error.failure()) {
    Notes& n = notes();
    const uint64_t marked = fingerprint(error);
    if (n.marked != marked || n.ending < ending) n.ending = ending;
    n.marked = marked;
  }
  return error;
}

int world_size() {
  static const int size = [] {
    int n = 0;
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    return n;
  }();
  return size;
}

// Why the rank goes out of step where `owing` is still owed.
std::string stopped(const Owed& owing) {
  return "a computation stopped after its " + std::string(owing.operation) +
         ", before its later jaxcomm operations, which the peers wait for, had run (stopped by "
         "a failure that jaxcomm does not see: a host callback, a custom kernel, XLA, memory; or "
         "another thread's computation uses the communicator meanwhile)";
}

// `sole` from what is owed (with owed_mutex held).
int64_t sole_owner(const std::unordered_map<int64_t, Owed>& owed) {
  int64_t owner = kNobody;
  for (const auto& [comm, owing] : owed) {
    if (owner != kNobody && owner != owing.run) return kSeveral;
    owner = owing.run;
  }
  return owner;
}

}  // namespace

int world_rank() {
  int rank = -1, initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank;
}

ffi::Error paired(ffi::Error error) { return mark(std::move(error), Ending::kPaired); }

ffi::Error on_every_rank(ffi::Error error) { return mark(std::move(error), Ending::kEveryRank); }

bool failed(std::string_view operation, const ffi::Error& error, bool last, bool synchronous) {
  Notes& n = notes();
  Ending ending = n.marked == fingerprint(error) ? n.ending : Ending::kUnpaired;
  if (n.ranks == 1 && ending == Ending::kUnpaired) ending = Ending::kPaired;
  if (ending == Ending::kEveryRank && n.ranks == world_size()) last = true;  // all skip the rest
  n = Notes{};
  const char* why = nullptr;
  if (ending == Ending::kUnpaired) {
    why = "before it had made all of its exchanges";
  } else if (!last) {
    why = "and the later operations of its computation did not run";
  } else if (!synchronous) {
    // In step until that next call: the rank's next operation comes after it.
    State& s = *shared;
    std::lock_guard lock(s.mutex);
    if (!s.refusal_due.load(std::memory_order_relaxed)) {
      s.refusal_due.store(true, std::memory_order_release);
      s.pending = std::string(operation) +
                  " failed after the call that dispatched its computation had returned, and JAX "
                  "refuses the next call with jaxcomm's effect instead of running it (" +
                  error.message() + ")";
    }
    return true;
  } else {
    return true;
  }
  diverge(std::string(operation) + " failed " + why + " (" + error.message() + ")");
  return false;
}

void diverge(std::string why) {
  State& s = *shared;
  {
    std::lock_guard lock(s.mutex);
    if (s.diverged.load(std::memory_order_relaxed)) return;
    s.why = why;
    s.diverged.store(true, std::memory_order_release);
  }
  if (!s.end_job.load(std::memory_order_acquire)) return;
  end_job("jaxcomm: rank " + std::to_string(world_rank()) +
          " ends the job: it is out of step with its peers (" + why +
          "), and JAX's own collectives in shard_map, which jaxcomm cannot refuse, would pair "
          "with the wrong calls of its peers.\n");
}

bool may_run(std::optional<int64_t> run, ffi::Span<const int64_t> comms) {
  State& s = *shared;
  if (s.diverged.load(std::memory_order_acquire)) return false;
  const int64_t sole = s.sole.load(std::memory_order_acquire);
  const bool due = s.refusal_due.load(std::memory_order_acquire);
  if (!due && (sole == kNobody || (run && sole == *run))) return true;
  std::string why;
  if (due) {
    std::lock_guard lock(s.mutex);
    why = std::move(s.pending);
    s.pending.clear();
    s.refusal_due.store(false, std::memory_order_release);
  }
  if (why.empty()) {
    std::lock_guard lock(s.owed_mutex);
    for (int64_t comm : comms) {
      auto found = s.owed.find(comm);
      if (found == s.owed.end() || (run && found->second.run == *run)) continue;
      why = stopped(found->second);
      break;
    }
  }
  if (why.empty()) return true;
  diverge(std::move(why));
  return false;
}

void ran(int64_t run, ffi::Span<const int64_t> comms, bool last, std::string_view operation) {
  if (comms.size() == 0) return;  // its computation owes no peer anything
  State& s = *shared;
  const int64_t sole = s.sole.load(std::memory_order_acquire);
  if (last ? sole == kNobody : sole == run) return;  // nothing to clear, or owed already
  std::lock_guard lock(s.owed_mutex);
  if (last) {
    for (auto it = s.owed.begin(); it != s.owed.end();) {
      it = it->second.run == run ? s.owed.erase(it) : std::next(it);
    }
  } else {
    for (int64_t comm : comms) s.owed[comm] = Owed{run, operation};
  }
  s.sole.store(sole_owner(s.owed), std::memory_order_release);
}

void diverge_if_owed() {
  State& s = *shared;
  std::string why;
  {
    std::lock_guard lock(s.owed_mutex);
    if (s.owed.empty()) return;
    why = stopped(s.owed.begin()->second);
  }
  diverge(std::move(why));
}

void end_job(const std::string& message) {
  std::fputs(message.c_str(), stderr);
  std::fflush(stderr);
  // The message is in the pipe to the launcher, not yet on the user's terminal;
  // MPI_Abort tears the job down at once, and a launcher busy elsewhere (a
  // loaded node) loses what it has not forwarded yet.
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  MPI_Abort(MPI_COMM_WORLD, 1);
  std::_Exit(1);  // MPI_Abort may return while the launcher ends the job
}

void end_job_when_out_of_step() { shared->end_job.store(true, std::memory_order_release); }

bool sharded_over_processes() { return shared->end_job.load(std::memory_order_acquire); }

bool in_step() { return !shared->diverged.load(std::memory_order_acquire); }

ffi::Error refusal(std::string_view operation) {
  State& s = *shared;
  std::lock_guard lock(s.mutex);
  return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                    "jaxcomm: " + std::string(operation) + " refused: rank " +
                        std::to_string(world_rank()) + " is out of step with its peers: " + s.why +
                        ". Its peers may be waiting in a call that it skipped, so it makes no "
                        "more calls, rather than pair one with the wrong call of a peer. End the "
                        "job (an uncaught exception ends it under `python -m mpi4py`).");
}

std::optional<std::string> out_of_step() {
  State& s = *shared;
  if (!s.diverged.load(std::memory_order_acquire)) return std::nullopt;
  std::lock_guard lock(s.mutex);
  return s.why;
}

std::optional<std::string> refusal_pending() {
  State& s = *shared;
  std::lock_guard lock(s.mutex);
  if (!s.refusal_due.load(std::memory_order_relaxed)) return std::nullopt;
  return s.pending;
}

void refusal_known(bool refused) {
  State& s = *shared;
  std::string why;
  {
    std::lock_guard lock(s.mutex);
    if (!s.refusal_due.load(std::memory_order_relaxed)) return;
    why = std::move(s.pending);
    s.pending.clear();
    s.refusal_due.store(false, std::memory_order_release);
  }
  if (refused) diverge(std::move(why));
}

void resume() {
  State& s = *shared;
  {
    std::lock_guard lock(s.mutex);
    s.why.clear();
    s.pending.clear();
    s.refusal_due.store(false, std::memory_order_release);
    s.diverged.store(false, std::memory_order_release);
  }
  std::lock_guard lock(s.owed_mutex);
  s.owed.clear();
  s.sole.store(kNobody, std::memory_order_release);
}

namespace {
ffi::Error InStep(ffi::RunId run, ffi::Token, ffi::Result<ffi::Token>, std::string_view kernel,
                  bool last, ffi::Span<const int64_t> comms, int32_t owing) {
  if (!may_run(run.run_id, comms)) return refusal(kernel);
  if (owing != kInside) ran(run.run_id, comms, owing == kSettles, "custom kernel");
  return ffi::Error::Success();
}

ffi::Error Settled(ffi::RunId run, ffi::Token, ffi::Result<ffi::Token>, bool last,
                   ffi::Span<const int64_t> comms, int32_t owing) {
  if (owing != kInside) ran(run.run_id, comms, owing == kSettles, "jaxcomm");
  return ffi::Error::Success();
}

// What a computation stopped after, where it stopped inside (or before the
// first operation of) a loop, a conditional or a nested function.
constexpr std::string_view kRegion =
    "entry into a loop, conditional or nested function with jaxcomm operations";

ffi::Error EnteredRegion(ffi::RunId run, ffi::Token, ffi::Result<ffi::Token>, bool last,
                         ffi::Span<const int64_t> comms, int32_t owing) {
  // Out of step (or put out of step now by what an earlier computation owes),
  // the operations inside refuse to run, each under its own name; one that
  // does not run refuses nothing. Else the computation owes them from now on,
  // whatever `owing` says: they say nothing of their own.
  if (may_run(run.run_id, comms)) ran(run.run_id, comms, /*last=*/false, kRegion);
  return ffi::Error::Success();
}
}  // namespace

// token -> token, with the lockstep attributes (lockstep.h) after any of its own.
#define JAXCOMM_BIND_TOKEN_CALL(...)                                     \
  ffi::Ffi::Bind().Ctx<ffi::RunId>().Arg<ffi::Token>().Ret<ffi::Token>() \
      __VA_ARGS__ JAXCOMM_BIND_LOCKSTEP_ATTRIBUTES

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxcomm_in_step, InStep,
                              JAXCOMM_BIND_TOKEN_CALL(.Attr<std::string_view>("kernel")));
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxcomm_settled, Settled, JAXCOMM_BIND_TOKEN_CALL());
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxcomm_entered, EnteredRegion, JAXCOMM_BIND_TOKEN_CALL());
#undef JAXCOMM_BIND_TOKEN_CALL

bool on_python_thread() { return PyGILState_GetThisThreadState() != nullptr; }

void* state() { return shared; }

void share(void* state) { shared = static_cast<State*>(state); }

}  // namespace jaxcomm
