/* Copy kernels of the kvdd simulator; see _copy_impl.h and the notes at the top of _copy.pyx.
 *
 * Portable C11 plus, on x86-64, function-level target attributes for the streaming-store loops,
 * chosen at run time with __builtin_cpu_supports (so the shipped build needs no -march flag and never
 * executes an instruction the CPU lacks); on aarch64, NEON loads with STNP (non-temporal store pair)
 * stores (NEON is part of the aarch64 base ISA). Other architectures use memcpy/memmove throughout.
 * KVDD_NO_SIMD builds the memcpy path only.
 */
#define _GNU_SOURCE
#include "_copy_impl.h"

#include <fcntl.h>
#include <stdio.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* KVDD_NO_SIMD: build the portable path only (memcpy/memmove), e.g. to test it on x86-64. */
#if (defined(__x86_64__) || defined(__amd64__)) && (defined(__GNUC__) || defined(__clang__)) && !defined(KVDD_NO_SIMD)
#define KVDD_X86 1
#include <immintrin.h>
#else
#define KVDD_X86 0
#endif
#if defined(__aarch64__) && defined(__GNUC__) && !defined(KVDD_NO_SIMD)
#define KVDD_NEON 1
#include <arm_neon.h>
#else
#define KVDD_NEON 0
#endif

/* ------------------------------------------------------------------------------------------------ */
/* CPU features                                                                                      */

static const char *const feature_names[] = {"x86_64", "sse2", "avx2", "avx512f", "erms", "fsrm", "aarch64_neon"};
#define N_FEATURES ((int)(sizeof(feature_names) / sizeof(feature_names[0])))

static int features[N_FEATURES];
static unsigned isa_mask;
static int isa_best;
static long online_cpus; /* read once: sysconf reads a file in glibc */
static uint64_t llc_bytes; /* last-level cache size (0: unknown) */
static uint64_t l2_bytes;  /* per-core L2 size (0: unknown) */
static pthread_once_t features_once = PTHREAD_ONCE_INIT;

#if KVDD_X86
#include <cpuid.h>
static int cpuid_leaf7_bit(int reg, int bit) {
    unsigned a, b, c, d;
    if (__get_cpuid_max(0, 0) < 7) return 0;
    __cpuid_count(7, 0, a, b, c, d);
    (void)a;
    return (int)(((reg == 1 ? b : d) >> bit) & 1u);
}
#endif

/* Size in bytes of cpu0's unified or data cache of `level` from /sys (0: unknown). */
static uint64_t sysfs_cache_bytes(int level) {
#if defined(__linux__)
    for (int i = 0; i < 8; i++) {
        char path[96], buf[32];
        snprintf(path, sizeof(path), "/sys/devices/system/cpu/cpu0/cache/index%d/level", i);
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0) break;
        ssize_t n = read(fd, buf, sizeof(buf) - 1);
        close(fd);
        if (n <= 0 || atoi((buf[n] = 0, buf)) != level) continue;
        snprintf(path, sizeof(path), "/sys/devices/system/cpu/cpu0/cache/index%d/type", i);
        fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0) continue;
        n = read(fd, buf, sizeof(buf) - 1);
        close(fd);
        if (n <= 0 || buf[0] == 'I') continue; /* an instruction cache */
        snprintf(path, sizeof(path), "/sys/devices/system/cpu/cpu0/cache/index%d/size", i);
        fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0) continue;
        n = read(fd, buf, sizeof(buf) - 1);
        close(fd);
        if (n <= 0) continue;
        buf[n] = 0;
        char *end;
        unsigned long long v = strtoull(buf, &end, 10);
        if (*end == 'K') v <<= 10;
        else if (*end == 'M') v <<= 20;
        return (uint64_t)v;
    }
#else
    (void)level;
#endif
    return 0;
}

