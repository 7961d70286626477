#include "lockstep.h"

#include <Python.h>
#include <mpi.h>

#include <atomic>
#include <mutex>
#include <utility>

namespace jaxcomm {
namespace {

struct State {
  std::atomic<bool> diverged{false};
  std::mutex mutex;
  std::string why;
};

State own_state;
State* shared = &own_state;

// How an operation's error leaves its peers (the header's list).
enum class Ending { kUnpaired, kPaired, kEveryRank };

// The last error this thread marked, and how: the wrapper of the operation
// compares it with the error the operation returns, so that an error marked and
// then replaced by another is not taken for the marked one.
struct Marked {
  std::string message;
  Ending ending = Ending::kUnpaired;
};
thread_local std::optional<Marked> marked;
thread_local int ranks = 0;  // of the operation's communicator; 0: unknown

// Marks `error` as ending so, or as marked already if that says more.
ffi::Error mark(ffi::Error error, Ending ending) {
  if (error.failure() && !(marked && marked->message == error.message() && marked->ending > ending))
    marked = Marked{error.message(), ending};
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

int world_rank() {
  int rank = -1, initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank;
}

}  // namespace

ffi::Error paired(ffi::Error error) { return mark(std::move(error), Ending::kPaired); }

ffi::Error on_every_rank(ffi::Error error) { return mark(std::move(error), Ending::kEveryRank); }

void running_on(int size) { ranks = size; }

void failed(std::string_view operation, const ffi::Error& error, bool last, bool synchronous) {
  Ending ending = marked && marked->message == error.message() ? marked->ending : Ending::kUnpaired;
  if (ranks == 1 && ending == Ending::kUnpaired) ending = Ending::kPaired;
  if (ending == Ending::kEveryRank && ranks == world_size()) last = true;  // all skip the rest
  marked.reset();
  ranks = 0;
  const char* why = nullptr;
  if (ending == Ending::kUnpaired) {
    why = "before it had made all of its exchanges";
  } else if (!last) {
    why = "and the later jaxcomm operations of its computation did not run";
  } else if (!synchronous) {
    why =
        "after the call that dispatched its computation had returned, so JAX gives the error to "
        "the next call with jaxcomm's effect instead of running it";
  } else {
    return;
  }
  diverge(std::string(operation) + " failed " + why + " (" + error.message() + ")");
}

void diverge(std::string why) {
  State& s = *shared;
  std::lock_guard lock(s.mutex);
  if (s.diverged.load(std::memory_order_relaxed)) return;
  s.why = std::move(why);
  s.diverged.store(true, std::memory_order_release);
}

ffi::Error in_step(std::string_view operation) {
  marked.reset();
  ranks = 0;
  State& s = *shared;
  if (!s.diverged.load(std::memory_order_acquire)) return ffi::Error::Success();
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

void resume() {
  State& s = *shared;
  std::lock_guard lock(s.mutex);
  s.why.clear();
  s.diverged.store(false, std::memory_order_release);
}

namespace {
ffi::Error InStep(ffi::Token, ffi::Result<ffi::Token>, std::string_view kernel) {
  return in_step(kernel);
}
}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jaxcomm_in_step, InStep,
    ffi::Ffi::Bind().Arg<ffi::Token>().Ret<ffi::Token>().Attr<std::string_view>("kernel"));

bool on_python_thread() { return PyGILState_GetThisThreadState() != nullptr; }

void* state() { return shared; }

void share(void* state) { shared = static_cast<State*>(state); }

}  // namespace jaxcomm
