/* Byte check of every copy-kernel path of kvdd/_native/_copy_kernels.c and _copy_impl.c, in C, for the paths Python cannot
 * force on this machine: tests/sim/test_copy_kernels.py builds it natively and for aarch64 (NEON)
 * with a cross compiler, and runs it (under qemu-user for aarch64) when it can.
 *
 * For every implementation the CPU can run (KVDD_ISA_*), regular and streaming stores, one and two
 * threads: runs of 1 byte to 21 pages at every alignment class of source and destination, each
 * checked against memmove on a copy of the whole buffer (so bytes outside the run are checked too),
 * plus overlapping runs (memmove semantics). Prints "ok <cases>" and exits 0, or the first mismatch
 * and exits 1. */
#include "_copy_kernels.c"
#include "_copy_impl.c"
#include "_copy_plan.c"

#include <stdio.h>

static uint64_t rng_state = 0x9E3779B97F4A7C15u;
static uint8_t rnd(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint8_t)(rng_state >> 32);
}

#define BUF (2 * 21 * 4096 + 8 * 4096)
static uint8_t buf[BUF], expect[BUF];

static int check(int isa, int stream, int threads, size_t soff, size_t doff, size_t n) {
    for (size_t i = 0; i < BUF; i++) buf[i] = rnd();
    memcpy(expect, buf, BUF);
    memmove(expect + doff, expect + soff, n);
    kvdd_pair pair = {(uintptr_t)buf, (uintptr_t)buf};
    int64_t so = (int64_t)soff, dof = (int64_t)doff, ln = (int64_t)n;
    kvdd_job job = {&pair, 1, &so, &dof, &ln, 1, (uint64_t)n, isa, stream, 1, 3000};
    /* two threads only for independent runs (the caller's rule) */
    if (threads == 2 && kvdd_job_independent(&job)) job.threads = 2;
    if (kvdd_job_run(&job) != n) {
        printf("isa %d stream %d threads %d: wrong byte count for n=%zu\n", isa, stream, threads, n);
        return 0;
    }
    if (memcmp(buf, expect, BUF) != 0) {
        size_t i = 0;
        while (buf[i] == expect[i]) i++;
        printf("isa %d stream %d threads %d soff %zu doff %zu n %zu: byte %zu differs\n", isa, stream,
               threads, soff, doff, n, i);
        return 0;
    }
    return 1;
}

int main(void) {
    static const size_t sizes[] = {1, 2, 3, 7, 15, 16, 17, 31, 63, 64, 65, 255, 511, 512, 513, 1000,
                                   4095, 4096, 4097, 16383, 16384, 16385, 32768 + 4095, 21 * 4096 - 5};
    static const size_t aligns[][2] = {{0, 0}, {1, 0}, {0, 1}, {13, 61}, {63, 3}, {4095, 17}, {64, 4032}};
    static const long shifts[] = {1, -1, 64, -64, 4096, -4097, 16384};
    unsigned mask = kvdd_isa_mask();
    long cases = 0;
    for (int isa = 0; isa < KVDD_ISA_COUNT; isa++) {
        if (!(mask & (1u << isa))) continue;
        for (int stream = 0; stream < 2; stream++) {
            for (int threads = 1; threads <= 2; threads++) {
                for (size_t a = 0; a < sizeof(aligns) / sizeof(aligns[0]); a++) {
                    for (size_t k = 0; k < sizeof(sizes) / sizeof(sizes[0]); k++) {
                        size_t n = sizes[k], soff = aligns[a][0], doff = BUF / 2 + aligns[a][1];
                        if (!check(isa, stream, threads, soff, doff, n)) return 1;
                        cases++;
                    }
                }
                for (size_t k = 0; k < sizeof(shifts) / sizeof(shifts[0]); k++) {
                    size_t n = 5 * 4096 + 33, soff = 40000;
                    if (!check(isa, stream, threads, soff, (size_t)((long)soff + shifts[k]), n)) return 1;
                    cases++;
                }
            }
        }
    }
    printf("ok %ld cases, isa mask %#x\n", cases, mask);
    return 0;
}
