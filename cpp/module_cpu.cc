// The Python module `jaxcomm._jaxcomm_cpu`: hands the CPU handlers to
// jax.ffi.register_ffi_target and reports which MPI library it is linked to.
#include <mpi.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <string>

#include "call.h"
#include "ops.h"

namespace nb = nanobind;

namespace jaxcomm {
#define JAXCOMM_DECLARE(name, function, binding) XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxcomm_##name);
JAXCOMM_OPERATIONS(JAXCOMM_DECLARE, _)
#undef JAXCOMM_DECLARE
}  // namespace jaxcomm

namespace {

std::string library_version() {
  char text[MPI_MAX_LIBRARY_VERSION_STRING];
  int length = 0;
  MPI_Get_library_version(text, &length);
  return std::string(text, static_cast<size_t>(length));
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
#define JAXCOMM_REGISTER(name, function, binding) \
  targets["jaxcomm_" #name] = nb::capsule(reinterpret_cast<void*>(jaxcomm::jaxcomm_##name));
    JAXCOMM_OPERATIONS(JAXCOMM_REGISTER, _)
#undef JAXCOMM_REGISTER
    return targets;
  });
  m.def("mpi_library_version", &library_version,
        "MPI_Get_library_version of the libmpi this module is linked to.");
  m.def("mpi_initialized", &initialized,
        "MPI_Initialized as seen by the libmpi this module is linked to.");
  m.def("call_count", &jaxcomm::call_count,
        "How many times a handler has called into MPI in this process.");
  m.attr("MPI_VERSION") = MPI_VERSION;
}
