// What happens around every MPI operation a jaxcomm handler makes, whatever the
// backend: the call counter, checking mode (ranks agree on a fingerprint of each
// collective; senders describe each message to its receiver), the JAXCOMM_DEBUG
// log and the JAXCOMM_TIMEOUT watchdog.
#ifndef JAXCOMM_CALL_H_
#define JAXCOMM_CALL_H_

#include <mpi.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "jaxcomm/jaxcomm.h"
#include "lockstep.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm {

namespace mpi {
struct Neighborhood;  // collectives.h
}

// JAXCOMM_DEBUG and JAXCOMM_TIMEOUT (seconds; 0: no watchdog), as jaxcomm._settings
// read them at import.
void configure(bool debug, double timeout);

// The communicators that jaxcomm's operations may use, by key. Compiled code
// holds a key, not the MPI handle: a freed communicator's key is gone, and MPI
// may hand its handle to the next communicator made. Keys are never reused.
// A Cartesian or graph communicator's neighbours are asked of MPI here, once:
// they never change while it lives, and a neighbour exchange would otherwise
// ask on every call.
void register_comm(int64_t key, int64_t handle);
void unregister_comm(int64_t key);

// MPI operations started by handlers so far in this process.
uint64_t call_count();

// A look at a pending `operation` found it `done`, or not; the watchdog's report
// says "<before> <operation> <after>" ("polling irecv with test()"). A rank that
// only looks at requests, making no other call, for the watchdog's time waits
// in them as in a blocking wait: the watchdog reports it (JAXCOMM_TIMEOUT). Any
// call the rank makes meanwhile, or a look that finds its request done,
// restarts that. Without the watchdog, it returns at once.
void polled(std::string_view before, std::string_view operation, std::string_view after, bool done);

// The name of a reduction operator, as jaxcomm._datatypes.ReduceOp's in lower case:
// "sum", "prod", ...; "?" otherwise.
const char* reduce_op_name(int32_t op);

// NumPy's name of an XLA dtype: "float32", "bfloat16", ...; "unsupported" otherwise.
const char* dtype_name(ffi::DataType dtype);

// "float32[3,4]"
std::string describe_array(ffi::DataType dtype, ffi::Span<const int64_t> dims);

// The operation this thread is running, as the table in operations.h names it: set on
// entry by the wrapper that calls a host function (a CPU or CUDA handler, an eager
// call), for Call, the log and error messages. Per thread: XLA may run handlers
// on several.
class Entered {
 public:
  explicit Entered(std::string_view operation);
  ~Entered();
  Entered(const Entered&) = delete;
  Entered& operator=(const Entered&) = delete;

 private:
  std::string_view outer_;
};
std::string_view current_operation();
// This thread's notes of the operation it runs (lockstep.h), cleared on entry.
Notes& notes();

// One operation, from its handler's entry to its return.
class Call {
 public:
  // `comm_key` is the communicator's key (register_comm). `data` is the op's
  // data (its input, or for scatter and recv its output), described in the log,
  // the fingerprint and the watchdog's report.
  Call(int64_t comm_key, bool check, const ffi::AnyBuffer& data);
  Call(int64_t comm_key, bool check);  // no data: barrier
  ~Call();
  Call(const Call&) = delete;
  Call& operator=(const Call&) = delete;

  MPI_Comm comm() const { return comm_; }
  // The communicator's neighbours into `*found` (valid while this Call lives), or
  // an error naming the operation if it has no Cartesian or distributed-graph
  // topology.
  ffi::Error neighborhood(const mpi::Neighborhood** found) const;
  std::string_view operation() const { return operation_; }
  bool checking() const { return check_; }