static void detect_features(void) {
    online_cpus = sysconf(_SC_NPROCESSORS_ONLN);
#if KVDD_X86
    __builtin_cpu_init();
    features[0] = 1;
    features[1] = __builtin_cpu_supports("sse2") ? 1 : 0;
    /* __builtin_cpu_supports also checks that the OS saves the YMM/ZMM state (XCR0). */
    features[2] = __builtin_cpu_supports("avx2") ? 1 : 0;
    features[3] = __builtin_cpu_supports("avx512f") ? 1 : 0;
    features[4] = cpuid_leaf7_bit(1, 9);  /* EBX bit 9: enhanced rep movsb */
    features[5] = cpuid_leaf7_bit(3, 4);  /* EDX bit 4: fast short rep movsb */
    isa_mask = 1u << KVDD_ISA_MEMCPY;
    if (features[1]) isa_mask |= 1u << KVDD_ISA_SSE2;
    if (features[2]) isa_mask |= 1u << KVDD_ISA_AVX2;
    if (features[3]) isa_mask |= 1u << KVDD_ISA_AVX512;
#else
    isa_mask = 1u << KVDD_ISA_MEMCPY;
#endif
#if KVDD_NEON
    features[6] = 1;
    isa_mask |= 1u << KVDD_ISA_NEON;
#endif
    /* Cache sizes: Linux sysfs (what the kernel was told, also in VMs), else sysconf. */
    uint64_t l2 = sysfs_cache_bytes(2), llc = sysfs_cache_bytes(3);
#if defined(_SC_LEVEL3_CACHE_SIZE) && defined(_SC_LEVEL2_CACHE_SIZE)
    if (!l2 && sysconf(_SC_LEVEL2_CACHE_SIZE) > 0) l2 = (uint64_t)sysconf(_SC_LEVEL2_CACHE_SIZE);
    if (!llc && sysconf(_SC_LEVEL3_CACHE_SIZE) > 0) llc = (uint64_t)sysconf(_SC_LEVEL3_CACHE_SIZE);
#endif
    llc_bytes = llc ? llc : l2;
    l2_bytes = l2;
    isa_best = KVDD_ISA_MEMCPY;
    for (int i = KVDD_ISA_COUNT - 1; i >= 0; i--) {
        if (isa_mask & (1u << i)) { isa_best = i; break; }
    }
}

unsigned kvdd_isa_mask(void) { pthread_once(&features_once, detect_features); return isa_mask; }
int kvdd_isa_best(void) { pthread_once(&features_once, detect_features); return isa_best; }
uint64_t kvdd_llc_bytes(void) { pthread_once(&features_once, detect_features); return llc_bytes; }
uint64_t kvdd_l2_bytes(void) { pthread_once(&features_once, detect_features); return l2_bytes; }
int kvdd_cpu_feature_count(void) { return N_FEATURES; }
const char *kvdd_cpu_feature_name(int i) { return (i >= 0 && i < N_FEATURES) ? feature_names[i] : ""; }
int kvdd_cpu_feature_value(int i) {
    pthread_once(&features_once, detect_features);
    return (i >= 0 && i < N_FEATURES) ? features[i] : 0;
}

/* ------------------------------------------------------------------------------------------------ */
/* Streaming copies: dst aligned to 64 bytes with a regular-store head, then vector loops of          */
/* unaligned loads and non-temporal stores, a regular-store tail. Callers guarantee no overlap. The  */
/* fence that orders the streaming stores is issued once per job (stream_fence).                     */
/*                                                                                                   */
/* Runs of at least KVDD_PAGED_MIN bytes are copied KVDD_PAGES pages at a time, interleaved: each     */
/* step loads one group of vectors from each of the pages, then stores them (so the memory system     */
/* works on KVDD_PAGES streams at once instead of one), with a prefetch of every stream a few steps   */
/* ahead. This is what lets one thread reach the bandwidth of glibc's streaming memcpy; a plain       */
/* linear loop leaves a third of it on the table (see docs/benchmarks.md).                           */
/*                                                                                                   */
/* [pf, pf + pfn) is the source of the next run when that run is short (<= KVDD_PF_MAX_RUN): it is   */
/* prefetched into L2 while this run's linear part copies (short random runs gain; longer runs do not,*/
/* the hardware prefetcher has time to ramp up).                                                     */

static inline size_t align_head(char **d, const char **s, size_t n) {
    size_t head = (size_t)(-(uintptr_t)*d) & 63u;
    if (head > n) head = n;
    if (head) {
        memcpy(*d, *s, head);
        *d += head;
        *s += head;
    }
    return n - head;
}

/* Fully unrolled inner loops keep the vectors in registers (GCC and clang). */
#if defined(__clang__)
#define UNROLL _Pragma("unroll")
#elif defined(__GNUC__)
#define UNROLL _Pragma("GCC unroll 16")
#else
#define UNROLL
#endif

#define PAGE 4096u
#define GROUP ((size_t)KVDD_PAGES * PAGE)

#if KVDD_X86
#define PREFETCH4(p)                                                                                  \
    do {                                                                                              \
        _mm_prefetch((p), _MM_HINT_T1);                                                               \
        _mm_prefetch((p) + 64, _MM_HINT_T1);                                                          \
        _mm_prefetch((p) + 128, _MM_HINT_T1);                                                         \
        _mm_prefetch((p) + 192, _MM_HINT_T1);                                                         \
    } while (0)

