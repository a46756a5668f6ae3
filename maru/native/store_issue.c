/* The staged store's per-chunk libcudart sequence in one call (maru.native.store_issue).
 *
 * Why: a write-behind store batch queues ~10 libcudart calls a chunk (PacedStores._queue_chunks_raw):
 * each a ctypes call that keeps the GIL, ~1 ms of the drain thread's GIL time a 32-chunk batch
 * beside vLLM's loop. Here the same calls run in C: called through ctypes.CDLL the GIL is released
 * once for the whole batch and taken back once.
 *
 * The functions are libcudart's own (their addresses passed in by the caller, from the library
 * torch loaded): fns[0] cudaStreamWaitEvent, fns[1] cudaEventRecord, fns[2] cudaGraphLaunch,
 * fns[3] cudaMemcpyAsync. Each chunk is a row of MARU_ISSUE_ROW int64 words (NativeRun.add in
 * maru/kv_ops/paced_store.py builds them); per row, in this order (the order of the Python loop):
 *
 *   [if WAIT_FREE] wait(gather, free)          the slot's last copy to the pool read it
 *   copy(slots_dst, slots_src, slots_bytes, d2d, gather)   the chunk's slot mapping into the graph
 *   launch(gather_exec, gather)
 *   [if CHECKSUM] launch(checksum_exec, gather); copy(acc_dst, sum_src, 8, d2d, gather)
 *   record(ready, gather); wait(copy_stream, ready)
 *   [if YIELD] launch(yield_exec, copy_stream)  the copy engine serves other streams in between
 *   copy(obj_dst, stage_src, nbytes, d2h, copy_stream); record(free, copy_stream)
 *
 * Returns 0, or 16 * (1 + the row) + the step that failed (0-9, as numbered in the code), with
 * libcudart's error in *err: the calls before it were queued, the ones after it were not.
 */
#include <stddef.h>
#include <stdint.h>

#define MARU_ISSUE_ABI 1
#define MARU_ISSUE_ROW 13
#define F_WAIT_FREE 1
#define F_CHECKSUM 2
#define F_YIELD 4

typedef int (*wait_fn)(void *stream, void *event, unsigned int flags);
typedef int (*record_fn)(void *event, void *stream);
typedef int (*launch_fn)(void *exec, void *stream);
typedef int (*copy_fn)(void *dst, const void *src, size_t n, int kind, void *stream);

int maru_issue_abi(void) { return MARU_ISSUE_ABI; }

int maru_issue_row_words(void) { return MARU_ISSUE_ROW; }

int64_t maru_queue_store_chunks(void *const *fns, const int64_t *rows, int64_t n, void *gather,
                                void *copy_stream, void *yield_exec, int d2d, int d2h, int *err)
{
    wait_fn wait = (wait_fn)fns[0];
    record_fn record = (record_fn)fns[1];
    launch_fn launch = (launch_fn)fns[2];
    copy_fn copy = (copy_fn)fns[3];
    int e;
#define STEP(s, call)                     \
    if ((e = (call)) != 0) {              \
        *err = e;                         \
        return 16 * (k + 1) + (s);        \
    }
    for (int64_t k = 0; k < n; k++) {
        const int64_t *r = rows + k * MARU_ISSUE_ROW;
        int64_t flags = r[0];
        void *free_ev = (void *)(intptr_t)r[1], *ready = (void *)(intptr_t)r[2];
        if (flags & F_WAIT_FREE)
            STEP(0, wait(gather, free_ev, 0));
        STEP(1, copy((void *)(intptr_t)r[3], (const void *)(intptr_t)r[4], (size_t)r[5], d2d, gather));
        STEP(2, launch((void *)(intptr_t)r[6], gather));
        if (flags & F_CHECKSUM) {
            STEP(3, launch((void *)(intptr_t)r[7], gather));
            STEP(4, copy((void *)(intptr_t)r[8], (const void *)(intptr_t)r[9], 8, d2d, gather));
        }
        STEP(5, record(ready, gather));
        STEP(6, wait(copy_stream, ready, 0));
        if (flags & F_YIELD)
            STEP(7, launch(yield_exec, copy_stream));
        STEP(8, copy((void *)(intptr_t)r[10], (const void *)(intptr_t)r[11], (size_t)r[12], d2h, copy_stream));
        STEP(9, record(free_ev, copy_stream));
    }
#undef STEP
    return 0;
}
