// A vector of plain values that holds up to N of them in itself and only beyond
// that on the heap. The count arrays of the variable-size exchanges hold a value
// or two per peer and are made afresh on every call: as std::vectors they cost
// a small alltoallv eight heap allocations and frees (callgrind), which its
// small-message time shows.
#ifndef JAXCOMM_SMALL_VECTOR_H_
#define JAXCOMM_SMALL_VECTOR_H_

#include <algorithm>
#include <cstddef>
#include <memory>
#include <span>
#include <type_traits>
#include <utility>

namespace jaxcomm::mpi {

template <typename T, size_t N>
class SmallVector {
  static_assert(std::is_trivially_copyable_v<T> && N > 0, "plain values, some of them in place");

 public:
  SmallVector() = default;
  explicit SmallVector(size_t n, T value = T()) { resize(n, value); }
  SmallVector(SmallVector&& other) noexcept
      : heap_(std::move(other.heap_)),
        size_(std::exchange(other.size_, 0)),
        capacity_(std::exchange(other.capacity_, N)) {
    if (!heap_) std::copy_n(other.local_, size_, local_);
  }
  SmallVector& operator=(SmallVector&& other) noexcept {
    if (this != &other) {
      heap_ = std::move(other.heap_);
      size_ = std::exchange(other.size_, 0);
      capacity_ = std::exchange(other.capacity_, N);
      if (!heap_) std::copy_n(other.local_, size_, local_);
    }
    return *this;
  }
  SmallVector(const SmallVector&) = delete;
  SmallVector& operator=(const SmallVector&) = delete;

  // Never null, even where empty: MPI gets an array it does not read rather than
  // a null pointer, which some MPI libraries refuse whatever the count.
  T* data() { return heap_ ? heap_.get() : local_; }
  const T* data() const { return heap_ ? heap_.get() : local_; }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  T& operator[](size_t i) { return data()[i]; }
  const T& operator[](size_t i) const { return data()[i]; }
  T* begin() { return data(); }
  T* end() { return data() + size_; }
  const T* begin() const { return data(); }
  const T* end() const { return data() + size_; }
  operator std::span<T>() { return {data(), size_}; }
  operator std::span<const T>() const { return {data(), size_}; }

  // `n` values: those held now, then copies of `value`.
  void resize(size_t n, T value = T()) {
    const size_t held = size_;
    resize_for_overwrite(n);
    if (n > held) std::fill(data() + held, data() + n, value);
  }
  // `n` values: those held now, then values to be written.
  void resize_for_overwrite(size_t n) {
    if (n > capacity_) {
      auto grown = std::make_unique_for_overwrite<T[]>(n);
      std::copy_n(data(), size_, grown.get());
      heap_ = std::move(grown);
      capacity_ = n;
    }
    size_ = n;
  }

 private:
  T local_[N];
  std::unique_ptr<T[]> heap_;  // where the values are, if more than N were held
  size_t size_ = 0;
  size_t capacity_ = N;
};

}  // namespace jaxcomm::mpi

#endif  // JAXCOMM_SMALL_VECTOR_H_
