// The count operands of the variable-size exchanges, read and validated in one
// place before any buffer is touched or MPI called. A count operand may have any
// integer dtype (a traced count keeps its own; NumPy counts arrive as they are).
// Each count is a number of rows from 0 to 2^31 - 1, the most that the int32
// counts an exchange returns can report.
#ifndef JAXCOMM_COUNTS_H_
#define JAXCOMM_COUNTS_H_

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "binding.h"

namespace jaxcomm::mpi {

// The counts of argument `name`: `members` rows of `per_member` counts each
// (members > 1 under vmap). Counts that are not all valid read as zeros (this rank
// sends or receives none), and error() names the argument and what was passed.
class Counts {
 public:
  Counts(const Buffer& buffer, std::string_view name, int64_t members, int64_t per_member);
  // Counts known already (exchanged between the ranks): valid.
  Counts(std::vector<int> values, int64_t members, int64_t per_member);
  // Valid counts that live elsewhere, unchanged, as long as this object; made in
  // place (std::optional's emplace) with Viewed{} first.
  struct Viewed {};
  Counts(Viewed, std::span<const int> values, int64_t members, int64_t per_member);
  static Counts view(std::span<const int> values, int64_t members, int64_t per_member) {
    return Counts(Viewed{}, values, members, per_member);
  }
  Counts(Counts&&) = default;
  Counts& operator=(Counts&&) = default;
  Counts(const Counts&) = delete;  // values_ may point into owned_
  Counts& operator=(const Counts&) = delete;

  // Refuses the counts unless each member's add up to at most `rows`. Counts
  // refused only for that are still `asked()`: an adjoint's exchange sends them,
  // its rows then zeros (variable_size.cc, pads).
  void within(int64_t rows);
  std::span<const int> asked() const { return asked_; }
  // One count per member (per_member() 1) as the counts of `peers` peers that
  // each got it: zeros, and this error, where it was refused.
  Counts repeated(int64_t peers) const;

  bool valid() const { return error_.empty(); }
  const std::string& error() const { return error_; }
  std::span<const int> values() const { return values_; }
  // Member b's counts (one per peer).
  std::span<const int> member(int64_t b) const {
    return values_.subspan(static_cast<size_t>(b * per_member_), static_cast<size_t>(per_member_));
  }
  int64_t members() const { return members_; }
  int64_t per_member() const { return per_member_; }
  // The most rows of any member, and the rows of all members.
  int64_t most() const { return most_; }
  int64_t total() const { return total_; }

 private:
  Counts(int64_t members, int64_t per_member) : members_(members), per_member_(per_member) {}
  void refuse(const std::string& why);
  // Adds up most_ and total_ once the values are set: a call asks for them
  // several times (whether rows fit, where the result's zeros start, ...).
  void tally();

  const Buffer* buffer_ = nullptr;  // as passed, for the error message
  std::string_view name_;
  int64_t members_, per_member_;
  std::span<const int> values_;  // the buffer's own int32 values where valid, or owned_
  std::vector<int> owned_;
  int64_t most_ = 0, total_ = 0;
  std::span<const int> asked_;  // counts refused for adding up to too many rows
  std::vector<int> asked_owned_;
  std::string error_;
};

// "[1, 2, 3]"
std::string counts_text(std::span<const int> counts);

}  // namespace jaxcomm::mpi

#endif  // JAXCOMM_COUNTS_H_
