/* The raw-MPI baseline of the benchmark suite: each operation timed in a plain C
 * loop, the way a C program would call it.
 *
 * Built by bench/backends.py with the mpicc of the MPI that mpi4py loaded, and
 * called through ctypes from the benchmark process, so it runs under the same
 * MPI_Init_thread (and thread level) as every other backend, interleaved with
 * them in one job. Buffers are allocated and checked by the caller.
 */
#include <mpi.h>
#include <stdlib.h>
#include <string.h>

/* Runs `iters` calls of `op` on float32 buffers and returns the seconds taken;
 * a non-blocking op ("iallreduce", ..., "isendrecv") is posted and waited at once.
 * `count` is the block size in elements (see bench/backends.py for each op's shapes);
 * `a` and `b` are the op's input and output buffers; ops that map a buffer onto
 * one of the same shape swap them after each call, as a loop carry would. */
double raw_mpi_time(const char* op, MPI_Fint comm_f, float* a, float* b, int count, int iters) {
  MPI_Comm comm = MPI_Comm_f2c(comm_f);
  int rank, size;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  const int peer = (rank ^ 1) < size ? (rank ^ 1) : rank;
  float* t;
  MPI_Request requests[2];
  /* neighbor and halo: the ranks as a periodic ring, blocks of `count` each way. */
  MPI_Comm ring = MPI_COMM_NULL;
  int below = MPI_PROC_NULL, above = MPI_PROC_NULL;
  if (!strcmp(op, "neighbor") || !strcmp(op, "halo")) {
    int periodic = 1;
    MPI_Cart_create(comm, 1, &size, &periodic, 0, &ring);
    MPI_Cart_shift(ring, 0, 1, &below, &above);
  }
  double start = MPI_Wtime();
  if (!strcmp(op, "allreduce")) {
    for (int i = 0; i < iters; ++i) {
      MPI_Allreduce(a, b, count, MPI_FLOAT, MPI_SUM, comm);
      t = a, a = b, b = t;
    }
  } else if (!strcmp(op, "bcast")) {
    for (int i = 0; i < iters; ++i) MPI_Bcast(a, count, MPI_FLOAT, 0, comm);
  } else if (!strcmp(op, "sendrecv")) {
    for (int i = 0; i < iters; ++i) {
      MPI_Sendrecv(a, count, MPI_FLOAT, peer, 0, b, count, MPI_FLOAT, peer, 0, comm,
                   MPI_STATUS_IGNORE);
      t = a, a = b, b = t;
    }
  } else if (!strcmp(op, "alltoall")) {
    for (int i = 0; i < iters; ++i) {
      MPI_Alltoall(a, count, MPI_FLOAT, b, count, MPI_FLOAT, comm);
      t = a, a = b, b = t;
    }
  } else if (!strcmp(op, "allgather")) {
    for (int i = 0; i < iters; ++i) MPI_Allgather(a, count, MPI_FLOAT, b, count, MPI_FLOAT, comm);
  } else if (!strcmp(op, "reduce_scatter")) {
    for (int i = 0; i < iters; ++i) MPI_Reduce_scatter_block(a, b, count, MPI_FLOAT, MPI_SUM, comm);
  } else if (!strcmp(op, "scan")) {
    for (int i = 0; i < iters; ++i) {
      MPI_Scan(a, b, count, MPI_FLOAT, MPI_SUM, comm);
      t = a, a = b, b = t;
    }
  } else if (!strcmp(op, "iallreduce")) {
    for (int i = 0; i < iters; ++i) {
      MPI_Iallreduce(a, b, count, MPI_FLOAT, MPI_SUM, comm, &requests[0]);
      MPI_Wait(&requests[0], MPI_STATUS_IGNORE);
      t = a, a = b, b = t;
    }
  } else if (!strcmp(op, "ibcast")) {
    for (int i = 0; i < iters; ++i) {
      MPI_Ibcast(a, count, MPI_FLOAT, 0, comm, &requests[0]);
      MPI_Wait(&requests[0], MPI_STATUS_IGNORE);
    }
  } else if (!strcmp(op, "isendrecv")) {
    for (int i = 0; i < iters; ++i) {
      MPI_Irecv(b, count, MPI_FLOAT, peer, 0, comm, &requests[0]);
      MPI_Isend(a, count, MPI_FLOAT, peer, 0, comm, &requests[1]);
      MPI_Waitall(2, requests, MPI_STATUSES_IGNORE);
      t = a, a = b, b = t;
    }
  } else if (!strcmp(op, "ialltoall")) {
    for (int i = 0; i < iters; ++i) {
      MPI_Ialltoall(a, count, MPI_FLOAT, b, count, MPI_FLOAT, comm, &requests[0]);
      MPI_Wait(&requests[0], MPI_STATUS_IGNORE);
      t = a, a = b, b = t;
    }
  } else if (!strcmp(op, "iallgather")) {
    for (int i = 0; i < iters; ++i) {
      MPI_Iallgather(a, count, MPI_FLOAT, b, count, MPI_FLOAT, comm, &requests[0]);
      MPI_Wait(&requests[0], MPI_STATUS_IGNORE);
    }
  } else if (!strcmp(op, "ireduce_scatter")) {
    for (int i = 0; i < iters; ++i) {
      MPI_Ireduce_scatter_block(a, b, count, MPI_FLOAT, MPI_SUM, comm, &requests[0]);
      MPI_Wait(&requests[0], MPI_STATUS_IGNORE);
    }
  } else if (!strcmp(op, "neighbor")) {
    for (int i = 0; i < iters; ++i) {
      MPI_Neighbor_alltoall(a, count, MPI_FLOAT, b, count, MPI_FLOAT, ring);
      t = a, a = b, b = t;
    }
  } else if (!strcmp(op, "halo")) {
    for (int i = 0; i < iters; ++i) {
      MPI_Sendrecv(a + count, count, MPI_FLOAT, above, 0, b, count, MPI_FLOAT, below, 0, ring,
                   MPI_STATUS_IGNORE);
      MPI_Sendrecv(a, count, MPI_FLOAT, below, 1, b + count, count, MPI_FLOAT, above, 1, ring,
                   MPI_STATUS_IGNORE);
      t = a, a = b, b = t;
    }
  } else if (!strncmp(op, "alltoallv", 9)) {
    /* The counts as bench/backends.py's send_counts: `count` rows of one float to
     * every rank; for alltoallv_skew, 10x that from rank 0. */
    int* counts = malloc(4 * sizeof(int) * (size_t)size);
    int *send = counts, *send_at = counts + size, *recv = counts + 2 * size,
        *recv_at = counts + 3 * size;
    for (int d = 0; d < size; ++d)
      send[d] = !strcmp(op, "alltoallv_skew") && rank == 0 ? 10 * count : count;
    for (int i = 0; i < iters; ++i) {
      MPI_Alltoall(send, 1, MPI_INT, recv, 1, MPI_INT, comm);
      send_at[0] = recv_at[0] = 0;
      for (int d = 1; d < size; ++d) {
        send_at[d] = send_at[d - 1] + send[d - 1];
        recv_at[d] = recv_at[d - 1] + recv[d - 1];
      }
      MPI_Alltoallv(a, send, send_at, MPI_FLOAT, b, recv, recv_at, MPI_FLOAT, comm);
    }
    free(counts);
  } else if (!strcmp(op, "allgatherv")) {
    /* `count` floats from every rank, the counts learnt on every call. */
    int* counts = malloc(2 * sizeof(int) * (size_t)size);
    int* starts = counts + size;
    for (int i = 0; i < iters; ++i) {
      MPI_Allgather(&count, 1, MPI_INT, counts, 1, MPI_INT, comm);
      starts[0] = 0;
      for (int r = 1; r < size; ++r) starts[r] = starts[r - 1] + counts[r - 1];
      MPI_Allgatherv(a, count, MPI_FLOAT, b, counts, starts, MPI_FLOAT, comm);
    }
    free(counts);
  } else {
    return -1.0;
  }
  double elapsed = MPI_Wtime() - start;
  if (ring != MPI_COMM_NULL) MPI_Comm_free(&ring);
  return elapsed;
}

