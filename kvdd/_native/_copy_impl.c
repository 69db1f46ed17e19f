/* Copy kernels of the kvdd simulator, the job part: one-thread and 2-thread execution (the resident
 * helper, the cost model of the automatic thread choice). The per-run vector loops are in
 * _copy_kernels.c, the independence check in _copy_plan.c; see _copy_impl.h and the notes at the top
 * of _copy.pyx.
 */
#define _GNU_SOURCE
#include "_copy_impl.h"
#include "_copy_kernels.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#endif
#if KVDD_X86
#include <immintrin.h>
#endif

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
            } else if (k + 1 < job->K) { /* the next tensor's first run */
                nx = job->pairs[k + 1].src + (uintptr_t)job->soff[0];
                nd = job->pairs[k + 1].dst + (uintptr_t)job->doff[0];
                nn = (size_t)job->len[0];
            }
            kvdd_copy_run(isa, stream, db + (uintptr_t)job->doff[j], sb + (uintptr_t)job->soff[j], n, nx, nd, nn);
        }
    }
    kvdd_stream_fence(isa, stream);
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
    uint64_t head;          /* bytes [0, head) in chunks of job.chunk, the rest in chunks of `small` */
    uint64_t nbig, small;
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
    uint64_t pos, end;
    if (c < st->nbig) {
        pos = c * job->chunk;
        end = pos + job->chunk < st->head ? pos + job->chunk : st->head;
    } else {
        pos = st->head + (c - st->nbig) * st->small;
        end = pos + st->small < total ? pos + st->small : total;
    }
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
            if (pos + n < end && j + 1 < job->J) {
                nx = sb + (uintptr_t)job->soff[j + 1];
                nd = db + (uintptr_t)job->doff[j + 1];
                nn = (size_t)job->len[j + 1];
            } else if (pos + n < end && k + 1 < job->K) { /* the next tensor's first run */
                nx = job->pairs[k + 1].src + (uintptr_t)job->soff[0];
                nd = job->pairs[k + 1].dst + (uintptr_t)job->doff[0];
                nn = (size_t)job->len[0];
            }
            kvdd_copy_run(job->isa, job->stream, db + (uintptr_t)job->doff[j] + (uintptr_t)o,
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
        kvdd_stream_fence(st->job.isa, st->job.stream);
        atomic_fetch_add_explicit(&st->done, mine, memory_order_release);
    }
    return mine;
}

static _Atomic uint64_t stat_calls, stat_chunks, stat_helper_chunks, stat_stalls, stat_jobs, stat_job_ns;
static _Atomic uint64_t stat_post_ns, stat_wait_ns, stat_moves, stat_wakes;
static _Atomic int64_t backoff_until_ns;

