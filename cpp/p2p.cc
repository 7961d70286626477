// The point-to-point handlers on host memory: send, recv and sendrecv (MPI's
// blocking calls inside XLA; polled on the Python thread). A receive from
// MPI_PROC_NULL gives zeros, so the output is always written; the status output
// holds the sender's rank and the tag.
#include "p2p.h"

#include <mpi.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "call.h"
#include "datatypes.h"
#include "jaxcomm/jaxcomm.h"
#include "memory.h"
#include "requests.h"

namespace jaxcomm::mpi {
namespace {

// Inside XLA these are MPI's own blocking calls, as a C program makes them. An
// eager call posts the message and polls it (wait_all), so that Ctrl-C ends the
// wait: its send goes from a copy that jaxcomm owns, which an interrupted send
// leaves to MPI as an orphan (requests.h; the message still leaves whole when
// its receiver takes it), and its receive is cancelled.
Pending sending(const void* data, int n, MPI_Datatype type) {
  int width = 0;
  MPI_Type_size(type, &width);
  Pending pending{current_operation()};
  pending.own_copy(data, static_cast<size_t>(n) * static_cast<size_t>(width));
  return pending;
}

int send(const void* data, int n, MPI_Datatype type, int dest, int tag, MPI_Comm comm) {
  if (!interruptible()) return MPI_Send(data, n, type, dest, tag, comm);
  Pending pending = sending(data, n, type);
  MPI_Request& request = pending.requests.emplace_back();
  const int code = MPI_Isend(pending.buffers[0].data(), n, type, dest, tag, comm, &request);
  if (code != MPI_SUCCESS) return code;
  MPI_Status status;
  return wait_all(1, &request, &status, true, [&] { orphan(std::move(pending)); });
}

int recv(void* data, int n, MPI_Datatype type, int source, int tag, MPI_Comm comm,
         MPI_Status* status) {
  if (!interruptible()) return MPI_Recv(data, n, type, source, tag, comm, status);
  MPI_Request request;
  const int code = MPI_Irecv(data, n, type, source, tag, comm, &request);
  return code == MPI_SUCCESS ? wait_all(1, &request, status) : code;
}

int sendrecv(const void* send_data, int send_n, MPI_Datatype send_type, int dest, int send_tag,
             void* recv_data, int recv_n, MPI_Datatype recv_type, int source, int recv_tag,
             MPI_Comm comm, MPI_Status* status) {
  if (!interruptible())
    return MPI_Sendrecv(send_data, send_n, send_type, dest, send_tag, recv_data, recv_n, recv_type,
                        source, recv_tag, comm, status);
  Pending sent = sending(send_data, send_n, send_type);
  MPI_Request requests[2];
  MPI_Status statuses[2];
  int code = MPI_Irecv(recv_data, recv_n, recv_type, source, recv_tag, comm, &requests[0]);
  if (code != MPI_SUCCESS) return code;
  code = MPI_Isend(sent.buffers[0].data(), send_n, send_type, dest, send_tag, comm, &requests[1]);
  if (code != MPI_SUCCESS) {
    abandon(&requests[0]);
    return code;
  }
  code = wait_all(2, requests, statuses, true, [&] {
    abandon(&requests[0]);
    sent.requests.push_back(requests[1]);
    orphan(std::move(sent));
  });
  *status = statuses[0];
  return code;
}

// Through memory(): with a CUDA-aware MPI the status buffer is on the device.
void write_status(Status& status, const MPI_Status& s) {
  const int32_t values[2] = {s.MPI_SOURCE, s.MPI_TAG};
  int32_t* to = status->typed_data();
  memory().fill(to, &values[0], sizeof values[0], 1);
  memory().fill(to + 1, &values[1], sizeof values[1], 1);
}

// A receive in pieces: later pieces come from the sender of the first, with its
// tag (a receive from MPI_ANY_SOURCE or MPI_ANY_TAG learns them from it), each
// piece must hold the count expected, and the status output is the first's.
class PieceReceiver {
 public:
  PieceReceiver(int source, int tag) : source_(source), tag_(tag) {}
  int source() const { return source_; }
  int tag() const { return tag_; }