  // A parameter that must agree across ranks (root, reduction op), for the log
  // and the fingerprint; the op comes first. Returns *this for chaining. Made
  // into text only where it is recorded: each call pays for the test alone.
  Call& param(std::string_view name, int64_t value) {
    return recording_ ? record(name, std::to_string(value)) : *this;
  }
  Call& param(std::string_view name, std::string_view value) {
    return recording_ ? record(name, value) : *this;
  }
  Call& param(std::string_view name, ffi::DataType dtype) {  // by NumPy's name
    return recording_ ? record(name, dtype_name(dtype)) : *this;
  }
  Call& reduce_op(int32_t op);
  // The data's leading axis counts blocks, which ranks may have different
  // numbers of (a graph's neighbour exchange): the fingerprint and the log
  // describe it as "*". Returns *this.
  Call& per_block();
  // A peer of a point-to-point call: for the log only.
  Call& peer(std::string_view name, int64_t value);

  // An error if the communicator has been freed (its key is not registered): a
  // function compiled with it was called after JaxComm.free(). agree() and the
  // header functions below start with it.
  ffi::Error live() const;

  // Checking mode, collectives: every rank's fingerprint of this call must match;
  // if not, each rank gets the same error naming two ranks that differ.
  ffi::Error agree();

  // Checking mode, point to point: a header describing each message goes ahead of
  // it to the receiver, which compares it with its own buffer.
  struct MessageHeader {
    char magic[8];  // "jaxcomm"
    int32_t dtype;
    int32_t pieces;  // messages that follow (more than one beyond 2^31 elements)
    int64_t count;
    char array[96];  // the sender's describe_array
  };
  ffi::Error send_header(int dest, int tag, int64_t pieces);
  // The same without blocking, for isend (a blocking send of the header to this
  // rank itself would wait for its receive): appends the request, if any, to
  // `requests`; `*header` must stay alive until it completes.
  ffi::Error post_header(int dest, int tag, int64_t pieces, MessageHeader* header,
                         std::vector<MPI_Request>* requests);
  // Receives the header for a message from (source, tag); updates them to the
  // actual sender and tag. On a dtype or size mismatch the sender's data is
  // drained (so the sender does not hang) and the error names both sides.
  ffi::Error recv_header(int* source, int* tag, ffi::DataType dtype, ffi::Span<const int64_t> dims);
  // Both at once, for sendrecv. On a mismatch *matches is false and the caller
  // sends its own data (its peer waits for it) and then calls mismatch().
  ffi::Error sendrecv_header(int dest, int sendtag, int64_t send_pieces, int* source, int* recvtag,
                             ffi::DataType dtype, ffi::Span<const int64_t> dims, bool* matches);
  // Drains the data announced by the last header received and returns the error
  // that names both sides.
  ffi::Error mismatch(int source, int tag);

  std::string description() const;

  // Non-blocking receives in checking mode: `header` arrived with `status`
  // (received alongside the data); an error if it does not describe the buffer.
  ffi::Error check_received(const MessageHeader& header, const MPI_Status& status,
                            ffi::DataType dtype, ffi::Span<const int64_t> dims);

 private:
  Call& record(std::string_view name, std::string_view value);  // a param
  ffi::Error mismatch_error(int source, int tag) const;
  MessageHeader make_header(int64_t pieces) const;
  void show_watchdog() const;  // what the watchdog reports if this call hangs
  ffi::Error check_header(const MPI_Status& status) const;
  bool header_matches(ffi::DataType dtype, ffi::Span<const int64_t> dims);

  MessageHeader incoming_{};
  std::string receiving_;  // describe_array of the receive buffer

  MPI_Comm comm_;
  std::shared_ptr<const mpi::Neighborhood> neighborhood_;  // as registered; null: none
  bool check_;
  bool recording_;  // params: checking mode, the log or the watchdog
  std::string_view operation_;
  bool has_array_ = false;
  bool per_block_ = false;
  ffi::DataType dtype_{};
  ffi::Span<const int64_t> dims_{};
  std::string params_;  // ", root=0, op=sum"; the log adds peers
  std::string peers_;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace jaxcomm

#endif  // JAXCOMM_CALL_H_
