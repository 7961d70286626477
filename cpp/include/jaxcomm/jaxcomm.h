// jaxcomm.h: helpers for XLA FFI kernels that call MPI on a jaxcomm communicator.
//
// jaxcomm's own handlers are written with these helpers, and so can a JaxComm
// subclass's custom kernels (see the "Extending JaxComm" docs page). Header-only;
// needs <mpi.h> and the XLA FFI headers (jax.ffi.include_dir()) on the include path.
#ifndef JAXCOMM_JAXCOMM_H_
#define JAXCOMM_JAXCOMM_H_

#include <mpi.h>

#include <algorithm>
#include <climits>
#include <complex>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <limits>
#include <mutex>
#include <string>
#include <string_view>
#include <type_traits>

#include "xla/ffi/api/ffi.h"

namespace jaxcomm {

namespace ffi = xla::ffi;

// The communicator arrives as the integer handle that mpi4py reports
// (MPI._handleof): an int for MPICH-ABI libraries, a pointer for Open MPI.
template <typename Handle = MPI_Comm>
inline Handle comm_from_handle(int64_t handle) {
  if constexpr (std::is_pointer_v<Handle>) {
    return reinterpret_cast<Handle>(static_cast<intptr_t>(handle));
  } else {
    return static_cast<Handle>(handle);
  }
}

inline int comm_rank(MPI_Comm comm) {
  int rank = -1;
  MPI_Comm_rank(comm, &rank);
  return rank;
}

// Turns an MPI return code into an FFI error naming the operation, the rank and
// MPI's own message; MPI_SUCCESS becomes ffi::Error::Success().
inline ffi::Error check_mpi(int code, std::string_view operation, MPI_Comm comm) {
  if (code == MPI_SUCCESS) return ffi::Error::Success();
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) {
    length = std::snprintf(text, sizeof text, "MPI error code %d", code);
  }
  std::string message = "jaxcomm: MPI error in ";
  message.append(operation).append(" on rank ").append(std::to_string(comm_rank(comm)));
  message.append(": ").append(text, static_cast<size_t>(length));
  int error_class = MPI_SUCCESS;
  if (MPI_Error_class(code, &error_class) == MPI_SUCCESS && error_class == MPI_ERR_TRUNCATE) {
    // The usual cause inside jaxcomm: a receive's template that vmap did not
    // batch (it is a constant) while the data sent is batched.
    message.append(
        "\nThe message is larger than the receive's template, whose shape and dtype "
        "give the result's. Under vmap a template that does not depend on the batched "
        "input (jnp.zeros_like(x) is a constant) is not batched: receive into a "
        "batched array such as x itself.");
  }
  return ffi::Error(ffi::ErrorCode::kInternal, std::move(message));
}

inline ffi::Error invalid_argument(std::string_view operation, std::string_view what) {
  std::string message = "jaxcomm: ";
  message.append(operation).append(": ").append(what);
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, std::move(message));
}

// Propagates a failed MPI call out of a handler.
#define JAXCOMM_CHECK_MPI(call, operation, comm)                                            \
  do {                                                                                      \
    if (::xla::ffi::Error jaxcomm_err_ = ::jaxcomm::check_mpi((call), (operation), (comm)); \
        jaxcomm_err_.failure())                                                             \
      return jaxcomm_err_;                                                                  \
  } while (0)

// Reduction operators, numbered as in jaxcomm._datatypes.ReduceOp.
enum class ReduceOp : int32_t {
  kSum = 0,
  kProd,
  kMax,
  kMin,
  kLand,
  kLor,
  kLxor,
  kBand,
  kBor,
  kBxor
};

// ---------------------------------------------------------------------------
// 16-bit floats. MPI has no float16/bfloat16 types, so they travel as 16-bit
// integers and reduce through user-defined operators that compute in float.

