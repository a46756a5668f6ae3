/* Maru's object checksum (maru.checksum, "maru-mix64-sum-v1"): the sum of the mixed words.
 *
 * Built on first use by maru/native/__init__.py (cc -O3, for this host's CPU) and called through
 * ctypes, which releases the GIL for the whole call: a checksum no longer stops and restarts at
 * every numpy operation while another Python thread runs (vLLM's engine loop spins in Python).
 *
 * Words are read little-endian (the loader checks the host is) with memcpy, so any alignment of
 * `data` is fine. Indices are absolute: word i of the object is mixed with i, whatever `begin` is,
 * so threads summing disjoint ranges add up to the same result. Unsigned arithmetic wraps mod
 * 2**64, as the definition requires.
 */
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#define K1 0x9E3779B97F4A7C15ULL
#define K2 0xBF58476D1CE4E5B9ULL
#define K3 0x94D049BB133111EBULL

uint64_t maru_words_sum(const unsigned char *data, uint64_t begin, uint64_t end)
{
    uint64_t total = 0;
    for (uint64_t i = begin; i < end; i++) {
        uint64_t x;
        memcpy(&x, data + 8 * i, 8);
        x += i * K1;
        x *= K2;
        x ^= x >> 32;
        x *= K3;
        x ^= x >> 29;
        total += x;
    }
    return total;
}

struct part {
    const unsigned char *data;
    uint64_t begin, end, sum;
};

static void *sum_part(void *arg)
{
    struct part *p = arg;
    p->sum = maru_words_sum(p->data, p->begin, p->end);
    return NULL;
}

#define MAX_THREADS 64

/* The same sum over up to `threads` threads (the caller's among them), for large objects: one call,
 * so a caller that released the GIL takes it back once, not once per thread. Falls back to fewer
 * threads (down to the caller's alone) if the system refuses to start one; the result is the same. */
uint64_t maru_words_sum_parallel(const unsigned char *data, uint64_t begin, uint64_t end, int threads)
{
    struct part parts[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS];
    if (threads > MAX_THREADS)
        threads = MAX_THREADS;
    if (threads < 2 || end - begin < (uint64_t)threads * 4096)
        return maru_words_sum(data, begin, end);
    uint64_t step = (end - begin + threads - 1) / threads;
    for (int t = 0; t < threads; t++) {
        uint64_t b = begin + t * step;
        parts[t].data = data;
        parts[t].begin = b < end ? b : end;
        parts[t].end = b + step < end ? b + step : end;
        parts[t].sum = 0;
        started[t] = t > 0 && pthread_create(&ids[t], NULL, sum_part, &parts[t]) == 0;
    }
    uint64_t total = 0;
    for (int t = 0; t < threads; t++) {
        if (!started[t])
            sum_part(&parts[t]); /* part 0, or a thread the system would not start */
    }
    for (int t = 0; t < threads; t++) {
        if (started[t])
            pthread_join(ids[t], NULL);
        total += parts[t].sum;
    }
    return total;
}

/* The raw sums of an object's token segments (maru.segments), added into raws[0..ceil(tokens/seg)).
 * The object is `planes` planes (layers x K/V) of `tokens` rows of `row_words` words, C-contiguous;
 * segment s is rows [s*seg, (s+1)*seg) of every plane (the last may be shorter). `only` (NULL: all)
 * marks, one byte a segment, the segments to read: the others are not read and keep their value.
 * One call for the whole object: the Python loop it replaces made a call for each (plane, segment)
 * piece, 1024 for a 256-token chunk of 32 layers. Word indices are absolute in the object. */
void maru_segment_sums(const unsigned char *data, uint64_t planes, uint64_t tokens, uint64_t row_words,
                       uint64_t seg, const unsigned char *only, uint64_t *raws)
{
    uint64_t nseg = (tokens + seg - 1) / seg;
    for (uint64_t p = 0; p < planes; p++) {
        uint64_t base = p * tokens;
        for (uint64_t s = 0; s < nseg; s++) {
            if (only && !only[s])
                continue;
            uint64_t t0 = s * seg, t1 = t0 + seg < tokens ? t0 + seg : tokens;
            raws[s] += maru_words_sum(data, (base + t0) * row_words, (base + t1) * row_words);
        }
    }
}

/* The ABI version the loader checks: bump it with any change of the signatures above. */
int maru_native_abi(void) { return 3; }
