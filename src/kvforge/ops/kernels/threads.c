/* The kernels' threads: torch's own OpenMP team.
 *
 * kvforge.ops.kernels finds the OpenMP runtime torch is linked to (its libgomp) and hands this
 * file its GOMP_parallel and thread queries (`kvforge_use_openmp`). A kernel call then runs on as
 * many threads as torch's ops would from the calling thread (omp_get_max_threads: what
 * torch.get_num_threads() returns there), on the same threads, which spin and sleep by that
 * runtime's one policy.
 *
 * Why not a pool or an OpenMP runtime of our own: beside torch's they fight for the cores
 * (measured, a pthread pool spinning 2 ms after each call: smollm2-135m's 1K-token bf16 prefill
 * at 2 threads 0.40 -> 2.36 s on an Intel Xeon with AMX, as oneDNN's team waited on the core it
 * held). Why not compile with -fopenmp: that links a libgomp at build time, which need not be the
 * one torch loads, and pip's isolated build has no torch to ask.
 *
 * Work is split by independent outputs only (a linear's blocks of 16 outputs, an attention's
 * heads, a norm's rows): each output is computed by one thread with exactly the one-thread
 * arithmetic, so the bits do not depend on the thread count. A part is a run of whole `grain`s,
 * so each thread still takes its widest register tiles. Without a runtime (none found, or
 * `kvforge_use_openmp` not called) every call runs on the caller alone. */
#include <stddef.h>

#include "threads.h"

typedef void (*gomp_parallel_fn)(void (*fn)(void *), void *data, unsigned threads, unsigned flags);
typedef int (*omp_query_fn)(void);

static gomp_parallel_fn gomp_parallel;
static omp_query_fn thread_num, team_size, max_threads;

/* The runtime's entry points, or all NULL: every call on the caller alone. */
void kvforge_use_openmp(void *parallel, void *get_thread_num, void *get_num_threads, void *get_max_threads) {
    gomp_parallel = (gomp_parallel_fn)parallel;
    thread_num = (omp_query_fn)get_thread_num;
    team_size = (omp_query_fn)get_num_threads;
    max_threads = (omp_query_fn)get_max_threads;
}

struct job {
    kvforge_part fn;
    void *ctx;
    long items, step, parts; /* part i is items [i * step, min((i + 1) * step, items)) */
};

/* Each thread of the team takes parts thread, thread + team, ...: every part runs once whatever
 * team the runtime gave (fewer threads than asked inside another parallel region, say). */
static void team_member(void *arg) {
    const struct job *j = arg;
    const long team = team_size();
    for (long part = thread_num(); part < j->parts; part += team) {
        const long begin = part * j->step, end = begin + j->step < j->items ? begin + j->step : j->items;
        if (begin < end) j->fn(j->ctx, begin, end);
    }
}

/* At most torch's thread count of runs, as few as that needs (5 grains on 4 threads: 3 runs of
 * 2, 2, 1). */
void kvforge_parallel(kvforge_part fn, void *ctx, long items, long grain) {
    if (items <= 0) return;
    const long grains = (items + grain - 1) / grain, width = gomp_parallel ? max_threads() : 1;
    const long per_part = (grains + width - 1) / (width < 1 ? 1 : width), parts = (grains + per_part - 1) / per_part;
    if (parts <= 1) {
        fn(ctx, 0, items);
        return;
    }
    struct job job = {fn, ctx, items, per_part * grain, parts};
    gomp_parallel(team_member, &job, (unsigned)parts, 0);
}
