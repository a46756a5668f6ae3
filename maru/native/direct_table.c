/* The direct layer load's table (maru.kv_ops.direct_table), built in one call.

   The numpy definition (``direct_table._table_numpy``) is about ten array operations a load; on a
   serving host each costs several microseconds with the caches cold, on the path between vLLM's
   step and the load's first byte on the bus. This is the same table, written in one pass, and
   checked against that definition before it is used.

   Layout: ``out`` is ``[6, width + 1]`` int64, row-major. Rows: 0 the source address (per object
   when the objects are uniform, else per token), 1 the plane stride in elements (idem), 2 the slot
   of each token (-1 past ``total``), 3 the object of each token, 4 the token within its object
   (both only when not uniform), 5 each object's checksum accumulator start. Column ``width`` of
   row 0 says how rows 0 and 1 are indexed (the uniform length, or 0: per token), of row 1 the
   token count. Uniform: every object but the last has the first's length (> 0), the last at most
   that. Rows 3 and 4 are not written when uniform, nor past ``total`` otherwise (never read). */

#include <stdint.h>
#include <string.h>

/* Returns 0, -1 when width < total, -2 when a length is negative or they do not add up to total
   (nothing is written then). */
int64_t maru_direct_table(int64_t *out, int64_t width, const int64_t *slots, int64_t total,
                          const int64_t *ptrs, const int64_t *lengths, int64_t n, int64_t row,
                          int64_t esize, const int64_t *prefill) {
    if (width < total) return -1;
    int64_t sum = 0;
    for (int64_t i = 0; i < n; i++) {
        if (lengths[i] < 0) return -2; /* never: the writes below stay inside the table */
        sum += lengths[i];
    }
    if (sum != total) return -2;
    const int64_t w1 = width + 1;
    int64_t *r0 = out, *r1 = out + w1, *r2 = out + 2 * w1, *r3 = out + 3 * w1, *r4 = out + 4 * w1,
            *r5 = out + 5 * w1;
    const int64_t first = n ? lengths[0] : 0;
    int uniform = first > 0 && lengths[n - 1] <= first;
    for (int64_t i = 0; uniform && i + 1 < n; i++) uniform = lengths[i] == first;
    if (uniform) {
        for (int64_t i = 0; i < n; i++) {
            r0[i] = ptrs[i];
            r1[i] = lengths[i] * row;
        }
        r0[width] = first;
    } else {
        /* Unsigned: the same wrap-around as numpy's int64, never undefined behaviour. */
        const uint64_t step = (uint64_t)row * (uint64_t)esize;
        int64_t t = 0;
        for (int64_t i = 0; i < n; i++) {
            const uint64_t base = (uint64_t)ptrs[i];
            const int64_t stride = lengths[i] * row;
            for (int64_t j = 0; j < lengths[i]; j++, t++) {
                r0[t] = (int64_t)(base + (uint64_t)j * step);
                r1[t] = stride;
                r3[t] = i;
                r4[t] = j;
            }
        }
        r0[width] = 0;
    }
    r1[width] = total;
    if (total) memcpy(r2, slots, (size_t)total * sizeof(int64_t));
    for (int64_t t = total; t < w1; t++) r2[t] = -1;
    if (prefill) {
        if (n) memcpy(r5, prefill, (size_t)n * sizeof(int64_t));
    } else {
        for (int64_t i = 0; i < n; i++) r5[i] = 0;
    }
    return 0;
}
