// What every collective handler does before it calls MPI: checking mode's
// agreement on the call (call.h), then the MPI datatype (and, for a reduction,
// the operator) of its elements. Shared by reductions.cc, collectives.cc and
// nonblocking.cc.
#ifndef JAXCOMM_STARTED_H_
#define JAXCOMM_STARTED_H_

#include <mpi.h>

#include <cstdint>

#include "binding.h"
#include "call.h"
#include "datatypes.h"

namespace jaxcomm::mpi {

// A collective past checking mode's agreement on the call: its communicator and
// the MPI datatype of its elements, or the error that ends it.
struct Started {
  ffi::Error error;
  MPI_Comm comm;
  MPI_Datatype type;
};

inline Started start(Call& call, const Buffer& x) {
  Started started{call.agree(), call.comm(), MPI_DATATYPE_NULL};
  if (started.error.success()) started.error = datatype_of(x, call.operation(), &started.type);
  return started;
}

// The same for a reduction, which records `op` among the call's params; with the
// MPI operator that reduces x's elements.
struct StartedReduction {
  ffi::Error error;
  MPI_Comm comm;
  MPI_Datatype type;
  MPI_Op mpi_operator;
};

inline StartedReduction start_reduction(Call& call, const Buffer& x, int32_t op) {
  StartedReduction started{call.reduce_op(op).agree(), call.comm(), MPI_DATATYPE_NULL, MPI_OP_NULL};
  if (started.error.success())
    started.error = reduction_of(x, op, call.operation(), &started.type, &started.mpi_operator);
  return started;
}

inline int comm_size(MPI_Comm comm) {
  int size = 0;
  MPI_Comm_size(comm, &size);
  return size;
}

}  // namespace jaxcomm::mpi

#endif  // JAXCOMM_STARTED_H_
