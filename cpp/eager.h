// jaxcomm's eager path: the Python module's EagerCall class (an operation of the
// table in operations.h on arrays of fixed types, run on their buffers outside XLA) and
// the eager complete, test and discard of non-blocking requests.
#ifndef JAXCOMM_EAGER_H_
#define JAXCOMM_EAGER_H_

#include <nanobind/nanobind.h>

namespace jaxcomm {

// Adds the eager path's classes and functions to the module `m`.
void define_eager(nanobind::module_& m);

}  // namespace jaxcomm

#endif  // JAXCOMM_EAGER_H_