#define LD512(p) _mm512_loadu_si512((const void *)(p))
#define ST512(p, v) _mm512_storeu_si512((void *)(p), (v))
#define NT512(p, v) _mm512_stream_si512((void *)(p), (v))
#define LD256(p) _mm256_loadu_si256((const __m256i *)(p))
#define ST256(p, v) _mm256_storeu_si256((__m256i *)(p), (v))
#define NT256(p, v) _mm256_stream_si256((__m256i *)(p), (v))
#define LD128(p) _mm_loadu_si128((const __m128i *)(p))
#define ST128(p, v) _mm_storeu_si128((__m128i *)(p), (v))
#define NT128(p, v) _mm_stream_si128((__m128i *)(p), (v))
#define PF0(p) _mm_prefetch((const char *)(p), _MM_HINT_T0)

/* A linear copy loop: align dst to 64, then 256 bytes per iteration (all loads, then all stores,
 * plus one prefetch step of the next run's source, and with PFD of its destination), then 64 bytes
 * per iteration, then memcpy for the tail. */
#define DEFINE_LINEAR(NAME, TARGET, VT, W, LD, ST, PFD)                                               \
    TARGET static void NAME(char *d, const char *s, size_t n, const char *pf, const char *pfd,        \
                            size_t pfn) {                                                             \
        const char *pfe = pf + pfn;                                                                   \
        for (; n >= 256; n -= 256, d += 256, s += 256) {                                              \
            VT v[256 / (W)];                                                                          \
            if (pf < pfe) {                                                                           \
                PREFETCH4(pf);                                                                        \
                if (PFD) PREFETCH4(pfd);                                                              \
                pf += 256;                                                                            \
                pfd += 256;                                                                           \
            }                                                                                         \
            UNROLL for (int i = 0; i < 256 / (W); i++) v[i] = LD(s + i * (W));                        \
            UNROLL for (int i = 0; i < 256 / (W); i++) ST(d + i * (W), v[i]);                         \
        }                                                                                             \
        for (; n >= 64; n -= 64, d += 64, s += 64) {                                                  \
            VT v[64 / (W)];                                                                           \
            UNROLL for (int i = 0; i < 64 / (W); i++) v[i] = LD(s + i * (W));                         \
            UNROLL for (int i = 0; i < 64 / (W); i++) ST(d + i * (W), v[i]);                          \
        }                                                                                             \
        if (n) memcpy(d, s, n);                                                                       \
    }

/* The page-interleaved streaming loop: whole groups of KVDD_PAGES pages, STEP bytes of each page per
 * step (loads of all pages first, then the non-temporal stores), the source KVDD_PF_AHEAD steps
 * ahead prefetched. Returns the bytes it left (< GROUP) for the linear loop. */
#define DEFINE_PAGED(NAME, TARGET, VT, W, LD, NT)                                                     \
    TARGET static size_t NAME(char **dp, const char **sp, size_t n) {                                 \
        char *d = *dp;                                                                                \
        const char *s = *sp;                                                                          \
        enum { STEP = 4 * (W), V = STEP / (W) };                                                      \
        for (; n >= GROUP; n -= GROUP, d += GROUP, s += GROUP) {                                      \
            for (size_t o = 0; o < PAGE; o += STEP) {                                                 \
                VT v[KVDD_PAGES][V];                                                                  \
                UNROLL for (int p = 0; p < KVDD_PAGES; p++) {                                         \
                    const char *q = s + (size_t)p * PAGE + o;                                         \
                    UNROLL for (int l = 0; l < STEP; l += 64) PF0(q + KVDD_PF_AHEAD * STEP + l);      \
                    UNROLL for (int i = 0; i < V; i++) v[p][i] = LD(q + i * (W));                     \
                }                                                                                     \
                UNROLL for (int p = 0; p < KVDD_PAGES; p++) {                                         \
                    char *q = d + (size_t)p * PAGE + o;                                               \
                    UNROLL for (int i = 0; i < V; i++) NT(q + i * (W), v[p][i]);                      \
                }                                                                                     \
            }                                                                                         \
        }                                                                                             \
        *dp = d;                                                                                      \
        *sp = s;                                                                                      \
        return n;                                                                                     \
    }

#define T_AVX512 __attribute__((target("avx512f")))
#define T_AVX2 __attribute__((target("avx2")))
#define T_SSE2

