// What the blocking (p2p.cc) and non-blocking (nonblocking.cc) point-to-point
// handlers share: messages split into int-sized pieces, and the check that each
// piece arrived whole.
#ifndef JAXCOMM_P2P_H_
#define JAXCOMM_P2P_H_

#include <mpi.h>

#include <cstdint>
#include <string>
#include <string_view>

#include "jaxcomm/jaxcomm.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::mpi {

// How many messages for_each_piece splits `count` elements into.
inline int64_t pieces(int64_t count) {
  return count == 0 ? 1 : (count + kMaxCount - 1) / kMaxCount;
}

// A message shorter than the buffer is an error, not a partly written result.
inline ffi::Error check_count(const MPI_Status& s, MPI_Datatype type, int expected,
                              std::string_view operation) {
  if (s.MPI_SOURCE == MPI_PROC_NULL) return ffi::Error::Success();
  int count = 0;
  MPI_Get_count(&s, type, &count);
  if (count == expected) return ffi::Error::Success();
  return invalid_argument(operation, "received " + std::to_string(count) + " elements from rank " +
                                         std::to_string(s.MPI_SOURCE) +
                                         " but the receive buffer holds " +
                                         std::to_string(expected) +
                                         " (the sender's array and the template differ in size)");
}

}  // namespace jaxcomm::mpi

#endif  // JAXCOMM_P2P_H_
