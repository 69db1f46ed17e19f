/* Copy kernels of the kvdd simulator, the per-run part: CPU features and cache sizes, the vector
 * loops, and kvdd_copy_run (one run with memmove semantics). The jobs, the independence check and the
 * 2-thread path are in _copy_impl.c; see _copy_impl.h and the notes at the top of _copy.pyx.
 *
 * Portable C11 plus, on x86-64, function-level target attributes for the streaming-store loops,
 * chosen at run time with __builtin_cpu_supports (so the shipped build needs no -march flag and never
 * executes an instruction the CPU lacks); on aarch64, NEON loads with STNP (non-temporal store pair)
 * stores (NEON is part of the aarch64 base ISA). Other architectures use memcpy/memmove throughout.
 * KVDD_NO_SIMD builds the memcpy path only.
 */
#define _GNU_SOURCE
#include "_copy_impl.h"
#include "_copy_kernels.h"

#include <fcntl.h>
#include <stdio.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#if KVDD_X86
#include <immintrin.h>
#endif
#if KVDD_NEON
#include <arm_neon.h>
#endif

/* ------------------------------------------------------------------------------------------------ */
/* CPU features                                                                                      */

static const char *const feature_names[] = {"x86_64", "sse2", "avx2", "avx512f", "erms", "fsrm", "aarch64_neon"};
#define N_FEATURES ((int)(sizeof(feature_names) / sizeof(feature_names[0])))

static int features[N_FEATURES];
static unsigned isa_mask;
static int isa_best;
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
#define PF1(p) _mm_prefetch((const char *)(p), _MM_HINT_T1)

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
 * ahead prefetched; and [*pf, *pf + *pfn), the next short run's source, prefetched into L2 spread
 * evenly over the steps (a run of a few pages otherwise starts every page cold: scattered 16 KiB
 * runs copied ~10-20% slower than one contiguous copy of the same bytes, about as fast with it).
 * Returns the bytes it left (< GROUP) for the linear loop; *pf and *pfn are what it did not
 * prefetch. */
#define DEFINE_PAGED(NAME, TARGET, VT, W, LD, NT)                                                     \
    TARGET static size_t NAME(char **dp, const char **sp, size_t n, const char **pfp, size_t *pfnp) { \
        char *d = *dp;                                                                                \
        const char *s = *sp;                                                                          \
        enum { STEP = 4 * (W), V = STEP / (W) };                                                      \
        const char *pf = *pfp, *pfe = *pfp + *pfnp;                                                   \
        size_t steps = (n / GROUP) * (PAGE / STEP);                                                   \
        size_t pf_step = ((*pfnp + steps - 1) / steps + 63) & ~(size_t)63; /* steps >= 1 */          \
        for (; n >= GROUP; n -= GROUP, d += GROUP, s += GROUP) {                                      \
            for (size_t o = 0; o < PAGE; o += STEP) {                                                 \
                VT v[KVDD_PAGES][V];                                                                  \
                if (pf < pfe) {                                                                       \
                    for (size_t l = 0; l < pf_step; l += 64) PF1(pf + l);                             \
                    pf += pf_step;                                                                    \
                }                                                                                     \
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
        *pfnp = pf < pfe ? (size_t)(pfe - pf) : 0;                                                    \
        *pfp = pf;                                                                                    \
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

void kvdd_stream_fence(int isa, int stream) {
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

static size_t neon_paged(char **dp, const char **sp, size_t n, const char **pfp, size_t *pfnp) {
    char *d = *dp;
    const char *s = *sp;
    const char *pf = *pfp, *pfe = *pfp + *pfnp; /* the next short run: as in DEFINE_PAGED */
    size_t steps = (n / GROUP) * (PAGE / 64);
    size_t pf_step = ((*pfnp + steps - 1) / steps + 63) & ~(size_t)63;
    for (; n >= GROUP; n -= GROUP, d += GROUP, s += GROUP) {
        for (size_t o = 0; o < PAGE; o += 64) {
            uint8x16_t v[KVDD_PAGES][4];
            if (pf < pfe) {
                for (size_t l = 0; l < pf_step; l += 64) __builtin_prefetch(pf + l, 0, 2);
                pf += pf_step;
            }
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
    *pfnp = pf < pfe ? (size_t)(pfe - pf) : 0;
    *pfp = pf;
    return n;
}

void kvdd_stream_fence(int isa, int stream) {
    /* STNP stores are ordered like other stores for this thread; a store barrier makes them visible
     * to the other thread before the job's completion is published. */
    if (stream && isa != KVDD_ISA_MEMCPY) __asm__ volatile("dmb ishst" : : : "memory");
}
#endif /* KVDD_NEON */

#if !KVDD_X86 && !KVDD_NEON
void kvdd_stream_fence(int isa, int stream) {
    (void)isa;
    (void)stream;
}
#endif

/* One run with memmove semantics. Vector loops only when `isa` allows it, the run is long enough and
 * source and destination do not overlap: streaming stores when `stream` (page-interleaved for runs of
 * at least KVDD_PAGED_MIN bytes), otherwise regular stores when the next run (source `next`, `next_n`
 * bytes) is short enough to be worth prefetching, else memmove (glibc's is as fast as a vector loop
 * for long runs). */
void kvdd_copy_run(int isa, int stream, uintptr_t d, uintptr_t s, size_t n, uintptr_t next,
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
                if (n >= KVDD_PAGED_MIN) n = paged_avx512(&dp, &sp, n, &pf, &next_n);
                stream_avx512(dp, sp, n, pf, pfd, next_n);
                return;
            case KVDD_ISA_AVX2:
                if (n >= KVDD_PAGED_MIN) n = paged_avx2(&dp, &sp, n, &pf, &next_n);
                stream_avx2(dp, sp, n, pf, pfd, next_n);
                return;
            default:
                if (n >= KVDD_PAGED_MIN) n = paged_sse2(&dp, &sp, n, &pf, &next_n);
                stream_sse2(dp, sp, n, pf, pfd, next_n);
                return;
            }
#else
            if (n >= KVDD_PAGED_MIN) n = neon_paged(&dp, &sp, n, &pf, &next_n);
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
    kvdd_copy_run(isa, 1, (uintptr_t)dst, (uintptr_t)src, n, 0, 0, 0);
    kvdd_stream_fence(isa, 1);
}
