/* copy_hash: copy pieces of memory and take the xxh3_64 of a head followed by every byte copied, in one
 * pass (the loop, and why it is fast: _copyhash_loop.h).  Built twice -- the baseline in _copyhash.c, AVX2
 * in _copyhash_avx2.c -- and `copy_hash_impl` points at the one this CPU runs (picked at import).  Both
 * give the xxhash package's xxh3_64, bit for bit.  No GIL needed: it touches no Python object. */
#ifndef CORTEX_COPYHASH_H
#define CORTEX_COPYHASH_H

#include <stddef.h>
#include <stdint.h>

#define COPY_HASH_STEP (64 * 1024)          /* a plain step stays in L1/L2 between its copy and its hash */
#define COPY_HASH_STREAM_MIN (64 * 1024)    /* pieces from this size on are streamed */
#define COPY_HASH_BOUNCE (8 * 1024)         /* the bounce buffer: in L1 with the hash state beside it */
/* Values this small are copied with the GIL held: letting it go and taking it back costs more. */
#define COPY_HASH_GIL_FREE (16 * 1024)

struct copy_piece {
    char *dst;
    const char *src;
    size_t len;
};

typedef uint64_t (*copy_hash_fn)(const struct copy_piece *pieces, size_t n, const void *head, size_t head_len);

uint64_t cortex_copy_hash_base(const struct copy_piece *pieces, size_t n, const void *head, size_t head_len);
/* GCC's target pragma builds the AVX2 loop beside the baseline (_copyhash_avx2.c). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define COPY_HASH_HAVE_AVX2 1
uint64_t cortex_copy_hash_avx2(const struct copy_piece *pieces, size_t n, const void *head, size_t head_len);
#endif

extern copy_hash_fn copy_hash_impl; /* the build this CPU runs */
extern const char *copy_hash_isa;   /* its name: "baseline" or "avx2" */
void copy_hash_pick(void);          /* point copy_hash_impl at the best build the CPU runs (at import) */

#endif
