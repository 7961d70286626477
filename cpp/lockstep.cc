#include "lockstep.h"

#include <Python.h>
#include <mpi.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "call.h"

namespace jaxcomm {
namespace {

struct State {
  std::atomic<bool> diverged{false};
  std::atomic<bool> end_job{false};  // end_job_when_out_of_step()
  std::mutex mutex;
  std::string why;
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

void failed(std::string_view operation, const ffi::Error& error, bool last, bool synchronous) {
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

void resume() {
  State& s = *shared;
  std::lock_guard lock(s.mutex);
  s.why.clear();
  s.diverged.store(false, std::memory_order_release);
}

namespace {
ffi::Error InStep(ffi::Token, ffi::Result<ffi::Token>, std::string_view kernel) {
  return in_step() ? ffi::Error::Success() : refusal(kernel);
}
}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jaxcomm_in_step, InStep,
    ffi::Ffi::Bind().Arg<ffi::Token>().Ret<ffi::Token>().Attr<std::string_view>("kernel"));

bool on_python_thread() { return PyGILState_GetThisThreadState() != nullptr; }

void* state() { return shared; }

void share(void* state) { shared = static_cast<State*>(state); }

}  // namespace jaxcomm
