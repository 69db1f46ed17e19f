/* Copy kernels of the kvdd simulator, the job check: whether a job's runs are independent (the
 * condition for the 2-thread path). See _copy_impl.h; execution is in _copy_impl.c.
 */
#include "_copy_impl.h"

#include <stdint.h>
#include <stdlib.h>

/* ------------------------------------------------------------------------------------------------ */
/* Independence check for the 2-thread path                                                          */

typedef struct {
    uintptr_t lo, hi;
} span;

static int span_cmp(const void *a, const void *b) {
    uintptr_t x = ((const span *)a)->lo, y = ((const span *)b)->lo;
    return (x > y) - (x < y);
}

/* 1 if any bit in [a, b) is already set; sets them all. */
static int mark_range(uint64_t *bm, uint64_t a, uint64_t b) {
    int hit = 0;
    while (a < b) {
        uint64_t w = a >> 6, bit = a & 63u;
        uint64_t take = 64u - bit;
        if (take > b - a) take = b - a;
        uint64_t mask = (take == 64u ? ~(uint64_t)0 : (((uint64_t)1 << take) - 1u)) << bit;
        hit |= (bm[w] & mask) != 0;
        bm[w] |= mask;
        a += take;
    }
    return hit;
}

#define BITMAP_MAX_BITS ((uint64_t)1 << 24) /* 2 MiB of bitmap at most */

int kvdd_job_independent(const kvdd_job *job) {
    size_t K = job->K, J = job->J;
    const int64_t *so = job->soff, *dof = job->doff, *ln = job->len;
    if (K == 0 || job->per_k == 0) return 1;

    /* Touched spans relative to each region base, and whether the destination runs are sorted and
     * disjoint in list order (the common case: one pass, no bitmap). */
    uint64_t smin = UINT64_MAX, smax = 0, dmin = UINT64_MAX, dmax = 0, gran = 0;
    int sorted = 1;
    uint64_t prev_end = 0;
    for (size_t j = 0; j < J; j++) {
        uint64_t n = (uint64_t)ln[j];
        if (!n) continue;
        uint64_t s = (uint64_t)so[j], d = (uint64_t)dof[j];
        if (s < smin) smin = s;
        if (s + n > smax) smax = s + n;
        if (d < dmin) dmin = d;
        if (d + n > dmax) dmax = d + n;
        if (d < prev_end) sorted = 0;
        prev_end = d + n;
        gran |= d | n;
    }

    /* Destination runs of one tensor pairwise disjoint? */
    if (!sorted) {
        gran |= dmin;
        gran &= -gran; /* largest power of two dividing every offset and length */
        uint64_t nbits = (dmax - dmin) / gran;
        if (nbits > BITMAP_MAX_BITS || job->per_k / gran > BITMAP_MAX_BITS) return 0;
        uint64_t *bm = calloc((size_t)(nbits / 64u + 1u), sizeof(uint64_t));
        if (!bm) return 0;
        int hit = 0;
        for (size_t j = 0; j < J && !hit; j++) {
            uint64_t n = (uint64_t)ln[j];
            if (!n) continue;
            uint64_t a = ((uint64_t)dof[j] - dmin) / gran;
            hit = mark_range(bm, a, a + n / gran);
        }
        free(bm);
        if (hit) return 0;
    }

    /* Destination spans of different tensors disjoint, and no source span overlaps a destination. */
    span *ds = malloc(2 * K * sizeof(span));
    if (!ds) return 0;
    span *ss = ds + K;
    for (size_t k = 0; k < K; k++) {
        ds[k].lo = job->pairs[k].dst + dmin;
        ds[k].hi = job->pairs[k].dst + dmax;
        ss[k].lo = job->pairs[k].src + smin;
        ss[k].hi = job->pairs[k].src + smax;
    }
    qsort(ds, K, sizeof(span), span_cmp);
    int ok = 1;
    for (size_t k = 1; k < K && ok; k++) ok = ds[k - 1].hi <= ds[k].lo;
    for (size_t k = 0; k < K && ok; k++) {
        /* first destination span with lo >= ss[k].hi; the one before it is the only candidate
         * (destination spans are disjoint and sorted) */
        size_t lo = 0, hi = K;
        while (lo < hi) {
            size_t mid = lo + (hi - lo) / 2;
            if (ds[mid].lo < ss[k].hi) lo = mid + 1;
            else hi = mid;
        }
        if (lo > 0 && ds[lo - 1].hi > ss[k].lo) ok = 0;
    }
    free(ds);
    return ok;
}
