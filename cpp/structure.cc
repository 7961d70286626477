// Checking mode's test that every rank gives a collective a pytree of the same
// structure: one fingerprint, agreed as a collective's is (call.h).
#include "structure.h"

#include <cstdint>
#include <string_view>

#include "call.h"

namespace jaxcomm::mpi {

ffi::Error CheckStructure(Token, TokenOut, int64_t comm_key, bool check, std::string_view operation,
                          std::string_view structure) {
  // Described as the operation the pytree goes to, "allreduce(pytree=...)": a peer
  // that gave that operation one array instead is then named beside it, and so
  // is one that made another call.
  Entered as(operation);
  Call call(comm_key, check);
  return call.param("pytree", structure).agree();
}

}  // namespace jaxcomm::mpi
