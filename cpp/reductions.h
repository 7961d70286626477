// The reductions (reductions.cc): each calls the MPI library's own reduction
// of x with the operator `op` (jaxcomm/_datatypes.py's codes).
#ifndef JAXCOMM_REDUCTIONS_H_
#define JAXCOMM_REDUCTIONS_H_

#include <cstdint>

#include "binding.h"

namespace jaxcomm::mpi {

ffi::Error Allreduce(Token, Buffer x, TokenOut, Result out, int64_t comm, bool check, int32_t op);
ffi::Error Reduce(Token, Buffer x, TokenOut, Result out, int64_t comm, bool check, int32_t op,
                  int32_t root);
ffi::Error Scan(Token, Buffer x, TokenOut, Result out, int64_t comm, bool check, int32_t op);
ffi::Error Exscan(Token, Buffer x, TokenOut, Result out, int64_t comm, bool check, int32_t op);
ffi::Error ReduceScatter(Token, Buffer x, TokenOut, Result out, int64_t comm, bool check,
                         int32_t op);

}  // namespace jaxcomm::mpi

// X(name, function, binding, attributes) for each, as operations.h describes.
#define JAXCOMM_REDUCTIONS(X, base, A)                                             \
  X(allreduce, Allreduce, one_input<mpi::Buffer>(base), A(int32_t, op))            \
  X(reduce, Reduce, one_input<mpi::Buffer>(base), A(int32_t, op) A(int32_t, root)) \
  X(scan, Scan, one_input<mpi::Buffer>(base), A(int32_t, op))                      \
  X(exscan, Exscan, one_input<mpi::Buffer>(base), A(int32_t, op))                  \
  X(reduce_scatter, ReduceScatter, one_input<mpi::Buffer>(base), A(int32_t, op))

#endif  // JAXCOMM_REDUCTIONS_H_
