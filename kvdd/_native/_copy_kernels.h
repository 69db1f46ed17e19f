/* Internal interface between the two halves of the copy kernels (_copy_kernels.c: per-run loops and
 * CPU features; _copy_impl.c: jobs and threads). Not part of the Cython module's interface. */
#ifndef KVDD_COPY_KERNELS_H
#define KVDD_COPY_KERNELS_H

#include <stddef.h>
#include <stdint.h>

/* KVDD_NO_SIMD: build the portable path only (memcpy/memmove), e.g. to test it on x86-64. */
#if (defined(__x86_64__) || defined(__amd64__)) && (defined(__GNUC__) || defined(__clang__)) && !defined(KVDD_NO_SIMD)
#define KVDD_X86 1
#else
#define KVDD_X86 0
#endif
#if defined(__aarch64__) && defined(__GNUC__) && !defined(KVDD_NO_SIMD)
#define KVDD_NEON 1
#else
#define KVDD_NEON 0
#endif

/* One run with memmove semantics (`isa`, streaming stores when `stream`); [next, next + next_n) is the
 * source (next_d the destination) of the following run, prefetched when it is short. */
void kvdd_copy_run(int isa, int stream, uintptr_t d, uintptr_t s, size_t n, uintptr_t next, uintptr_t next_d,
                   size_t next_n);
/* Order the streaming stores of this thread before what follows (sfence / dmb ishst). */
void kvdd_stream_fence(int isa, int stream);

#endif
