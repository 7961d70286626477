#include "counts.h"

#include <algorithm>
#include <limits>
#include <numeric>
#include <type_traits>

#include "call.h"
#include "jaxcomm/jaxcomm.h"

namespace jaxcomm::mpi {
namespace {

static_assert(std::is_same_v<int, int32_t>, "MPI's int counts are the int32 counts returned");

// The `n` values at `data` as ints, if each is a count of rows (0 to 2^31 - 1).
template <typename T>
bool read_as_ints(const void* data, size_t n, std::vector<int>& out) {
  const T* values = static_cast<const T*>(data);
  out.resize(n);
  bool valid = true;
  for (size_t i = 0; i < n; ++i) {
    const T v = values[i];
    bool fits = static_cast<uint64_t>(v) <= static_cast<uint64_t>(kMaxCount);
    if constexpr (std::is_signed_v<T>) fits = fits && v >= 0;
    valid = valid && fits;
    out[i] = fits ? static_cast<int>(v) : 0;
  }
  return valid;
}

// Integer values as text, as passed (unsigned ones unsigned).
template <typename T>
std::string text_of(std::span<const T> values) {
  std::string text = "[";
  for (size_t i = 0; i < values.size(); ++i) {
    text += i ? ", " : "";
    if constexpr (sizeof(T) == 1)
      text += std::to_string(static_cast<int>(values[i]));
    else
      text += std::to_string(values[i]);
  }
  return text + "]";
}

// Calls f.template operator()<T>() with T the C type of integer dtype `dtype`;
// false if it is not an integer dtype.
template <typename F>
bool with_integer_type(ffi::DataType dtype, F&& f) {
  bool integer = false;
  visit_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) {
      f.template operator()<T>();
      integer = true;
    }
  });
  return integer;
}

// The rows that `counts` add up to.
int64_t rows_in(std::span<const int> counts) {
  return std::accumulate(counts.begin(), counts.end(), int64_t{0});
}

}  // namespace

std::string counts_text(std::span<const int> counts) { return text_of(counts); }

Counts::Counts(const Buffer& buffer, std::string_view name, int64_t members, int64_t per_member)
    : buffer_(&buffer), name_(name), members_(members), per_member_(per_member) {
  const size_t n = static_cast<size_t>(members * per_member);
  if (buffer.element_count() != n) {
    owned_.assign(n, 0);
    values_ = owned_;
    refuse("must hold " + std::to_string(n) + " counts, not " +
           std::to_string(buffer.element_count()));
    return;
  }
  if (buffer.element_type() == ffi::DataType::S32) {  // the usual case: read where XLA holds it
    values_ = {static_cast<const int*>(buffer.untyped_data()), n};
    if (std::all_of(values_.begin(), values_.end(), [](int c) { return c >= 0; })) {
      tally();
      return;
    }
  }
  bool valid = false;
  const bool integer = with_integer_type(buffer.element_type(), [&]<typename T>() {
    valid = read_as_ints<T>(buffer.untyped_data(), n, owned_);
  });
  if (!integer || !valid) owned_.assign(n, 0);  // refused: none at all
  values_ = owned_;
  tally();
  if (!integer)
    refuse(std::string("must be integers, not ") + dtype_name(buffer.element_type()));
  else if (!valid)
    refuse("must be counts of rows, from 0 to 2^31 - 1");
}

Counts::Counts(std::vector<int> values, int64_t members, int64_t per_member)
    : Counts(members, per_member) {
  owned_ = std::move(values);
  values_ = owned_;
  tally();
}

Counts::Counts(Viewed, std::span<const int> values, int64_t members, int64_t per_member)
    : Counts(members, per_member) {
  values_ = values;
  tally();
}

void Counts::within(int64_t rows) {
  if (!valid() || most_ <= rows) return;
  for (int64_t b = 0; b < members_; ++b) {
    if (rows_in(member(b)) > rows) {
      asked_owned_.assign(values_.begin(), values_.end());
      asked_ = asked_owned_;
      owned_.assign(values_.size(), 0);
      std::string why = "add up to more than x's " + std::to_string(rows) + " rows";
      if (members_ > 1) why += " (batch member " + std::to_string(b) + ")";
      // The values passed are shown by refuse; they are zeros from here on.
      refuse(why);
      values_ = owned_;
      tally();
      return;
    }
  }
}

Counts Counts::repeated(int64_t peers) const {
  std::vector<int> values;
  values.reserve(static_cast<size_t>(members_ * peers));
  for (int64_t b = 0; b < members_; ++b)
    values.insert(values.end(), static_cast<size_t>(peers), member(b)[0]);
  Counts each(std::move(values), members_, peers);
  each.error_ = error_;
  return each;
}

void Counts::tally() {
  total_ = rows_in(values_);
  most_ = total_;  // one member's
  if (members_ == 1) return;
  most_ = 0;
  for (int64_t b = 0; b < members_; ++b) most_ = std::max(most_, rows_in(member(b)));
}

void Counts::refuse(const std::string& why) {
  std::string passed = "?";
  if (buffer_ != nullptr)
    with_integer_type(buffer_->element_type(), [&]<typename T>() {
      passed = text_of(
          std::span{static_cast<const T*>(buffer_->untyped_data()), buffer_->element_count()});
    });
  error_ = std::string(name_) + "=" + passed + " " + why;
}

}  // namespace jaxcomm::mpi