namespace half {

// The bits of `from` as a `To`: std::bit_cast, which needs C++20.
template <typename To, typename From>
inline To bits_as(From from) {
  static_assert(sizeof(To) == sizeof(From));
  To to;
  std::memcpy(&to, &from, sizeof to);
  return to;
}

inline float bf16_to_float(uint16_t bits) {
  return bits_as<float>(static_cast<uint32_t>(bits) << 16);
}

inline uint16_t float_to_bf16(float value) {
  uint32_t word = bits_as<uint32_t>(value);
  if ((word & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((word >> 16) | 0x40);
  word += 0x7fffu + ((word >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(word >> 16);
}

inline float f16_to_float(uint16_t bits) {
  uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  uint32_t exponent = (bits >> 10) & 0x1fu;
  uint32_t mantissa = bits & 0x3ffu;
  uint32_t word;
  if (exponent == 0x1f) {
    word = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {
    word = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    word = sign;
  } else {  // subnormal: normalise
    int shift = 0;
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      ++shift;
    }
    word = sign | (static_cast<uint32_t>(113 - shift) << 23) | ((mantissa & 0x3ffu) << 13);
  }
  return bits_as<float>(word);
}

inline uint16_t float_to_f16(float value) {
  uint32_t word = bits_as<uint32_t>(value);
  uint16_t sign = static_cast<uint16_t>((word >> 16) & 0x8000u);
  uint32_t magnitude = word & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return sign | 0x7e00u;   // NaN
  if (magnitude >= 0x477ff000u) return sign | 0x7c00u;  // overflow to inf
  if (magnitude < 0x38800000u) {                        // subnormal or zero
    if (magnitude < 0x33000000u) return sign;
    uint32_t exponent = magnitude >> 23;
    uint32_t mantissa = (magnitude & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126 - exponent;  // 14..24
    uint32_t result = mantissa >> shift;
    uint32_t rest = mantissa & ((1u << shift) - 1);
    uint32_t halfway = 1u << (shift - 1);
    if (rest > halfway || (rest == halfway && (result & 1u))) ++result;
    return sign | static_cast<uint16_t>(result);
  }
  uint32_t result = ((magnitude >> 13) - (112u << 10));
  uint32_t rest = magnitude & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (result & 1u))) ++result;
  return sign | static_cast<uint16_t>(result);
}

template <bool kBfloat>
inline float to_float(uint16_t bits) {
  return kBfloat ? bf16_to_float(bits) : f16_to_float(bits);
}
template <bool kBfloat>
inline uint16_t from_float(float v) {
  return kBfloat ? float_to_bf16(v) : float_to_f16(v);
}

template <bool kBfloat, ReduceOp kOp>
void reduce_fn(void* in, void* inout, int* len, MPI_Datatype*) {
  auto* a = static_cast<const uint16_t*>(in);
  auto* b = static_cast<uint16_t*>(inout);
  for (int i = 0; i < *len; ++i) {
    float x = to_float<kBfloat>(a[i]), y = to_float<kBfloat>(b[i]), r;
    if constexpr (kOp == ReduceOp::kSum)
      r = x + y;
    else if constexpr (kOp == ReduceOp::kProd)
      r = x * y;
    else if constexpr (kOp == ReduceOp::kMax)
      r = (x > y || x != x) ? x : y;
    else
      r = (x < y || x != x) ? x : y;
    b[i] = from_float<kBfloat>(r);
  }
}

// User-defined MPI operators for {float16, bfloat16} x {SUM, PROD, MAX, MIN},
// created on first use (after MPI_Init) and kept until MPI_Finalize.
inline MPI_Op op(bool bfloat, ReduceOp reduce_op) {
  static MPI_Op ops[2][4];
  static std::once_flag once;
  std::call_once(once, [] {
    MPI_Op_create(&reduce_fn<false, ReduceOp::kSum>, 1, &ops[0][0]);
    MPI_Op_create(&reduce_fn<false, ReduceOp::kProd>, 1, &ops[0][1]);
    MPI_Op_create(&reduce_fn<false, ReduceOp::kMax>, 1, &ops[0][2]);
    MPI_Op_create(&reduce_fn<false, ReduceOp::kMin>, 1, &ops[0][3]);
    MPI_Op_create(&reduce_fn<true, ReduceOp::kSum>, 1, &ops[1][0]);
    MPI_Op_create(&reduce_fn<true, ReduceOp::kProd>, 1, &ops[1][1]);
    MPI_Op_create(&reduce_fn<true, ReduceOp::kMax>, 1, &ops[1][2]);
    MPI_Op_create(&reduce_fn<true, ReduceOp::kMin>, 1, &ops[1][3]);
  });
  int index = static_cast<int>(reduce_op);
  return index < 4 ? ops[bfloat ? 1 : 0][index] : MPI_OP_NULL;
}

}  // namespace half

// Storage of the 16-bit float dtypes: distinct types, so code that dispatches on
// the storage type (visit_dtype) tells them apart from uint16 and each other.
struct Float16Bits {
  uint16_t bits;
};
struct Bfloat16Bits {
  uint16_t bits;
};

// X(dtype, storage type, name, MPI datatype) for every dtype jaxcomm carries.
// 16-bit floats travel as 16-bit words and reduce with jaxcomm's own operators.
#define JAXCOMM_DTYPES(X)                                       \
  X(PRED, bool, "bool", MPI_C_BOOL)                             \
  JAXCOMM_INTEGERS(X, 8)                                        \
  JAXCOMM_INTEGERS(X, 16)                                       \
  JAXCOMM_INTEGERS(X, 32)                                       \
  JAXCOMM_INTEGERS(X, 64)                                       \
  X(F16, Float16Bits, "float16", MPI_UINT16_T)                  \
  X(BF16, Bfloat16Bits, "bfloat16", MPI_UINT16_T)               \
  X(F32, float, "float32", MPI_FLOAT)                           \
  X(F64, double, "float64", MPI_DOUBLE)                         \
  X(C64, std::complex<float>, "complex64", MPI_C_FLOAT_COMPLEX) \
  X(C128, std::complex<double>, "complex128", MPI_C_DOUBLE_COMPLEX)

// The signed and unsigned integers of `bits` bits: XLA, C, NumPy and MPI name
// them alike.
#define JAXCOMM_INTEGERS(X, bits)                           \
  X(S##bits, int##bits##_t, "int" #bits, MPI_INT##bits##_T) \
  X(U##bits, uint##bits##_t, "uint" #bits, MPI_UINT##bits##_T)

// What jaxcomm knows of an XLA dtype: NumPy's name for it and the MPI datatype
// that carries its elements.
struct DtypeInfo {
  ffi::DataType dtype;
  const char* name;
  MPI_Datatype mpi;
};

// The DtypeInfo of `dtype`; {dtype, "unsupported", MPI_DATATYPE_NULL} if jaxcomm
// does not carry it.
inline DtypeInfo dtype_info(ffi::DataType dtype) {
#define JAXCOMM_DTYPE_INFO(name, storage, text, mpi) DtypeInfo{ffi::DataType::name, text, mpi},
  static const DtypeInfo known[] = {JAXCOMM_DTYPES(JAXCOMM_DTYPE_INFO)};
#undef JAXCOMM_DTYPE_INFO
  for (const DtypeInfo& info : known)
    if (info.dtype == dtype) return info;
  return {dtype, "unsupported", MPI_DATATYPE_NULL};
}

// The MPI datatype that carries elements of an XLA dtype, or MPI_DATATYPE_NULL.
inline MPI_Datatype mpi_datatype(ffi::DataType dtype) { return dtype_info(dtype).mpi; }

template <typename T>
struct TypeTag {
  using type = T;
};

// Calls fn(TypeTag<storage type>{}) for dtype; false if jaxcomm does not carry it.
template <typename Fn>
bool visit_dtype(ffi::DataType dtype, Fn&& fn) {
  switch (dtype) {
#define JAXCOMM_VISIT_DTYPE(name, storage, text, mpi) \
  case ffi::DataType::name:                           \
    fn(TypeTag<storage>{});                           \
    return true;
    JAXCOMM_DTYPES(JAXCOMM_VISIT_DTYPE)
#undef JAXCOMM_VISIT_DTYPE
    default:
      return false;
  }
}

// The MPI operator that reduces `dtype` with `op`, or MPI_OP_NULL when the pair
// is not supported (jaxcomm's Python layer rejects those before tracing).
inline MPI_Op mpi_op(ReduceOp op, ffi::DataType dtype) {
  if (dtype == ffi::DataType::F16 || dtype == ffi::DataType::BF16) {
    return half::op(dtype == ffi::DataType::BF16, op);
  }
  // By ReduceOp. bool reduces with the logical operators (MAX is OR, MIN is AND).
  static const MPI_Op ops[] = {MPI_SUM, MPI_PROD, MPI_MAX,  MPI_MIN, MPI_LAND,
                               MPI_LOR, MPI_LXOR, MPI_BAND, MPI_BOR, MPI_BXOR};
  static const MPI_Op logical[] = {MPI_OP_NULL, MPI_OP_NULL, MPI_LOR,  MPI_LAND, MPI_LAND,
                                   MPI_LOR,     MPI_LXOR,    MPI_LAND, MPI_LOR,  MPI_LXOR};
  static_assert(std::size(ops) == static_cast<size_t>(ReduceOp::kBxor) + 1);
  static_assert(std::size(logical) == std::size(ops));
  const auto index = static_cast<size_t>(op);
  if (index >= std::size(ops)) return MPI_OP_NULL;
  return dtype == ffi::DataType::PRED ? logical[index] : ops[index];
}

// ---------------------------------------------------------------------------
// Large messages. MPI counts are ints; a message of more than INT_MAX elements
// is either split into pieces (element-wise operations) or described by one
// derived datatype (block collectives), so nothing is ever truncated.

inline constexpr int64_t kMaxCount = INT_MAX;

// Calls fn(offset, count) for consecutive pieces of at most kMaxCount elements.
// Zero elements still make one call, so every rank takes part in collectives.
template <typename Fn>
int for_each_piece(int64_t count, Fn&& fn) {
  int64_t offset = 0;
  do {
    int piece = static_cast<int>(std::min<int64_t>(count - offset, kMaxCount));
    if (int code = fn(offset, piece); code != MPI_SUCCESS) return code;
    offset += piece;
  } while (offset < count);
  return MPI_SUCCESS;
}

// A (count, datatype) pair describing `elements` elements of `base`: the base type
// itself when the count fits in an int, otherwise one committed derived type.
class Block {
 public:
  Block(int64_t elements, MPI_Datatype base) : type_(base) {
    if (elements <= kMaxCount) {
      count_ = static_cast<int>(elements);
      return;
    }
    MPI_Aint lb, extent;
    MPI_Type_get_extent(base, &lb, &extent);
    int64_t pieces = elements / kMaxCount, rest = elements % kMaxCount;
    MPI_Datatype chunk, body;
    MPI_Type_contiguous(static_cast<int>(kMaxCount), base, &chunk);
    MPI_Type_contiguous(static_cast<int>(pieces), chunk, &body);
    MPI_Type_free(&chunk);
    if (rest == 0) {
      type_ = body;
    } else {
      int lengths[2] = {1, static_cast<int>(rest)};
      MPI_Aint offsets[2] = {0, static_cast<MPI_Aint>(pieces * kMaxCount * extent)};
      MPI_Datatype types[2] = {body, base};
      MPI_Datatype joined;
      MPI_Type_create_struct(2, lengths, offsets, types, &joined);
      MPI_Type_free(&body);
      MPI_Type_create_resized(joined, 0, static_cast<MPI_Aint>(elements * extent), &type_);
      MPI_Type_free(&joined);
    }
    MPI_Type_commit(&type_);
    owned_ = true;
    count_ = 1;
  }
  ~Block() {
    if (owned_) MPI_Type_free(&type_);
  }
  Block(const Block&) = delete;
  Block& operator=(const Block&) = delete;

  int count() const { return count_; }
  MPI_Datatype type() const { return type_; }

 private:
  MPI_Datatype type_;
  int count_ = 0;
  bool owned_ = false;
};

}  // namespace jaxcomm

#endif  // JAXCOMM_JAXCOMM_H_
