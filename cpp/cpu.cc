// The Python module `jaxcomm._jaxcomm_cpu`: the CPU handlers (the host functions
// bound directly to XLA's buffers), handed to jax.ffi.register_ffi_target; the
// eager path (eager.h); and which MPI library the module is linked to.
#include <mpi.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "call.h"
#include "eager.h"
#include "lockstep.h"
#include "operations.h"
#include "requests.h"

namespace nb = nanobind;

namespace jaxcomm {
namespace {

// A handler called by XLA. Out of step, or where an earlier computation owes a
// later operation on a communicator of its computation (`comms`), it refuses to
// run (lockstep.h). When it fails, its computation ends before the waits of the
// requests it posted (requests.h, abandon_compiled), and this rank may go out of
// step: `last` says that no jaxcomm operation follows it in its computation.
// Once it has run, its computation owes the operations that follow, or owes
// nothing more, as `owing` says (lockstep.h, Owing; jaxcomm/_lockstep.py).
template <auto Function>
struct Compiled;

template <typename... Args, ffi::Error (*Function)(Args...)>
struct Compiled<Function> {
  static ffi::Error Run(ffi::RunId run, Args... args, bool last, ffi::Span<const int64_t> comms,
                        int32_t owing) {
    constexpr std::string_view operation = kOperationName<Function>;
    if (!may_run(run.run_id, comms)) return refusal(operation);
    Entered entered(operation);
    std::optional<mpi::Executing> executing;  // a start's requests are the execution's
    if constexpr (kStarts<Function>) executing.emplace(run.run_id);
    ffi::Error error = Function(std::move(args)...);
    if (error.failure()) {
      // In step, the peers skip the rest of the computation too: it owes nothing.
      if (failed(operation, error, last, on_python_thread()))
        ran(run.run_id, comms, /*last=*/true, operation);
      mpi::abandon_compiled(run.run_id);
    } else if (owing != kInside) {
      ran(run.run_id, comms, owing == kSettles, operation);
    }
    return error;
  }
};

}  // namespace

#define JAXCOMM_DEFINE_CPU_HANDLER(name, function, binding, attributes)        \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxcomm_##name, Compiled<&mpi::function>::Run, \
                                binding attributes JAXCOMM_BIND_LOCKSTEP_ATTRIBUTES);
// The execution's RunId first: whose requests a failure abandons.
#define JAXCOMM_CPU_BASE ffi::Ffi::Bind().Ctx<ffi::RunId>()
JAXCOMM_OPERATIONS(JAXCOMM_DEFINE_CPU_HANDLER, JAXCOMM_CPU_BASE, JAXCOMM_BIND_ATTRIBUTE)
JAXCOMM_NONBLOCKING_OPERATIONS(JAXCOMM_DEFINE_CPU_HANDLER, JAXCOMM_CPU_BASE, JAXCOMM_BIND_ATTRIBUTE)
JAXCOMM_DEFINE_CPU_HANDLER(wait, Wait, waiting(JAXCOMM_CPU_BASE), )
JAXCOMM_DEFINE_CPU_HANDLER(test, Test, testing(JAXCOMM_CPU_BASE), )
#undef JAXCOMM_CPU_BASE
#undef JAXCOMM_DEFINE_CPU_HANDLER
}  // namespace jaxcomm

namespace {

std::string library_version() {
  char text[MPI_MAX_LIBRARY_VERSION_STRING];
  int length = 0;
  MPI_Get_library_version(text, &length);
  // Some libraries count the terminating NUL in `length`: the text ends at it.
  return std::string(text, strnlen(text, static_cast<size_t>(length)));
}

bool initialized() {
  int flag = 0;
  MPI_Initialized(&flag);
  return flag != 0;
}

}  // namespace

