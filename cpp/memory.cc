#include "memory.h"

#include <algorithm>
#include <cstring>

namespace jaxcomm::mpi {
namespace {

thread_local const Memory* current_memory = nullptr;

template <typename T>
void fill_as(void* to, const void* element, int64_t count) {
  T value;
  std::memcpy(&value, element, sizeof value);
  std::fill_n(static_cast<T*>(to), count, value);
}

struct Bytes16 {
  unsigned char b[16];
};

}  // namespace

void Memory::copy(void* to, const void* from, size_t bytes) const {
  if (bytes > 0) std::memcpy(to, from, bytes);
}

void Memory::fill(void* to, const void* element, size_t width, int64_t count) const {
  switch (width) {
    case 1:
      std::memset(to, *static_cast<const unsigned char*>(element), static_cast<size_t>(count));
      return;
    case 2:
      return fill_as<uint16_t>(to, element, count);
    case 4:
      return fill_as<uint32_t>(to, element, count);
    case 8:
      return fill_as<uint64_t>(to, element, count);
    default:
      return fill_as<Bytes16>(to, element, count);
  }
}

void Memory::edit(void* data, size_t, const std::function<void(void*)>& change) const {
  change(data);
}

const Memory& memory() {
  static const Memory host_memory;
  return current_memory ? *current_memory : host_memory;
}

UseMemory::UseMemory(const Memory& m) : previous_(current_memory) { current_memory = &m; }
UseMemory::~UseMemory() { current_memory = previous_; }

void copy_if_distinct(ffi::Result<ffi::AnyBuffer>& out, const ffi::AnyBuffer& in) {
  if (out->size_bytes() != 0 && bytes(out) != bytes(in))
    memory().copy(bytes(out), bytes(in), in.size_bytes());
}

void zero(ffi::Result<ffi::AnyBuffer>& out) {
  const unsigned char nothing = 0;
  memory().fill(out->untyped_data(), &nothing, 1, static_cast<int64_t>(out->size_bytes()));
}

}  // namespace jaxcomm::mpi
