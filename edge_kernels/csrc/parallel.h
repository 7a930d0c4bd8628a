/* Running a kernel's workers: on the OpenMP team torch already runs (when the loader handed its
 * runtime over), else on pthreads started per call. See parallel.c. */
#ifndef CAPSULE_PARALLEL_H
#define CAPSULE_PARALLEL_H

#include <stdint.h>

#define MAX_WORKERS 64

/* workers for `units` pieces of work at `threads` asked: 1 .. MAX_WORKERS, at most one a unit */
static inline int capsule_workers(int threads, int64_t units) {
    int n = threads < 1 ? 1 : threads > MAX_WORKERS ? MAX_WORKERS : threads;
    return units < n ? (int)(units < 1 ? 1 : units) : n;
}

/* fn(arg, worker) for worker = 0 .. n - 1 (none when n <= 0), concurrently where threads are
 * had; the calling thread runs some of them. Returns 0, or -1 when a pthread could not be
 * started (then some workers did not run: the caller reports the failure, never a partial
 * result; an OpenMP runtime that cannot start a thread ends the process, as libgomp does). */
typedef void (*work_fn)(void *arg, int worker);
int capsule_run_workers(int n, work_fn fn, void *arg);

#endif
