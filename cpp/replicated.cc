// Checking mode's test behind the gradient convention: is a cotangent identical
// on every rank? The transposes of operations whose result is replicated
// (allreduce, bcast, allgather) call it when checking mode is on.
#include "replicated.h"

#include <mpi.h>

#include <cmath>
#include <complex>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "call.h"
#include "jaxcomm/jaxcomm.h"
#include "lockstep.h"
#include "memory.h"

namespace jaxcomm::mpi {

namespace {

// Values as doubles; a complex number is compared as its two parts.
template <typename T>
double as_double(T v) {
  return static_cast<double>(v);
}
double as_double(Float16Bits h) { return half::f16_to_float(h.bits); }
double as_double(Bfloat16Bits h) { return half::bf16_to_float(h.bits); }

template <typename T>
struct Part {
  using type = T;
};
template <typename R>
struct Part<std::complex<R>> {
  using type = R;
};

struct Difference {
  double largest = 0.0;
  int64_t where = -1;  // in parts: complex elements count twice
};

// Where x differs most from rank 0's copy (equal NaNs are no difference).
template <typename P>
Difference largest_difference(const P* mine, const P* first, int64_t n) {
  Difference d;
  for (int64_t i = 0; i < n; ++i) {
    const double a = as_double(mine[i]), b = as_double(first[i]);
    if (a == b || (std::isnan(a) && std::isnan(b))) continue;
    const double gap = std::isnan(a - b) ? INFINITY : std::fabs(a - b);
    if (d.where < 0 || gap > d.largest) d = {gap, i};
  }
  if (d.where >= 0 && d.largest == 0.0) d.largest = INFINITY;
  return d;
}

}  // namespace

ffi::Error CheckReplicated(Token, Buffer x, TokenOut, Result out, int64_t comm_key, bool check,
                           std::string_view operation) {
  Call call(comm_key, check, x);
  if (auto err = call.live(); err.failure()) return err;
  MPI_Comm comm = call.comm();
  copy_if_distinct(out, x);
  std::vector<char> first(x.size_bytes());
  std::memcpy(first.data(), bytes(x), first.size());
  JAXCOMM_CHECK_MPI(for_each_piece(static_cast<int64_t>(first.size()),
                                   [&](int64_t offset, int piece) {
                                     return MPI_Bcast(first.data() + offset, piece, MPI_BYTE, 0,
                                                      comm);
                                   }),
                    "check", comm);
  Difference mine;
  int parts_per_element = 1;
  visit_dtype(x.element_type(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    using P = typename Part<T>::type;
    parts_per_element = sizeof(T) / sizeof(P);
    mine = largest_difference(reinterpret_cast<const P*>(bytes(x)),
                              reinterpret_cast<const P*>(first.data()),
                              x.element_count() * parts_per_element);
  });
  struct {
    double difference;
    int rank;
  } local{mine.largest, comm_rank(comm)}, worst{};
  JAXCOMM_CHECK_MPI(MPI_Allreduce(&local, &worst, 1, MPI_DOUBLE_INT, MPI_MAXLOC, comm), "check",
                    comm);
  if (worst.difference == 0.0) return ffi::Error::Success();
  std::string message =
      "jaxcomm check: the cotangent reaching the transpose of " + std::string(operation) +
      " is not identical on every rank (largest difference from rank 0: " +
      std::to_string(worst.difference) + ", on rank " + std::to_string(worst.rank);
  if (mine.where >= 0 && worst.rank == local.rank)
    message += ", at flat index " + std::to_string(mine.where / parts_per_element);
  message +=
      "). Its result is treated as one replicated value; mark a replicated value that "
      "feeds rank-dependent code with comm.pvary(x).";
  return on_every_rank(ffi::Error(ffi::ErrorCode::kFailedPrecondition, message));
}

}  // namespace jaxcomm::mpi
