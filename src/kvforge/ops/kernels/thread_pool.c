/* The kernels' threads: a plain pthread pool whose width the caller sets to torch's
 * (`kvforge_set_threads`, from kvforge.ops.kernels before each call).
 *
 * Why its own pool: OpenMP here would load a second runtime beside torch's libgomp, and two
 * runtimes each spinning a team over the same cores slow both; torch's own pool needs its C++
 * headers at build time, which pip's isolated build does not have.
 *
 * Work is split by independent outputs only (a linear's blocks of 16 outputs, an attention's
 * heads): each output is computed by one thread with exactly the arithmetic of the one-thread
 * path, so the bits do not depend on the thread count. A part is a run of whole `grain`s, so
 * each thread still takes its widest register tiles.
 *
 * Waiting: after a job a worker spins (pause) for SPIN_NS, since a decode step calls the kernels
 * every few tens of microseconds and a sleeping thread takes ~50 us to wake; then it sleeps on a
 * condition variable, so a pool left idle (prefill in torch's ops, a server between requests)
 * gives its core back. A width of 1 runs the job on the caller and wakes no one. */
#include <immintrin.h>
#include <pthread.h>
#include <stdatomic.h>
#include <time.h>

#define MAX_THREADS 64
#define SPIN_NS 2000000L /* 2 ms */

typedef void (*kvforge_part)(void *ctx, long begin, long end);

static int width = 1;         /* threads a job is split over, the caller included */
static int started;           /* workers running (they are never stopped) */
static pthread_t workers[MAX_THREADS + 1];
static long first_seen[MAX_THREADS + 1]; /* the generation when worker i started: jobs after it are its */
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;
static atomic_long generation; /* bumped once per job */
static atomic_int unfinished;  /* workers that have not yet finished the current job */
static atomic_int sleeping;
static atomic_flag busy = ATOMIC_FLAG_INIT; /* a job (or a width change) in flight */
static struct {
    kvforge_part fn;
    void *ctx;
    long items, step; /* part i is items [i * step, min((i + 1) * step, items)) */
} job;

static long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

static void run_part(long part) {
    const long begin = part * job.step, end = begin + job.step < job.items ? begin + job.step : job.items;
    if (begin < end) job.fn(job.ctx, begin, end);
}

static void *worker(void *arg) {
    const long part = (long)arg;
    long seen = first_seen[part];
    for (;;) {
        const long spin_until = now_ns() + SPIN_NS;
        for (int n = 0; atomic_load_explicit(&generation, memory_order_acquire) == seen; n++) {
            _mm_pause();
            if ((n & 255) == 255 && now_ns() > spin_until) {
                pthread_mutex_lock(&lock);
                atomic_fetch_add(&sleeping, 1);
                while (atomic_load(&generation) == seen) pthread_cond_wait(&wake, &lock);
                atomic_fetch_sub(&sleeping, 1);
                pthread_mutex_unlock(&lock);
            }
        }
        seen = atomic_load(&generation);
        run_part(part); /* every worker finishes every job (an empty part when it has none), so
                           none can read the next job's fields while the caller writes them */
        atomic_fetch_sub_explicit(&unfinished, 1, memory_order_release);
    }
    return 0;
}

/* The width of the jobs that follow (torch.get_num_threads()); workers start at first need. */
void kvforge_set_threads(long threads) {
    while (atomic_flag_test_and_set(&busy)) _mm_pause();
    width = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : (int)threads;
    while (started < width - 1) {
        first_seen[started + 1] = atomic_load(&generation); /* no job runs while the width is set */
        if (pthread_create(&workers[started], 0, worker, (void *)(long)(started + 1)) != 0) {
            width = started + 1; /* as many threads as could start */
            break;
        }
        started++;
    }
    atomic_flag_clear(&busy);
}

/* fn(ctx, begin, end) over items [0, items), split into at most `width` runs of whole grains;
 * returns when every part has finished. A call made while another thread's job runs (two
 * schedulers of a server, say) runs on its own thread alone: the same bits, no threads. */
void kvforge_parallel(kvforge_part fn, void *ctx, long items, long grain) {
    const long grains = (items + grain - 1) / grain;
    if (items <= 0) return;
    if (grains <= 1 || width <= 1 || atomic_flag_test_and_set(&busy)) {
        fn(ctx, 0, items);
        return;
    }
    const long parts = grains < width ? grains : width;
    job.fn = fn;
    job.ctx = ctx;
    job.items = items;
    job.step = (grains + parts - 1) / parts * grain;
    atomic_store(&unfinished, started);
    atomic_fetch_add(&generation, 1); /* publishes the job (seq_cst: ordered before the read of `sleeping`) */
    if (atomic_load(&sleeping) > 0) {
        pthread_mutex_lock(&lock);
        pthread_cond_broadcast(&wake);
        pthread_mutex_unlock(&lock);
    }
    run_part(0);
    while (atomic_load_explicit(&unfinished, memory_order_acquire) > 0) _mm_pause();
    atomic_flag_clear(&busy);
}