  // Piece `step`, of `n` elements of `type`, ended with MPI's `code` and `s`.
  // Returns the code for for_each_piece.
  int arrived(int64_t step, int code, const MPI_Status& s, MPI_Datatype type, int n,
              std::string_view operation) {
    if (step == 0) {
      first_ = s;
      if (source_ != MPI_PROC_NULL) {
        source_ = s.MPI_SOURCE;
        tag_ = s.MPI_TAG;
      }
    }
    if (code == MPI_SUCCESS) count_error_ = check_count(s, type, n, operation);
    return count_error_.failure() ? MPI_ERR_OTHER : code;
  }

  // The receive's error, given for_each_piece's `result`; else writes the status.
  // A message received whole, in `one_step`, leaves its sender waiting for
  // nothing, whether or not it fits: its error is paired (lockstep.h).
  ffi::Error finish(int result, std::string_view operation, MPI_Comm comm, Status& status,
                    bool one_step) {
    if (count_error_.failure())
      return one_step ? paired(std::move(count_error_)) : std::move(count_error_);
    if (auto err = check_received(result, operation, comm, one_step); err.failure()) return err;
    write_status(status, first_);
    return ffi::Error::Success();
  }

 private:
  int source_, tag_;
  MPI_Status first_{};
  ffi::Error count_error_ = ffi::Error::Success();
};

}  // namespace

ffi::Error Send(Token, Buffer x, TokenOut, int64_t comm_key, bool check, int32_t dest,
                int32_t tag) {
  Call call(comm_key, check, x);
  call.peer("dest", dest).peer("tag", tag);
  MPI_Comm comm = call.comm();
  MPI_Datatype type;
  if (auto err = datatype_of(x, call.operation(), &type); err.failure()) return err;
  if (auto err = call.send_header(dest, tag, pieces(x.element_count())); err.failure()) return err;
  const size_t width = ffi::ByteWidth(x.element_type());
  JAXCOMM_CHECK_MPI(for_each_piece(x.element_count(),
                                   [&](int64_t offset, int n) {
                                     return send(bytes(x) + offset * width, n, type, dest, tag,
                                                 comm);
                                   }),
                    call.operation(), comm);
  return ffi::Error::Success();
}

ffi::Error Recv(Token, TokenOut, Result out, Status status, int64_t comm_key, bool check,
                int32_t source, int32_t tag) {
  Call call(comm_key, check, *out);
  call.peer("source", source).peer("tag", tag);
  MPI_Comm comm = call.comm();
  MPI_Datatype type = mpi_datatype(out->element_type());
  if (type == MPI_DATATYPE_NULL) return invalid_argument(call.operation(), "unsupported dtype");
  if (auto err = call.recv_header(&source, &tag, out->element_type(), out->dimensions());
      err.failure())
    return err;
  if (source == MPI_PROC_NULL) zero(out);
  const size_t width = ffi::ByteWidth(out->element_type());
  PieceReceiver receiver(source, tag);
  const int result = for_each_piece(out->element_count(), [&](int64_t offset, int n) {
    MPI_Status s{};
    const int code =
        recv(bytes(out) + offset * width, n, type, receiver.source(), receiver.tag(), comm, &s);
    return receiver.arrived(offset / kMaxCount, code, s, type, n, call.operation());
  });
  return receiver.finish(result, call.operation(), comm, status, pieces(out->element_count()) == 1);
}

ffi::Error Sendrecv(Token, Buffer x, TokenOut, Result out, Status status, int64_t comm_key,
                    bool check, int32_t source, int32_t dest, int32_t sendtag, int32_t recvtag) {
  Call call(comm_key, check, x);
  call.peer("source", source).peer("dest", dest);
  MPI_Comm comm = call.comm();
  MPI_Datatype send_type, recv_type = mpi_datatype(out->element_type());
  if (auto err = datatype_of(x, call.operation(), &send_type); err.failure()) return err;
  if (recv_type == MPI_DATATYPE_NULL)
    return invalid_argument(call.operation(), "unsupported dtype");
  const int64_t send_count = x.element_count(), recv_count = out->element_count();
  const size_t send_width = ffi::ByteWidth(x.element_type());
  const size_t recv_width = ffi::ByteWidth(out->element_type());
  bool matches = true;
  if (auto err = call.sendrecv_header(dest, sendtag, pieces(send_count), &source, &recvtag,
                                      out->element_type(), out->dimensions(), &matches);
      err.failure())
    return err;
  if (!matches) {
    // The peer still waits for our data: send it while draining theirs.
    std::vector<MPI_Request> requests;
    for_each_piece(send_count, [&](int64_t offset, int n) {
      requests.emplace_back();
      return MPI_Isend(bytes(x) + offset * send_width, n, send_type, dest, sendtag, comm,
                       &requests.back());
    });
    ffi::Error error = call.mismatch(source, recvtag);
    MPI_Waitall(static_cast<int>(requests.size()), requests.data(), MPI_STATUSES_IGNORE);
    return error;
  }
  if (source == MPI_PROC_NULL) zero(out);
  // Each side splits its own message into pieces of at most kMaxCount elements,
  // as its partner splits the matching one (the counts agree, or check_count
  // reports it). Step k sends piece k and receives piece k, where they exist: a
  // rank does not know how its destination's other messages are split, so it
  // sends nothing beyond its own pieces.
  const int64_t send_pieces = pieces(send_count), recv_pieces = pieces(recv_count);
  PieceReceiver receiver(source, recvtag);
  const int result = for_each_piece(std::max(send_count, recv_count), [&](int64_t offset, int n) {
    const int64_t step = offset / kMaxCount;
    const int to = step < send_pieces ? dest : MPI_PROC_NULL;
    const int from = step < recv_pieces ? receiver.source() : MPI_PROC_NULL;
    const int sn = static_cast<int>(std::clamp<int64_t>(send_count - offset, 0, n));
    const int rn = static_cast<int>(std::clamp<int64_t>(recv_count - offset, 0, n));
    MPI_Status s{};
    const int code =
        sendrecv(bytes(x) + offset * send_width, sn, send_type, to, sendtag,
                 bytes(out) + offset * recv_width, rn, recv_type, from, receiver.tag(), comm, &s);
    return receiver.arrived(step, code, s, recv_type, rn, call.operation());
  });
  return receiver.finish(result, call.operation(), comm, status,
                         std::max(send_pieces, recv_pieces) == 1);
}

// `tags` holds (sendtag, recvtag), computed at run time: the AD rules of receives
// from MPI_ANY_TAG pass the tag each message came with, so that its cotangent
// goes back with that tag and is paired with it (jaxcomm/_p2p.py).
ffi::Error TaggedSendrecv(Token token, Buffer x, Buffer tags, TokenOut token_out, Result out,
                          Status status, int64_t comm_key, bool check, int32_t source,
                          int32_t dest) {
  if (tags.element_type() != ffi::DataType::S32 || tags.element_count() != 2)
    return invalid_argument(current_operation(), "tags must be int32[2]");
  const auto* tag = static_cast<const int32_t*>(tags.untyped_data());
  // The status of a receive from MPI_PROC_NULL holds MPI_ANY_TAG, which no send takes.
  const int32_t sendtag = dest == MPI_PROC_NULL ? 0 : tag[0];
  return Sendrecv(token, x, token_out, out, status, comm_key, check, source, dest, sendtag, tag[1]);
}

}  // namespace jaxcomm::mpi
