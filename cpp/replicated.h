// Checking mode's test behind the gradient convention (replicated.cc): is a
// cotangent identical on every rank?
#ifndef JAXCOMM_REPLICATED_H_
#define JAXCOMM_REPLICATED_H_

#include <cstdint>
#include <string_view>

#include "binding.h"

namespace jaxcomm::mpi {

ffi::Error CheckReplicated(Token, Buffer x, TokenOut, Result out, int64_t comm, bool check,
                           std::string_view operation);

}  // namespace jaxcomm::mpi

// X(name, function, binding, attributes), as operations.h describes.
#define JAXCOMM_REPLICATED(X, base, A) \
  X(check_replicated, CheckReplicated, one_input<mpi::Buffer>(base), A(std::string_view, operation))

#endif  // JAXCOMM_REPLICATED_H_