DEFINE_LINEAR(stream_avx512, T_AVX512, __m512i, 64, LD512, NT512, 0)
DEFINE_LINEAR(regular_avx512, T_AVX512, __m512i, 64, LD512, ST512, 1)
DEFINE_PAGED(paged_avx512, T_AVX512, __m512i, 64, LD512, NT512)
DEFINE_LINEAR(stream_avx2, T_AVX2, __m256i, 32, LD256, NT256, 0)
DEFINE_LINEAR(regular_avx2, T_AVX2, __m256i, 32, LD256, ST256, 1)
DEFINE_PAGED(paged_avx2, T_AVX2, __m256i, 32, LD256, NT256)
DEFINE_LINEAR(stream_sse2, T_SSE2, __m128i, 16, LD128, NT128, 0)
DEFINE_LINEAR(regular_sse2, T_SSE2, __m128i, 16, LD128, ST128, 1)
DEFINE_PAGED(paged_sse2, T_SSE2, __m128i, 16, LD128, NT128)

static inline void stream_fence(int isa, int stream) {
    if (stream && isa != KVDD_ISA_MEMCPY) _mm_sfence();
}
#endif /* KVDD_X86 */

#if KVDD_NEON
/* aarch64: 64 bytes per step as four q registers, stored with two STNP (store pair, non-temporal
 * hint). The linear loop serves both modes (regular: STP); the paged loop is the x86 one with NEON. */
static inline void neon_st2(char *p, uint8x16_t a, uint8x16_t b, int nt) {
    if (nt)
        __asm__ volatile("stnp %q0, %q1, [%2]" : : "w"(a), "w"(b), "r"(p) : "memory");
    else
        __asm__ volatile("stp %q0, %q1, [%2]" : : "w"(a), "w"(b), "r"(p) : "memory");
}

static void neon_linear(char *d, const char *s, size_t n, const char *pf, size_t pfn, int nt) {
    const char *pfe = pf + pfn;
    for (; n >= 64; n -= 64, d += 64, s += 64) {
        if (pf < pfe) {
            __builtin_prefetch(pf, 0, 2);
            pf += 64;
        }
        uint8x16_t a = vld1q_u8((const uint8_t *)s), b = vld1q_u8((const uint8_t *)s + 16);
        uint8x16_t c = vld1q_u8((const uint8_t *)s + 32), e = vld1q_u8((const uint8_t *)s + 48);
        neon_st2(d, a, b, nt);
        neon_st2(d + 32, c, e, nt);
    }
    if (n) memcpy(d, s, n);
}

static size_t neon_paged(char **dp, const char **sp, size_t n) {
    char *d = *dp;
    const char *s = *sp;
    for (; n >= GROUP; n -= GROUP, d += GROUP, s += GROUP) {
        for (size_t o = 0; o < PAGE; o += 64) {
            uint8x16_t v[KVDD_PAGES][4];
            UNROLL for (int p = 0; p < KVDD_PAGES; p++) {
                const uint8_t *q = (const uint8_t *)s + (size_t)p * PAGE + o;
                __builtin_prefetch(q + KVDD_PF_AHEAD * 64, 0, 0);
                UNROLL for (int i = 0; i < 4; i++) v[p][i] = vld1q_u8(q + 16 * i);
            }
            UNROLL for (int p = 0; p < KVDD_PAGES; p++) {
                char *q = d + (size_t)p * PAGE + o;
                neon_st2(q, v[p][0], v[p][1], 1);
                neon_st2(q + 32, v[p][2], v[p][3], 1);
            }
        }
    }
    *dp = d;
    *sp = s;
    return n;
}

static inline void stream_fence(int isa, int stream) {
    /* STNP stores are ordered like other stores for this thread; a store barrier makes them visible
     * to the other thread before the job's completion is published. */
    if (stream && isa != KVDD_ISA_MEMCPY) __asm__ volatile("dmb ishst" : : : "memory");
}
#endif /* KVDD_NEON */

#if !KVDD_X86 && !KVDD_NEON
static inline void stream_fence(int isa, int stream) {
    (void)isa;
    (void)stream;
}
#endif

/* One run with memmove semantics. Vector loops only when `isa` allows it, the run is long enough and
 * source and destination do not overlap: streaming stores when `stream` (page-interleaved for runs of
 * at least KVDD_PAGED_MIN bytes), otherwise regular stores when the next run (source `next`, `next_n`
 * bytes) is short enough to be worth prefetching, else memmove (glibc's is as fast as a vector loop
 * for long runs). */
