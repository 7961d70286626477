#include "datatypes.h"

#include <complex>
#include <cstring>
#include <limits>
#include <type_traits>

#include "memory.h"

namespace jaxcomm::mpi {
namespace {

// One element holding the identity of a reduction.
struct Element {
  alignas(16) unsigned char bytes[16] = {};
  size_t width = 1;
};

template <typename T>
Element element(T value) {
  static_assert(sizeof(T) <= sizeof(Element::bytes));
  Element e;
  std::memcpy(e.bytes, &value, sizeof value);
  e.width = sizeof value;
  return e;
}

template <typename T>
T identity_as(ReduceOp op) {
  switch (op) {
    case ReduceOp::kProd:
    case ReduceOp::kLand:
      return T(1);
    case ReduceOp::kBand:
      if constexpr (std::is_integral_v<T>) return static_cast<T>(~T(0));
      break;
    case ReduceOp::kMax:
      if constexpr (std::is_floating_point_v<T>) return -std::numeric_limits<T>::infinity();
      if constexpr (std::is_integral_v<T>) return std::numeric_limits<T>::lowest();
      break;
    case ReduceOp::kMin:
      if constexpr (std::is_floating_point_v<T>) return std::numeric_limits<T>::infinity();
      if constexpr (std::is_integral_v<T>) return std::numeric_limits<T>::max();
      break;
    default:
      break;
  }
  return T(0);
}

template <typename T>
constexpr bool is_complex = false;
template <typename T>
constexpr bool is_complex<std::complex<T>> = true;

Element identity(ffi::DataType dtype, ReduceOp op) {
  Element e;
  visit_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if constexpr (std::is_same_v<T, bool>) {
      e = element<bool>(op == ReduceOp::kLand || op == ReduceOp::kBand || op == ReduceOp::kMin);
    } else if constexpr (std::is_same_v<T, Float16Bits>) {
      e = element(half::float_to_f16(identity_as<float>(op)));
    } else if constexpr (std::is_same_v<T, Bfloat16Bits>) {
      e = element(half::float_to_bf16(identity_as<float>(op)));
    } else if constexpr (is_complex<T>) {
      e = element(T(op == ReduceOp::kProd ? 1 : 0));
    } else {
      e = element(identity_as<T>(op));
    }
  });
  return e;
}

template <typename T>
void to_truth(void* out, int64_t n) {
  T* p = static_cast<T*>(out);
  for (int64_t i = 0; i < n; ++i) p[i] = p[i] != 0;
}

void to_truth(void* out, int64_t n, size_t width) {
  switch (width) {
    case 1:
      return to_truth<uint8_t>(out, n);
    case 2:
      return to_truth<uint16_t>(out, n);
    case 4:
      return to_truth<uint32_t>(out, n);
    default:
      return to_truth<uint64_t>(out, n);
  }
}

bool is_integer(ffi::DataType dtype) {
  using D = ffi::DataType;
  for (D integer : {D::S8, D::S16, D::S32, D::S64, D::U8, D::U16, D::U32, D::U64})
    if (dtype == integer) return true;
  return false;
}

}  // namespace

ffi::Error datatype_of(const ffi::AnyBuffer& x, std::string_view operation, MPI_Datatype* type) {
  *type = mpi_datatype(x.element_type());
  if (*type == MPI_DATATYPE_NULL) return invalid_argument(operation, "unsupported dtype");
  return ffi::Error::Success();
}

ffi::Error reduction_of(const ffi::AnyBuffer& x, int32_t reduce_op, std::string_view operation,
                        MPI_Datatype* type, MPI_Op* mpi_operator) {
  if (auto err = datatype_of(x, operation, type); err.failure()) return err;
  *mpi_operator = mpi_op(static_cast<ReduceOp>(reduce_op), x.element_type());
  if (*mpi_operator == MPI_OP_NULL)
    return invalid_argument(operation, "reduction not supported for this dtype");
  return ffi::Error::Success();
}

void fill_identity(ffi::Result<ffi::AnyBuffer>& out, int32_t reduce_op) {
  const Element e = identity(out->element_type(), static_cast<ReduceOp>(reduce_op));
  memory().fill(out->untyped_data(), e.bytes, e.width,
                static_cast<int64_t>(out->size_bytes() / e.width));
}

void normalize_logical(ffi::Result<ffi::AnyBuffer>& out, int32_t reduce_op) {
  normalize_logical(out->untyped_data(), out->element_type(), out->element_count(), reduce_op);
}

void normalize_logical(void* data, ffi::DataType dtype, int64_t count, int32_t reduce_op) {
  const auto op = static_cast<ReduceOp>(reduce_op);
  if (op != ReduceOp::kLand && op != ReduceOp::kLor && op != ReduceOp::kLxor) return;
  if (!is_integer(dtype)) return;
  const size_t width = ffi::ByteWidth(dtype);
  memory().edit(data, static_cast<size_t>(count) * width,
                [&](void* bytes) { to_truth(bytes, count, width); });
}

}  // namespace jaxcomm::mpi
