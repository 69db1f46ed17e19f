/* Copy kernels of the kvdd simulator (C side of kvdd/_native/_copy.pyx).
 *
 * Everything here runs without the GIL and never touches Python objects. The Cython module validates
 * every run against its regions and snapshots the run arrays before it calls kvdd_job_run(); the C code
 * trusts a job completely.
 */
#ifndef KVDD_COPY_IMPL_H
#define KVDD_COPY_IMPL_H

#include <stddef.h>
#include <stdint.h>

/* Vector implementations, best last. KVDD_ISA_MEMCPY = memcpy/memmove only (no streaming stores). */
#define KVDD_ISA_MEMCPY 0
#define KVDD_ISA_SSE2 1
#define KVDD_ISA_AVX2 2
#define KVDD_ISA_AVX512 3
#define KVDD_ISA_NEON 4 /* aarch64 */
#define KVDD_ISA_COUNT 5

/* Runs shorter than this are always copied with memmove, even in streaming mode. */
#define KVDD_NT_MIN_RUN 512
/* In streaming mode the source of the next run is prefetched when that run is at most this long. */
#define KVDD_PF_MAX_RUN 32768
/* Streaming runs of at least KVDD_PAGED_MIN bytes are copied KVDD_PAGES pages at a time, interleaved,
 * each page's source prefetched KVDD_PF_AHEAD steps ahead. */
#ifndef KVDD_PAGES
#define KVDD_PAGES 4
#endif
#ifndef KVDD_PAGED_MIN
#define KVDD_PAGED_MIN ((size_t)KVDD_PAGES * 4096u)
#endif
#ifndef KVDD_PF_AHEAD
#define KVDD_PF_AHEAD 1
#endif

typedef struct {
    uintptr_t src;  /* base address of the source region of tensor k */
    uintptr_t dst;  /* base address of the destination region of tensor k */
} kvdd_pair;

typedef struct {
    const kvdd_pair *pairs; /* K pairs */
    size_t K;
    const int64_t *soff; /* J source offsets (validated: >= 0, soff + len <= every source region) */
    const int64_t *doff; /* J destination offsets (validated likewise) */
    const int64_t *len;  /* J lengths (>= 0) */
    size_t J;
    uint64_t per_k;      /* sum(len) */
    int isa;             /* vector implementation to use (KVDD_ISA_MEMCPY: memmove for every run) */
    int stream;          /* 1: non-temporal stores for long non-overlapping runs */
    int threads;         /* 1 or 2 */
    uint64_t chunk;      /* bytes per work item of the 2-thread path (0: automatic) */
} kvdd_job;

/* Bit i set: ISA i usable on this CPU (bit KVDD_ISA_MEMCPY always set). */
unsigned kvdd_isa_mask(void);
/* Best usable ISA. */
int kvdd_isa_best(void);
/* CPU features for diagnostics: the names and values of the flags checked at run time. */
int kvdd_cpu_feature_count(void);
const char *kvdd_cpu_feature_name(int i);
int kvdd_cpu_feature_value(int i);

/* 1 when no byte written by one (k, j) run is read or written by another run of the same job, so the
 * runs can execute in any order (the condition for the 2-thread path); 0 when that cannot be shown
 * cheaply (the job then runs in order on one thread). Never reads or writes the regions. */
int kvdd_job_independent(const kvdd_job *job);

/* Execute the job: for k, for j (in order unless job->threads == 2, which the caller only sets for
 * independent jobs), memmove semantics per run. Returns the number of bytes copied. When the 2-thread
 * path cannot start a thread it copies everything on the calling thread. */
uint64_t kvdd_job_run(const kvdd_job *job);

/* Work items of the 2-thread path when kvdd_job.chunk is 0: total / 32 clamped to these ... */
#define KVDD_CHUNK_MIN ((uint64_t)256 << 10)
#define KVDD_CHUNK_MAX ((uint64_t)1 << 20)
/* ... except the last 2 items' worth, cut into items of a quarter, at least this. */
#define KVDD_CHUNK_TAIL ((uint64_t)64 << 10)
/* The resident helper thread spins this long for the next call before it sleeps. */
#define KVDD_HELPER_SPIN_NS ((int64_t)200000)
/* After a 2-thread call stalled, automatic mode uses one thread for KVDD_BACKOFF_FACTOR times what
 * the stall cost the caller (its wait for the helper), clamped to [KVDD_BACKOFF_MIN_NS,
 * KVDD_BACKOFF_MAX_NS]: stalls then cost at most about 1% of the caller's time, and a sporadic one
 * does not keep the process on one thread for long. */
#define KVDD_BACKOFF_FACTOR 100
#define KVDD_BACKOFF_MIN_NS ((int64_t)50000000)
#define KVDD_BACKOFF_MAX_NS ((int64_t)2000000000)

/* The automatic thread choice (threads=0 without a fixed threshold): two threads from
 * kvdd_threads_min_bytes(), computed from this process's measured costs (kvdd_threads_model: out[0] what
 * a 2-thread call costs its caller beyond its share in ns, out[1] one thread's copy time in ps per
 * byte), initially these: */
#define KVDD_MODEL_COST_NS ((int64_t)30000)
#define KVDD_MODEL_PS_PER_BYTE ((int64_t)100)
/* The 2-thread cost is the median of this many recent calls. */
#define KVDD_COST_SAMPLES 15u
uint64_t kvdd_threads_min_bytes(void);
/* 1 for every KVDD_PROBE_EVERY-th call: a call of at least KVDD_CHUNK_MIN bytes that the model keeps on
 * one thread then uses two anyway, so the measured cost follows the machine (a model that learned
 * "expensive" on a busy machine would otherwise never measure again). */
#define KVDD_PROBE_EVERY 32u
int kvdd_threads_probe(void);
void kvdd_threads_model(int64_t out[2]);
/* Last-level cache size in bytes (0: unknown). */
uint64_t kvdd_llc_bytes(void);
/* Per-core L2 cache size in bytes (0: unknown). */
uint64_t kvdd_l2_bytes(void);

/* Counters since the module was loaded: of the 2-thread path calls, chunks, chunks done by helpers,
 * stalls (calls after which automatic mode backed off to one thread); of all jobs that moved bytes
 * their number and the nanoseconds spent in kvdd_job_run; of the 2-thread path the nanoseconds spent
 * posting the work and waiting for the helper's last items, the helper's moves off a caller's new CPU
 * and its wake-ups from sleep. */
#define KVDD_STATS 10
void kvdd_thread_stats(uint64_t out[KVDD_STATS]);
/* 0 while automatic mode is backing off after a stall. */
int kvdd_auto_threads_allowed(void);

/* One contiguous copy with streaming stores of `isa` (memmove when they overlap or for KVDD_ISA_MEMCPY);
 * sfence after. */
void kvdd_copy_one(int isa, void *dst, const void *src, size_t n);

#endif
