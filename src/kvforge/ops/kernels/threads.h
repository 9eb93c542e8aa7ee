/* threads.c's one entry point for the other kernels: fn(ctx, begin, end) over items [0, items),
 * split into runs of whole grains over torch's threads; returns when every part has finished. */
#ifndef KVFORGE_THREADS_H
#define KVFORGE_THREADS_H

typedef void (*kvforge_part)(void *ctx, long begin, long end);
void kvforge_parallel(kvforge_part fn, void *ctx, long items, long grain);

#endif