void kvdd_thread_stats(uint64_t out[KVDD_STATS]) {
    out[0] = atomic_load_explicit(&stat_calls, memory_order_relaxed);
    out[1] = atomic_load_explicit(&stat_chunks, memory_order_relaxed);
    out[2] = atomic_load_explicit(&stat_helper_chunks, memory_order_relaxed);
    out[3] = atomic_load_explicit(&stat_stalls, memory_order_relaxed);
    out[4] = atomic_load_explicit(&stat_jobs, memory_order_relaxed);
    out[5] = atomic_load_explicit(&stat_job_ns, memory_order_relaxed);
    out[6] = atomic_load_explicit(&stat_post_ns, memory_order_relaxed);
    out[7] = atomic_load_explicit(&stat_wait_ns, memory_order_relaxed);
    out[8] = atomic_load_explicit(&stat_moves, memory_order_relaxed);
    out[9] = atomic_load_explicit(&stat_wakes, memory_order_relaxed);
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

int kvdd_auto_threads_allowed(void) {
    /* A busy machine shows in the measured start latency of the helper (kvdd_threads_min_bytes grows
     * with it) and in stalls: after one, automatic mode stays on one thread for a while (KVDD_BACKOFF_*). */
    return now_ns() >= atomic_load_explicit(&backoff_until_ns, memory_order_relaxed);
}

/* The cost model of the automatic thread choice, from this process's own calls: what a 2-thread call
 * costs its caller beyond its own share of the work (posting the work, which wakes a sleeping helper,
 * plus waiting at the end for the item the helper is still copying: a helper that starts late costs
 * nothing else, it only does less), the median of the last KVDD_COST_SAMPLES calls (a mean let one
 * call whose post or wait was descheduled for milliseconds on a shared VM move the 2-thread size
 * past 16 MiB for dozens of calls); and the time per byte of one-thread copies of at least
 * KVDD_CHUNK_MIN bytes (an exponential moving average, weight 1/8). */
static _Atomic int64_t model_cost_ns = KVDD_MODEL_COST_NS;
static _Atomic int64_t model_ps_per_byte = KVDD_MODEL_PS_PER_BYTE;
static _Atomic int64_t cost_ring[KVDD_COST_SAMPLES];
static _Atomic uint32_t cost_next, cost_count;

static void model_update(_Atomic int64_t *avg, int64_t sample) {
    int64_t old = atomic_load_explicit(avg, memory_order_relaxed);
    atomic_store_explicit(avg, old + (sample - old) / 8, memory_order_relaxed);
}

static void cost_update(int64_t sample) {
    uint32_t i = atomic_fetch_add_explicit(&cost_next, 1, memory_order_relaxed) % KVDD_COST_SAMPLES;
    atomic_store_explicit(&cost_ring[i], sample, memory_order_relaxed);
    uint32_t n = atomic_load_explicit(&cost_count, memory_order_relaxed);
    if (n < KVDD_COST_SAMPLES) atomic_store_explicit(&cost_count, ++n, memory_order_relaxed);
    int64_t v[KVDD_COST_SAMPLES];
    for (uint32_t k = 0; k < n; k++) { /* insertion sort of at most KVDD_COST_SAMPLES values */
        int64_t x = atomic_load_explicit(&cost_ring[k], memory_order_relaxed);
        uint32_t m = k;
        for (; m > 0 && v[m - 1] > x; m--) v[m] = v[m - 1];
        v[m] = x;
    }
    atomic_store_explicit(&model_cost_ns, n ? v[n / 2] : sample, memory_order_relaxed);
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
 * the next post (per-layer pulls post every 100-200 us), then sleeps. Only one post at a time (the
 * caller that wins res_busy owns the post and the helper's bookkeeping until the helper is idle
 * again): a caller that finds the helper taken starts a per-call helper instead. After fork() the
 * child has no helper thread (pthread_atfork resets the state; the next call starts one).
 *
 * Sleeping and waking: on Linux a futex on res_word (the poster bumps it after posting and wakes the
 * helper only when it announced sleep: one FUTEX_WAKE, no mutex, so a helper descheduled while going
 * to sleep never blocks the caller; a wake costs the caller ~10-20 us on a VM, a mutex and condition
 * variable about twice that), elsewhere a condition variable. */
static shared_state *_Atomic res_post;  /* posted and not yet taken */
static _Atomic int res_busy;            /* 1 from a post until the helper is idle again */
static _Atomic int res_sleeping;        /* the helper is (about to be) asleep */
static _Atomic uint32_t res_word;       /* bumped at every post (the futex word) */
static int res_running;                 /* owned by the res_busy holder */
static pthread_t res_thread;
static int res_cpu = -1;                /* the caller CPU the helper's affinity excludes */
static pthread_once_t res_once = PTHREAD_ONCE_INIT;
#if !defined(__linux__)
static pthread_mutex_t res_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t res_cv = PTHREAD_COND_INITIALIZER;
#endif

static void res_after_fork(void) {
#if !defined(__linux__)
    pthread_mutex_init(&res_mu, NULL);
    pthread_cond_init(&res_cv, NULL);
#endif
    atomic_store_explicit(&res_post, NULL, memory_order_relaxed);
    atomic_store_explicit(&res_busy, 0, memory_order_relaxed);
    atomic_store_explicit(&res_sleeping, 0, memory_order_relaxed);
    res_running = 0;
    res_cpu = -1;
}

static void res_init(void) { pthread_atfork(NULL, NULL, res_after_fork); }

/* Sleep until res_word differs from `seen` (or spuriously: the caller re-checks). */
static void res_sleep(uint32_t seen) {
#if defined(__linux__)
    syscall(SYS_futex, &res_word, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
#else
    pthread_mutex_lock(&res_mu);
    while (atomic_load(&res_word) == seen) pthread_cond_wait(&res_cv, &res_mu);
    pthread_mutex_unlock(&res_mu);
#endif
}

static void res_wake(void) {
#if defined(__linux__)
    syscall(SYS_futex, &res_word, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
#else
    pthread_mutex_lock(&res_mu);
    pthread_cond_signal(&res_cv);
    pthread_mutex_unlock(&res_mu);
#endif
}

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
            /* announce sleep, then re-check (seq_cst pairs with the poster's store and load) */
            uint32_t seen = atomic_load(&res_word);
            atomic_store(&res_sleeping, 1);
            if ((st = atomic_exchange(&res_post, NULL)) == NULL) res_sleep(seen);
            atomic_store(&res_sleeping, 0);
            if (st) break;
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
        atomic_store_explicit(&res_busy, 0, memory_order_release);
        return 0;
    }
#if defined(__GLIBC__)
    int me = sched_getcpu();
    if (me != res_cpu) { /* keep the helper off the caller's CPU (one syscall when the caller moved) */
        cpu_set_t cpus;
        if (other_cpus(&cpus)) pthread_setaffinity_np(res_thread, sizeof(cpus), &cpus);
        res_cpu = me;
        atomic_fetch_add_explicit(&stat_moves, 1, memory_order_relaxed);
    }
#endif
    atomic_store(&res_post, st);
    atomic_fetch_add(&res_word, 1);
    if (atomic_load(&res_sleeping)) {
        res_wake();
        atomic_fetch_add_explicit(&stat_wakes, 1, memory_order_relaxed);
    }
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
    uint64_t chunk = job->chunk, small = chunk, head = total;
    if (!chunk) {
        /* automatic: about 32 work items, 256 KiB to 1 MiB each, the last 2 items' worth cut into
         * items of a quarter (at least KVDD_CHUNK_TAIL): the caller, done with its items, waits for
         * the one the helper is still copying, and that wait is now a quarter as long (a 2 MiB
         * per-layer pull is 8 items of 256 KiB, ~14 us each on this VM: the wait was ~10% of it) */
        chunk = total / 32;
        if (chunk < KVDD_CHUNK_MIN) chunk = KVDD_CHUNK_MIN;
        if (chunk > KVDD_CHUNK_MAX) chunk = KVDD_CHUNK_MAX;
        small = chunk / 4 < KVDD_CHUNK_TAIL ? KVDD_CHUNK_TAIL : chunk / 4;
        head = total > 2 * chunk ? (total - 2 * chunk) / small * small : 0;
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
    st->head = head;
    st->small = small;
    st->nbig = (head + chunk - 1) / chunk;
    st->nchunks = st->nbig + (total - head + small - 1) / small;
    atomic_init(&st->next, 0);
    atomic_init(&st->done, 0);
    atomic_init(&st->refs, 2);

    int64_t posted = now_ns();
    int resident = post_resident(st);
    if (!resident && !start_helper(st)) atomic_store_explicit(&st->refs, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&stat_calls, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&stat_chunks, st->nchunks, memory_order_relaxed);

    int64_t t0 = now_ns();
    work(st);
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
    /* A helper that was descheduled mid-chunk (we waited > 1 ms and > 1/4 of our own work) means the
     * other CPU is busy: automatic mode then stays on one thread for KVDD_BACKOFF_FACTOR times the
     * wait (KVDD_BACKOFF_*). A helper that wakes too late to take any chunk is no stall: the caller
     * did the work at one thread's speed and waited for nothing (on a VM an idle vCPU can take
     * milliseconds to wake; backing off for it kept quiet runs on one thread). */
    int stalled = resident != 2 && t2 - t1 > 1000000 && t2 - t1 > (t1 - t0) / 4;
    /* The cost model learns the typical extra cost; a stall is answered by the backoff, not counted
     * in. The first call of the resident helper pays for creating it once: not a cost of later calls
     * either. */
    atomic_fetch_add_explicit(&stat_post_ns, (uint64_t)(t0 - posted), memory_order_relaxed);
    atomic_fetch_add_explicit(&stat_wait_ns, (uint64_t)(t2 - t1), memory_order_relaxed);
    if (resident != 2 && !stalled) cost_update((t0 - posted) + (t2 - t1));
    if (stalled) {
        atomic_fetch_add_explicit(&stat_stalls, 1, memory_order_relaxed);
        int64_t backoff = (t2 - t1) * KVDD_BACKOFF_FACTOR;
        if (backoff < KVDD_BACKOFF_MIN_NS) backoff = KVDD_BACKOFF_MIN_NS;
        if (backoff > KVDD_BACKOFF_MAX_NS) backoff = KVDD_BACKOFF_MAX_NS;
        atomic_store_explicit(&backoff_until_ns, t2 + backoff, memory_order_relaxed);
    }
    release_state(st);
    free(prefix); /* the helper reads prefix only for chunks it claimed, all of which are done */
    return total;
}

static uint64_t job_run(const kvdd_job *job, int64_t t0) {
    if (job->threads == 2) return run_two(job);
    uint64_t total = (uint64_t)job->K * job->per_k;
    if (total < KVDD_CHUNK_MIN) return run_serial(job);
    run_serial(job);
    int64_t dt = now_ns() - t0;
    model_update(&model_ps_per_byte, (int64_t)((uint64_t)dt * 1000u / total));
    return total;
}

uint64_t kvdd_job_run(const kvdd_job *job) {
    if (job->K == 0 || job->per_k == 0) return 0;
    int64_t t0 = now_ns();
    uint64_t done = job_run(job, t0);
    /* the time spent in the kernels, for the benchmarks' attribution (kvdd_thread_stats) */
    atomic_fetch_add_explicit(&stat_job_ns, (uint64_t)(now_ns() - t0), memory_order_relaxed);
    atomic_fetch_add_explicit(&stat_jobs, 1, memory_order_relaxed);
    return done;
}