static inline void copy_run(int isa, int stream, uintptr_t d, uintptr_t s, size_t n, uintptr_t next,
                            uintptr_t next_d, size_t next_n) {
#if KVDD_X86 || KVDD_NEON
    if (isa != KVDD_ISA_MEMCPY && n >= KVDD_NT_MIN_RUN && (d + n <= s || s + n <= d)) {
        if (next_n > KVDD_PF_MAX_RUN) next_n = 0;
        if (next_n > n) next_n = n;
        const char *pf = (const char *)next, *pfd = (const char *)next_d;
        char *dp = (char *)d;
        const char *sp = (const char *)s;
        (void)pfd;
        if (stream) {
            n = align_head(&dp, &sp, n);
#if KVDD_X86
            switch (isa) {
            case KVDD_ISA_AVX512:
                if (n >= KVDD_PAGED_MIN) n = paged_avx512(&dp, &sp, n);
                stream_avx512(dp, sp, n, pf, pfd, next_n);
                return;
            case KVDD_ISA_AVX2:
                if (n >= KVDD_PAGED_MIN) n = paged_avx2(&dp, &sp, n);
                stream_avx2(dp, sp, n, pf, pfd, next_n);
                return;
            default:
                if (n >= KVDD_PAGED_MIN) n = paged_sse2(&dp, &sp, n);
                stream_sse2(dp, sp, n, pf, pfd, next_n);
                return;
            }
#else
            if (n >= KVDD_PAGED_MIN) n = neon_paged(&dp, &sp, n);
            neon_linear(dp, sp, n, pf, next_n, 1);
            return;
#endif
        } else if (next_n) {
#if KVDD_X86
            n = align_head(&dp, &sp, n);
            switch (isa) {
            case KVDD_ISA_AVX512: regular_avx512(dp, sp, n, pf, pfd, next_n); return;
            case KVDD_ISA_AVX2: regular_avx2(dp, sp, n, pf, pfd, next_n); return;
            default: regular_sse2(dp, sp, n, pf, pfd, next_n); return;
            }
#else
            n = align_head(&dp, &sp, n);
            neon_linear(dp, sp, n, pf, next_n, 0);
            return;
#endif
        }
    }
#else
    (void)isa;
    (void)stream;
    (void)next;
    (void)next_d;
    (void)next_n;
#endif
    memmove((void *)d, (const void *)s, n);
}

void kvdd_copy_one(int isa, void *dst, const void *src, size_t n) {
    if (isa < 0 || isa >= KVDD_ISA_COUNT || !(kvdd_isa_mask() & (1u << isa))) isa = KVDD_ISA_MEMCPY;
    copy_run(isa, 1, (uintptr_t)dst, (uintptr_t)src, n, 0, 0, 0);
    stream_fence(isa, 1);
}

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

/* ------------------------------------------------------------------------------------------------ */
/* Execution                                                                                         */

static uint64_t run_serial(const kvdd_job *job) {
    const int isa = job->isa, stream = job->stream;
    for (size_t k = 0; k < job->K; k++) {
        uintptr_t sb = job->pairs[k].src, db = job->pairs[k].dst;
        for (size_t j = 0; j < job->J; j++) {
            size_t n = (size_t)job->len[j];
            if (!n) continue;
            uintptr_t nx = 0, nd = 0;
            size_t nn = 0;
            if (j + 1 < job->J) {
                nx = sb + (uintptr_t)job->soff[j + 1];
                nd = db + (uintptr_t)job->doff[j + 1];
                nn = (size_t)job->len[j + 1];
            }
            copy_run(isa, stream, db + (uintptr_t)job->doff[j], sb + (uintptr_t)job->soff[j], n, nx, nd, nn);
        }
    }
    stream_fence(isa, stream);
    return (uint64_t)job->K * job->per_k;
}

/* 2-thread path: the job's bytes, in (k, j) order, are cut into chunks that both threads claim from a
 * shared counter, so a thread that starts late or is descheduled only does fewer chunks (the caller
 * never waits for the helper to start). The helper is a detached thread created per call; the shared
 * state is reference counted so the caller may return while the helper has yet to run. Creating a
 * thread per call costs ~10-30 us and is only done for multi-MiB jobs; it keeps nothing alive between
 * calls and is safe across fork(). */
typedef struct {
    kvdd_job job;
    const uint64_t *prefix; /* J + 1 cumulative lengths */
    uint64_t nchunks;
    _Atomic uint64_t next;
    _Atomic uint64_t done;
    _Atomic int refs;
} shared_state;

static void release_state(shared_state *st) {
    if (atomic_fetch_sub_explicit(&st->refs, 1, memory_order_acq_rel) == 1) free(st);
}