/* The graph ops of bench/backends.py: a block of `count` floats to and from each
 * of `degree` neighbours (ascending, the same list both ways), as one
 * MPI_Neighbor_alltoallv over a distributed graph communicator (graph_alltoallv),
 * one MPI_Alltoallv over all ranks with zero counts to the others (graph_dense),
 * or one MPI_Sendrecv per neighbour in ascending order (graph_sendrecv). The
 * counts are fixed, so no call exchanges them. */
double raw_mpi_graph_time(const char* op, MPI_Fint comm_f, float* a, float* b, int count, int iters,
                          int degree, const int* neighbours) {
  MPI_Comm comm = MPI_Comm_f2c(comm_f);
  int size;
  MPI_Comm_size(comm, &size);
  float* t;
  const int n = degree > size ? degree : size;
  int* counts = calloc(2 * (size_t)n + 1, sizeof(int));
  int* starts = counts + n;
  MPI_Comm graph = MPI_COMM_NULL;
  if (!strcmp(op, "graph_alltoallv")) {
    for (int k = 0; k < degree; ++k) counts[k] = count, starts[k] = k * count;
    MPI_Dist_graph_create_adjacent(comm, degree, neighbours, MPI_UNWEIGHTED, degree, neighbours,
                                   MPI_UNWEIGHTED, MPI_INFO_NULL, 0, &graph);
  } else if (!strcmp(op, "graph_dense")) {
    /* Neighbours ascend, so their blocks lie in rank order, as alltoallv's do. */
    for (int k = 0; k < degree; ++k) counts[neighbours[k]] = count;
    for (int r = 1; r < size; ++r) starts[r] = starts[r - 1] + counts[r - 1];
  }
  double start = MPI_Wtime();
  if (!strcmp(op, "graph_alltoallv")) {
    for (int i = 0; i < iters; ++i) {
      MPI_Neighbor_alltoallv(a, counts, starts, MPI_FLOAT, b, counts, starts, MPI_FLOAT, graph);
      t = a, a = b, b = t;
    }
  } else if (!strcmp(op, "graph_dense")) {
    for (int i = 0; i < iters; ++i) {
      MPI_Alltoallv(a, counts, starts, MPI_FLOAT, b, counts, starts, MPI_FLOAT, comm);
      t = a, a = b, b = t;
    }
  } else if (!strcmp(op, "graph_sendrecv")) {
    for (int i = 0; i < iters; ++i) {
      for (int k = 0; k < degree; ++k)
        MPI_Sendrecv(a + (size_t)k * count, count, MPI_FLOAT, neighbours[k], 0,
                     b + (size_t)k * count, count, MPI_FLOAT, neighbours[k], 0, comm,
                     MPI_STATUS_IGNORE);
      t = a, a = b, b = t;
    }
  } else {
    free(counts);
    return -1.0;
  }
  double elapsed = MPI_Wtime() - start;
  if (graph != MPI_COMM_NULL) MPI_Comm_free(&graph);
  free(counts);
  return elapsed;
}
