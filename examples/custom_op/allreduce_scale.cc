// A user kernel for jaxcomm: allreduce (SUM) then multiply by `scale`, in one call.
// Built against the header that ships with jaxcomm (python -m jaxcomm --cflags).

#include <mpi.h>

#include <cstdint>
#include <cstring>

#include "jaxcomm/jaxcomm.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// A jaxcomm kernel takes the ordered-effect token first and returns it first,
// then the attributes comm, rank and size, then its own.
ffi::Error AllreduceScale(ffi::Token, ffi::Buffer<ffi::F64> x, ffi::Result<ffi::Token>,
                          ffi::ResultBuffer<ffi::F64> out, int64_t comm_handle, int32_t /*rank*/,
                          int32_t /*size*/, double scale) {
  MPI_Comm comm = jaxcomm::comm_from_handle(comm_handle);
  const int64_t n = x.element_count();
  if (n > jaxcomm::kMaxCount)
    return jaxcomm::invalid_argument("allreduce_scale", "array too large");
  const void* send = x.typed_data() == out->typed_data() ? MPI_IN_PLACE : x.typed_data();
  JAXCOMM_CHECK_MPI(
      MPI_Allreduce(send, out->typed_data(), static_cast<int>(n), MPI_DOUBLE, MPI_SUM, comm),
      "allreduce_scale", comm);
  for (int64_t i = 0; i < n; ++i) out->typed_data()[i] *= scale;
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(allreduce_scale, AllreduceScale,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Token>()
                                  .Arg<ffi::Buffer<ffi::F64>>()
                                  .Ret<ffi::Token>()
                                  .Ret<ffi::Buffer<ffi::F64>>()
                                  .Attr<int64_t>("comm")
                                  .Attr<int32_t>("rank")
                                  .Attr<int32_t>("size")
                                  .Attr<double>("scale"));
