/* A kernel's workers on torch's own OpenMP team, where the loader found it.
 *
 * Why: between torch's parallel operators its OpenMP workers spin, waiting for the next one
 * (libgomp spins for milliseconds by default). Threads a kernel starts itself then compete with
 * them for the same cores: with torch at 2 threads, 2 pthreads made the decode attention slower
 * than 1 (SmolLM2 int4 at 2,048 tokens: 47 vs 32 ms a token). Run on that same team, the
 * spinning workers take the kernel's work at once. The loader (edge_kernels/cpu_library.py)
 * passes the runtime's GOMP_parallel / omp_get_thread_num / omp_get_num_threads (libgomp's, or
 * an LLVM / Intel runtime's GOMP-compatible ones) to capsule_use_openmp; without them, pthreads.
 * On the OpenMP path a thread the runtime cannot start ends the process (libgomp's behaviour, as
 * for torch's own operators); on the pthread path it is reported (-1).
 */
#include <pthread.h>
#include <stddef.h>

#include "parallel.h"

typedef void (*gomp_parallel_t)(void (*)(void *), void *, unsigned, unsigned);
typedef int (*omp_int_t)(void);

static gomp_parallel_t gomp_parallel;
static omp_int_t omp_thread_num, omp_num_threads;

/* Hand over the OpenMP runtime's entry points (all three, or NULL for none). Called once, by
 * the loader, before any kernel runs. */
void capsule_use_openmp(void *parallel, void *thread_num, void *num_threads) {
    int all = parallel && thread_num && num_threads;
    gomp_parallel = all ? (gomp_parallel_t)parallel : NULL;
    omp_thread_num = all ? (omp_int_t)thread_num : NULL;
    omp_num_threads = all ? (omp_int_t)num_threads : NULL;
}

/* 1 when kernels run on the handed-over OpenMP team */
int capsule_uses_openmp(void) { return gomp_parallel != NULL; }

typedef struct {
    work_fn fn;
    void *arg;
    int n;
} team_t;

/* each member of the team runs workers id, id + team size, ...: all n run even when the
 * runtime gave fewer threads than asked (nested, or a thread limit) */
static void member(void *p) {
    const team_t *t = (const team_t *)p;
    const int size = omp_num_threads(), id = omp_thread_num();
    for (int w = id; w < t->n; w += size) t->fn(t->arg, w);
}

typedef struct {
    work_fn fn;
    void *arg;
    int worker;
} thread_t;

static void *one(void *p) {
    thread_t *t = (thread_t *)p;
    t->fn(t->arg, t->worker);
    return NULL;
}

int capsule_run_workers(int n, work_fn fn, void *arg) {
    if (n <= 0) return 0;   /* no work (an empty batch) */
    if (n == 1) {
        fn(arg, 0);
        return 0;
    }
    if (n > MAX_WORKERS) return -1;   /* callers cap n */
    if (gomp_parallel) {
        team_t team = {fn, arg, n};
        gomp_parallel(member, &team, (unsigned)n, 0);
        return 0;
    }
    pthread_t tids[MAX_WORKERS];
    thread_t args[MAX_WORKERS];
    int started = 0, status = 0;
    for (int i = 1; i < n; i++) {   /* this thread runs worker 0 */
        args[i] = (thread_t){fn, arg, i};
        if (pthread_create(&tids[i], NULL, one, &args[i]) != 0) {
            status = -1;
            break;
        }
        started = i;
    }
    if (status == 0) fn(arg, 0);
    for (int i = 1; i <= started; i++) pthread_join(tids[i], NULL);
    return status;
}