NB_MODULE(_jaxcomm_cpu, m) {
  m.doc() = "jaxcomm's CPU XLA FFI handlers.";
  m.def("registrations", [] {
    nb::dict targets;
#define JAXCOMM_REGISTER(name, ...) \
  targets["jaxcomm_" #name] = nb::capsule(reinterpret_cast<void*>(jaxcomm::jaxcomm_##name));
    JAXCOMM_OPERATIONS(JAXCOMM_REGISTER, _, JAXCOMM_ATTRIBUTE_NAME)
    JAXCOMM_NONBLOCKING_OPERATIONS(JAXCOMM_REGISTER, _, JAXCOMM_ATTRIBUTE_NAME)
    JAXCOMM_REGISTER(wait, _)
    JAXCOMM_REGISTER(test, _)
    targets["jaxcomm_in_step"] = nb::capsule(reinterpret_cast<void*>(jaxcomm::jaxcomm_in_step));
    targets["jaxcomm_settled"] = nb::capsule(reinterpret_cast<void*>(jaxcomm::jaxcomm_settled));
    targets["jaxcomm_entered"] = nb::capsule(reinterpret_cast<void*>(jaxcomm::jaxcomm_entered));
#undef JAXCOMM_REGISTER
    return targets;
  });
  m.def(
      "operations",
      [] {
        nb::dict operations;
#define JAXCOMM_DESCRIBE(name, function, binding, names)                                   \
  operations[#name] = nb::make_tuple(nb::tuple(nb::cast(std::vector<std::string>{names})), \
                                     jaxcomm::inputs_of<&jaxcomm::mpi::function>);
        JAXCOMM_OPERATIONS(JAXCOMM_DESCRIBE, _, JAXCOMM_ATTRIBUTE_NAME)
        JAXCOMM_NONBLOCKING_OPERATIONS(JAXCOMM_DESCRIBE, _, JAXCOMM_ATTRIBUTE_NAME)
#undef JAXCOMM_DESCRIBE
        return operations;
      },
      "Each operation's own FFI attributes (after comm and check) in binding order, and how "
      "many buffers it takes.");
  jaxcomm::define_eager(m);
  nb::dict dtype_codes;
  for (int code = 0; code < 64; ++code) {
    const char* name = jaxcomm::dtype_name(static_cast<xla::ffi::DataType>(code));
    if (std::string_view(name) != "unsupported") dtype_codes[name] = code;
  }
  m.attr("dtype_codes") = dtype_codes;
  nb::list reduce_ops;
  for (int32_t op = 0; op <= static_cast<int32_t>(jaxcomm::ReduceOp::kBxor); ++op) {
    reduce_ops.append(jaxcomm::reduce_op_name(op));
  }
  m.attr("reduce_op_names") = reduce_ops;
  m.def("unfinished_orphans", &jaxcomm::mpi::unfinished_orphans,
        "Drop every request still pending; how many MPI has not completed yet.");
  m.def("in_flight", &jaxcomm::mpi::in_flight, nb::arg("comm_key"),
        "How many requests posted on the communicator `comm_key` MPI has not completed, each "
        "tested once.");
  m.def("mpi_library_version", &library_version,
        "MPI_Get_library_version of the libmpi this module is bound to.");
  m.def("mpi_initialized", &initialized,
        "MPI_Initialized as seen by the libmpi this module is bound to.");
  m.def("configure", &jaxcomm::configure, nb::arg("debug"), nb::arg("timeout"),
        "JAXCOMM_DEBUG and JAXCOMM_TIMEOUT, read by jaxcomm._settings.");
  m.def("register_comm", &jaxcomm::register_comm, nb::arg("key"), nb::arg("handle"),
        "Let operations compiled with `key` use the MPI communicator `handle`.");
  m.def("unregister_comm", &jaxcomm::unregister_comm, nb::arg("key"),
        "Operations compiled with `key` fail from now on (the communicator is freed).");
  m.def(
      "refusal",
      [](std::string_view operation) -> std::optional<std::string> {
        if (jaxcomm::in_step()) return std::nullopt;
        return "FAILED_PRECONDITION: " + jaxcomm::refusal(operation).message();
      },
      nb::arg("operation"), "The error that refuses `operation` while out of step, else None.");
  m.def(
      "refusal_on",
      [](std::string_view operation, std::vector<int64_t> comms) -> std::optional<std::string> {
        if (jaxcomm::may_run(std::nullopt, {comms.data(), comms.size()})) return std::nullopt;
        return "FAILED_PRECONDITION: " + jaxcomm::refusal(operation).message();
      },
      nb::arg("operation"), nb::arg("comms"),
      "The error that refuses `operation`, a call outside any computation on the "
      "communicators `comms` (keys), as may_run decides (lockstep.h), else None.");
  m.def("out_of_step", &jaxcomm::out_of_step,
        "Why this rank is out of step with its peers (lockstep.h), or None.");
  m.def("refusal_pending", &jaxcomm::refusal_pending,
        "Why the next refused call would put this rank out of step (lockstep.h), or None.");
  m.def("refusal_known", &jaxcomm::refusal_known, nb::arg("refused"),
        "Whether the refusal that refusal_pending() announces happened (lockstep.h).");
  m.def("diverge", &jaxcomm::diverge, nb::arg("why"),
        "Put this rank out of step: `why` says which of its calls did not run.");
  m.def("diverge_if_owed", &jaxcomm::diverge_if_owed,
        "Put this rank out of step if a computation still owes operations (lockstep.h).");
  m.def("end_job_when_out_of_step", &jaxcomm::end_job_when_out_of_step,
        "From now on, going out of step ends the job (lockstep.h).");
  m.def("resume", &jaxcomm::resume,
        "Back in step, for a test that made the calls its peers waited for.");
  m.def(
      "lockstep_state", [] { return nb::capsule(jaxcomm::state()); },
      "The lockstep state, for the CUDA module to share.");
  m.def("call_count", &jaxcomm::call_count,
        "How many times a handler has called into MPI in this process.");
  m.attr("MPI_VERSION") = MPI_VERSION;
  m.attr("MPI_FAMILY") = JAXCOMM_MPI_FAMILY;  // the ABI family of the headers (CMakeLists.txt)
}