static void copy_chunk(const shared_state *st, uint64_t c) {
    const kvdd_job *job = &st->job;
    uint64_t total = (uint64_t)job->K * job->per_k;
    uint64_t pos = c * job->chunk;
    uint64_t end = pos + job->chunk < total ? pos + job->chunk : total;
    size_t k = (size_t)(pos / job->per_k);
    uint64_t r = pos % job->per_k;
    /* run j containing byte r of tensor k: last j with prefix[j] <= r (and len[j] > 0) */
    size_t lo = 0, hi = job->J;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (st->prefix[mid + 1] <= r) lo = mid + 1;
        else hi = mid;
    }
    size_t j = lo;
    uint64_t o = r - st->prefix[j];
    while (pos < end) {
        uint64_t n = (uint64_t)job->len[j] - o;
        if (n > end - pos) n = end - pos;
        if (n) {
            uintptr_t sb = job->pairs[k].src, db = job->pairs[k].dst, nx = 0, nd = 0;
            size_t nn = 0;
            if (j + 1 < job->J && pos + n < end) {
                nx = sb + (uintptr_t)job->soff[j + 1];
                nd = db + (uintptr_t)job->doff[j + 1];
                nn = (size_t)job->len[j + 1];
            }
            copy_run(job->isa, job->stream, db + (uintptr_t)job->doff[j] + (uintptr_t)o,
                     sb + (uintptr_t)job->soff[j] + (uintptr_t)o, (size_t)n, nx, nd, nn);
        }
        pos += n;
        o = 0;
        if (++j == job->J) {
            j = 0;
            k++;
        }
    }
}

static uint64_t work(shared_state *st) {
    uint64_t mine = 0;
    for (;;) {
        uint64_t c = atomic_fetch_add_explicit(&st->next, 1, memory_order_relaxed);
        if (c >= st->nchunks) break;
        copy_chunk(st, c);
        mine++;
    }
    if (mine) {
        stream_fence(st->job.isa, st->job.stream);
        atomic_fetch_add_explicit(&st->done, mine, memory_order_release);
    }
    return mine;
}

static _Atomic uint64_t stat_calls, stat_chunks, stat_helper_chunks, stat_stalls;
static _Atomic int64_t backoff_until_ns;

void kvdd_thread_stats(uint64_t out[4]) {
    out[0] = atomic_load_explicit(&stat_calls, memory_order_relaxed);
    out[1] = atomic_load_explicit(&stat_chunks, memory_order_relaxed);
    out[2] = atomic_load_explicit(&stat_helper_chunks, memory_order_relaxed);
    out[3] = atomic_load_explicit(&stat_stalls, memory_order_relaxed);
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

int kvdd_auto_threads_allowed(void) {
    /* A busy machine shows in the measured start latency of the helper (kvdd_threads_min_bytes grows
     * with it) and in stalls: after one, automatic mode stays on one thread for KVDD_BACKOFF_NS. */
    return now_ns() >= atomic_load_explicit(&backoff_until_ns, memory_order_relaxed);
}

/* The cost model of the automatic thread choice, from this process's own calls: what a 2-thread call
 * costs its caller beyond its own share of the work (posting the work or starting a helper, plus
 * waiting at the end for the item the helper is still copying: a helper that starts late costs
 * nothing else, it only does less), and the time per byte of one-thread copies of at least
 * KVDD_CHUNK_MIN bytes (both exponential moving averages, weight 1/8). */
static _Atomic int64_t model_cost_ns = KVDD_MODEL_COST_NS;
static _Atomic int64_t model_ps_per_byte = KVDD_MODEL_PS_PER_BYTE;

static void model_update(_Atomic int64_t *avg, int64_t sample) {
    int64_t old = atomic_load_explicit(avg, memory_order_relaxed);
    atomic_store_explicit(avg, old + (sample - old) / 8, memory_order_relaxed);
}

void kvdd_threads_model(int64_t out[2]) {
    out[0] = atomic_load_explicit(&model_cost_ns, memory_order_relaxed);
    out[1] = atomic_load_explicit(&model_ps_per_byte, memory_order_relaxed);
}

int kvdd_threads_probe(void) {
    static _Atomic uint32_t n;
    return atomic_fetch_add_explicit(&n, 1, memory_order_relaxed) % KVDD_PROBE_EVERY == 0;
}

uint64_t kvdd_threads_min_bytes(void) {
    /* Two threads save up to half the one-thread time and cost the caller `extra`: worth it when
     * the saving is at least twice that, i.e. bytes * cost / 2 >= 2 * extra. */
    int64_t start = atomic_load_explicit(&model_cost_ns, memory_order_relaxed);
    int64_t ps = atomic_load_explicit(&model_ps_per_byte, memory_order_relaxed);
    if (ps < 1) ps = 1;
    uint64_t n = (uint64_t)(start > 0 ? start : 0) * 4000u / (uint64_t)ps;
    return n < KVDD_CHUNK_MIN ? KVDD_CHUNK_MIN : n;
}

static void run_helper_share(shared_state *st) {
    uint64_t mine = work(st);
    atomic_fetch_add_explicit(&stat_helper_chunks, mine, memory_order_relaxed);
    release_state(st);
}

static void *helper_main(void *arg) {
    run_helper_share(arg);
    return NULL;
}

static inline void cpu_relax(void) {
#if KVDD_X86
    _mm_pause();
#elif KVDD_NEON
    __asm__ volatile("yield");
#endif
}

/* Exclude the caller's CPU from `cpus` (1 when that leaves another CPU). */
static int other_cpus(cpu_set_t *cpus) {
#if defined(__GLIBC__)
    int me = sched_getcpu();
    if (me >= 0 && me < CPU_SETSIZE && sched_getaffinity(0, sizeof(*cpus), cpus) == 0 &&
        CPU_ISSET((size_t)me, cpus) && CPU_COUNT(cpus) > 1) {
        CPU_CLR((size_t)me, cpus);
        return 1;
    }
#else
    (void)cpus;
#endif
    return 0;
}

/* A helper started for one call: a detached thread on another CPU than the caller's (left to itself
 * the scheduler may queue a new thread behind its parent on a 2-CPU machine and migrate it only at
 * the next balancing tick, milliseconds later, by which time the caller has done all the work). */
static int start_helper(shared_state *st) {
    pthread_t th;
    pthread_attr_t attr;
    int started = 0;
    if (pthread_attr_init(&attr) != 0) return 0;
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&attr, 256 * 1024);
#if defined(__GLIBC__)
    cpu_set_t cpus;
    if (other_cpus(&cpus)) pthread_attr_setaffinity_np(&attr, sizeof(cpus), &cpus);
#endif
    started = pthread_create(&th, &attr, helper_main, st) == 0;
    pthread_attr_destroy(&attr);
    return started;
}

