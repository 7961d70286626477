// Where jaxcomm's host functions write buffer contents themselves (rather than
// handing the buffers to MPI): host memory by default; the CUDA backend swaps in
// device memory for a call whose device pointers go to a CUDA-aware MPI.
#ifndef JAXCOMM_MEMORY_H_
#define JAXCOMM_MEMORY_H_

#include <cstddef>
#include <cstdint>
#include <functional>

#include "xla/ffi/api/ffi.h"

namespace jaxcomm::mpi {

namespace ffi = xla::ffi;

class Memory {
 public:
  virtual ~Memory() = default;
  virtual void copy(void* to, const void* from, size_t bytes) const;
  // `count` copies of one `width`-byte element (width 1, 2, 4, 8 or 16).
  virtual void fill(void* to, const void* element, size_t width, int64_t count) const;
  // Runs `change` on the buffer's contents, in host memory.
  virtual void edit(void* data, size_t bytes, const std::function<void(void*)>& change) const;
};

// The memory of this thread's current call.
const Memory& memory();

// Makes `m` the memory of this thread's calls while the object lives.
class UseMemory {
 public:
  explicit UseMemory(const Memory& m);
  ~UseMemory();
  UseMemory(const UseMemory&) = delete;
  UseMemory& operator=(const UseMemory&) = delete;

 private:
  const Memory* previous_;
};

inline char* bytes(const ffi::AnyBuffer& b) { return static_cast<char*>(b.untyped_data()); }
inline char* bytes(ffi::Result<ffi::AnyBuffer>& b) { return static_cast<char*>(b->untyped_data()); }

// out = in, unless XLA gave both the same buffer: where the result is x itself
// (jaxcomm/_primitive.py, result_is_x), or x was donated.
void copy_if_distinct(ffi::Result<ffi::AnyBuffer>& out, const ffi::AnyBuffer& in);

void zero(ffi::Result<ffi::AnyBuffer>& out);

}  // namespace jaxcomm::mpi

#endif  // JAXCOMM_MEMORY_H_
