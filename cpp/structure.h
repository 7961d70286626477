// Checking mode's test that every rank gives a collective a pytree of the same
// structure (structure.cc). A pytree's leaves travel as messages of their own,
// paired across ranks by position: a rank with a leaf more, or its leaves in
// another order, would pair them with its peers' next call, silently where the
// shapes agree.
#ifndef JAXCOMM_STRUCTURE_H_
#define JAXCOMM_STRUCTURE_H_

#include <cstdint>
#include <string_view>

#include "binding.h"

namespace jaxcomm::mpi {

// Every rank's `structure` (its leaves' paths and its nodes' static data, as
// jaxcomm/_structure.py writes them) must be the same, as a collective's
// fingerprint must: the error names `operation`, the call the pytree goes to.
ffi::Error CheckStructure(Token, TokenOut, int64_t comm, bool check, std::string_view operation,
                          std::string_view structure);

}  // namespace jaxcomm::mpi

// X(name, function, binding, attributes), as operations.h describes.
#define JAXCOMM_STRUCTURE(X, base, A)                \
  X(check_structure, CheckStructure, no_input(base), \
    A(std::string_view, operation) A(std::string_view, structure))

#endif  // JAXCOMM_STRUCTURE_H_