/* The resident helper: started at the first 2-thread call and kept, so later calls do not pay for a
 * thread start (~20-30 us). After each share of work it spins for KVDD_HELPER_SPIN_NS waiting for
 * the next post (per-layer pulls post every 100-200 us), then sleeps on a condition variable. Only
 * one post at a time: a caller that finds the helper taken starts a per-call helper instead. After
 * fork() the child has no helper thread (pthread_atfork resets the state; the next call starts one). */
static pthread_mutex_t res_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t res_cv = PTHREAD_COND_INITIALIZER;
static shared_state *_Atomic res_post;  /* posted and not yet taken */
static _Atomic int res_busy;            /* 1 from a post until the helper is idle again */
static int res_running, res_sleeping;    /* under res_mu */
static pthread_t res_thread;
static int res_cpu = -1;                 /* the caller CPU the helper's affinity excludes */
static pthread_once_t res_once = PTHREAD_ONCE_INIT;

static void res_after_fork(void) {
    pthread_mutex_init(&res_mu, NULL);
    pthread_cond_init(&res_cv, NULL);
    atomic_store_explicit(&res_post, NULL, memory_order_relaxed);
    atomic_store_explicit(&res_busy, 0, memory_order_relaxed);
    res_running = res_sleeping = 0;
    res_cpu = -1;
}

static void res_init(void) { pthread_atfork(NULL, NULL, res_after_fork); }

static void *res_main(void *arg) {
    (void)arg;
    for (;;) {
        shared_state *st = NULL;
        int64_t until = now_ns() + KVDD_HELPER_SPIN_NS;
        while ((st = atomic_exchange_explicit(&res_post, NULL, memory_order_acquire)) == NULL) {
            if (now_ns() < until) {
                cpu_relax();
                continue;
            }
            pthread_mutex_lock(&res_mu);
            res_sleeping = 1;
            while ((st = atomic_exchange_explicit(&res_post, NULL, memory_order_acquire)) == NULL)
                pthread_cond_wait(&res_cv, &res_mu);
            res_sleeping = 0;
            pthread_mutex_unlock(&res_mu);
            break;
        }
        run_helper_share(st);
        atomic_store_explicit(&res_busy, 0, memory_order_release);
    }
    return NULL;
}

/* Post `st` to the resident helper (starting it if needed): 1, or 2 when this call started it; 0 when
 * it is taken or cannot start. */
