/* copy_hash's loop: copy pieces of memory, each a cache-sized step at a time, hashing every step where it
 * landed while it is still in the CPU cache; the xxh3_64 of `head` followed by all the copied bytes, in
 * order.
 *
 * Included after xxhash.h with COPY_HASH_NAME defined, once per instruction set: _fastpath.c builds the
 * baseline (SSE2 on x86-64), _copyhash_avx2.c the AVX2 one, and the module picks at import what the CPU
 * runs.  Called with the GIL released: it touches no Python object. */
#ifndef CORTEX_COPY_PIECE
#define CORTEX_COPY_PIECE
#define COPY_HASH_STEP (64 * 1024) /* a step stays in L1/L2 between its copy and its hash */
struct copy_piece {
    char *dst;
    const char *src;
    size_t len;
};
#endif

__attribute__((visibility("hidden"))) uint64_t COPY_HASH_NAME(const struct copy_piece *pieces, size_t n,
                                                              const void *head, size_t head_len) {
    XXH3_state_t state;
    XXH3_64bits_reset(&state);
    if (head_len) XXH3_64bits_update(&state, head, head_len);
    for (size_t i = 0; i < n; i++) {
        const struct copy_piece *p = &pieces[i];
        for (size_t off = 0; off < p->len; off += COPY_HASH_STEP) {
            size_t len = p->len - off < COPY_HASH_STEP ? p->len - off : COPY_HASH_STEP;
            memmove(p->dst + off, p->src + off, len);
            XXH3_64bits_update(&state, p->dst + off, len);
        }
    }
    return XXH3_64bits_digest(&state);
}
