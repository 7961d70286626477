// The MPI datatype and operator behind each jaxcomm dtype and reduction, and what
// jaxcomm adds to MPI's reductions: results split into int-sized pieces, the
// identity that exscan gives rank 0, and logical results that are always 0 or 1.
#ifndef JAXCOMM_DATATYPES_H_
#define JAXCOMM_DATATYPES_H_

#include <mpi.h>

#include <cstdint>
#include <string_view>

#include "jaxcomm/jaxcomm.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::mpi {

// The MPI datatype of x's elements, or an error naming `operation`.
ffi::Error datatype_of(const ffi::AnyBuffer& x, std::string_view operation, MPI_Datatype* type);

// The MPI datatype and operator that reduce x with jaxcomm's `reduce_op`.
ffi::Error reduction_of(const ffi::AnyBuffer& x, int32_t reduce_op, std::string_view operation,
                        MPI_Datatype* type, MPI_Op* mpi_operator);

// Element-wise reduction of `count` elements in pieces that fit an int count:
// call(in, out, n) for each piece, with MPI_IN_PLACE for `in` when in == out.
template <typename Call>
int reduce_pieces(const void* in, void* out, int64_t count, MPI_Datatype type, Call&& call) {
  MPI_Aint lb, extent;
  MPI_Type_get_extent(type, &lb, &extent);
  const bool in_place = in == out;
  return for_each_piece(count, [&](int64_t offset, int piece) {
    char* o = static_cast<char*>(out) + offset * extent;
    const void* i = in_place ? MPI_IN_PLACE : static_cast<const char*>(in) + offset * extent;
    return call(i, o, piece);
  });
}

// Writes the identity of `reduce_op` (0 for SUM, 1 for PROD, the lowest value for
// MAX, ...) into every element of out: exscan's result on rank 0.
void fill_identity(ffi::Result<ffi::AnyBuffer>& out, int32_t reduce_op);

// MPI's logical operators on integers pass a lone operand through unchanged (one
// rank, scan on rank 0); jaxcomm's logical results are always 0 or 1.
void normalize_logical(ffi::Result<ffi::AnyBuffer>& out, int32_t reduce_op);
void normalize_logical(void* data, ffi::DataType dtype, int64_t count, int32_t reduce_op);

}  // namespace jaxcomm::mpi

#endif  // JAXCOMM_DATATYPES_H_