static int post_resident(shared_state *st) {
    int idle = 0;
    if (!atomic_compare_exchange_strong_explicit(&res_busy, &idle, 1, memory_order_acq_rel,
                                                 memory_order_relaxed))
        return 0;
    pthread_once(&res_once, res_init);
    pthread_mutex_lock(&res_mu);
    int created = 0;
    if (!res_running) {
        pthread_attr_t attr;
        if (pthread_attr_init(&attr) == 0) {
            pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
            pthread_attr_setstacksize(&attr, 256 * 1024);
            res_running = created = pthread_create(&res_thread, &attr, res_main, NULL) == 0;
            pthread_attr_destroy(&attr);
        }
        res_cpu = -1;
    }
    if (!res_running) {
        pthread_mutex_unlock(&res_mu);
        atomic_store_explicit(&res_busy, 0, memory_order_release);
        return 0;
    }
#if defined(__GLIBC__)
    int me = sched_getcpu();
    if (me != res_cpu) { /* keep the helper off the caller's CPU (one syscall when the caller moved) */
        cpu_set_t cpus;
        if (other_cpus(&cpus)) pthread_setaffinity_np(res_thread, sizeof(cpus), &cpus);
        res_cpu = me;
    }
#endif
    atomic_store_explicit(&res_post, st, memory_order_release);
    if (res_sleeping) pthread_cond_signal(&res_cv);
    pthread_mutex_unlock(&res_mu);
    return created ? 2 : 1;
}

/* After the caller's work: take the post back if the helper never took it (then it is not busy). */
static int retract_resident(shared_state *st) {
    shared_state *expected = st;
    if (atomic_compare_exchange_strong_explicit(&res_post, &expected, NULL, memory_order_acq_rel,
                                                memory_order_relaxed)) {
        atomic_store_explicit(&res_busy, 0, memory_order_release);
        return 1;
    }
    return 0;
}

static uint64_t run_two(const kvdd_job *job) {
    uint64_t total = (uint64_t)job->K * job->per_k;
    uint64_t chunk = job->chunk;
    if (!chunk) { /* automatic: about 32 work items, 256 KiB to 1 MiB each */
        chunk = total / 32;
        if (chunk < KVDD_CHUNK_MIN) chunk = KVDD_CHUNK_MIN;
        if (chunk > KVDD_CHUNK_MAX) chunk = KVDD_CHUNK_MAX;
    }
    uint64_t *prefix = malloc((job->J + 1) * sizeof(uint64_t));
    shared_state *st = malloc(sizeof(shared_state));
    if (!prefix || !st) {
        free(prefix);
        free(st);
        return run_serial(job);
    }
    prefix[0] = 0;
    for (size_t j = 0; j < job->J; j++) prefix[j + 1] = prefix[j] + (uint64_t)job->len[j];
    st->job = *job;
    st->job.chunk = chunk;
    st->prefix = prefix;
    st->nchunks = (total + chunk - 1) / chunk;
    atomic_init(&st->next, 0);
    atomic_init(&st->done, 0);
    atomic_init(&st->refs, 2);

    int64_t posted = now_ns();
    int resident = post_resident(st);
    if (!resident && !start_helper(st)) atomic_store_explicit(&st->refs, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&stat_calls, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&stat_chunks, st->nchunks, memory_order_relaxed);

    int64_t t0 = now_ns();
    uint64_t mine = work(st);
    int64_t t1 = now_ns();
    /* Wait only for chunks the helper has claimed and not finished (at most one). */
    unsigned spins = 0;
    while (atomic_load_explicit(&st->done, memory_order_acquire) < st->nchunks) {
        if (++spins < 2000) {
#if KVDD_X86
            _mm_pause();
#endif
        } else {
            sched_yield();
        }
    }
    int64_t t2 = now_ns();
    if (resident && retract_resident(st)) release_state(st); /* the helper's reference, never taken */
    /* The first call of the resident helper pays for creating it once: not a cost of later calls. */
    if (resident != 2) model_update(&model_cost_ns, (t0 - posted) + (t2 - t1));
    /* A helper that was descheduled mid-chunk (we waited > 1 ms and > 1/4 of our own work) or that
     * did nothing during 2 ms of our work means the other CPU is busy: automatic mode then stays on
     * one thread for KVDD_BACKOFF_NS. */
    if (resident != 2 &&
        ((t2 - t1 > 1000000 && t2 - t1 > (t1 - t0) / 4) || (mine == st->nchunks && t1 - t0 > 2000000))) {
        atomic_fetch_add_explicit(&stat_stalls, 1, memory_order_relaxed);
        atomic_store_explicit(&backoff_until_ns, t2 + KVDD_BACKOFF_NS, memory_order_relaxed);
    }
    release_state(st);
    free(prefix); /* the helper reads prefix only for chunks it claimed, all of which are done */
    return total;
}

uint64_t kvdd_job_run(const kvdd_job *job) {
    if (job->K == 0 || job->per_k == 0) return 0;
    if (job->threads == 2) return run_two(job);
    uint64_t total = (uint64_t)job->K * job->per_k;
    if (total < KVDD_CHUNK_MIN) return run_serial(job);
    int64_t t0 = now_ns();
    run_serial(job);
    int64_t dt = now_ns() - t0;
    model_update(&model_ps_per_byte, (int64_t)((uint64_t)dt * 1000u / total));
    return total;
}
