/* Fast.load_many: a batch of values that each carry a header of the caller's format, checked and copied
 * into the caller's buffers in one call (the LMCache adapter's load: integrations/lmcache.py, `_get`).
 *
 * It follows the rules of the read path's lock, lookup and pin helpers (_fastpath_entries.h): in ONE lock
 * hold every key of the batch is looked up, pinned and counted (as Pool.view_many counts it); the lock
 * is let go; then, with the GIL released, each pinned value's header is checked in
 * place, its payload copied into the caller's buffer and (with `verify`) the whole stored value --
 * header and payload, as its checksum was taken at put -- hashed while it is copied (copy_hash_impl);
 * a batch of LOAD_THREADED_BYTES or more is copied by up to `workers` threads; then the lock is taken
 * once more and every pin let go.  A pinned entry cannot be freed or overwritten in place, so no
 * seqlock check is needed; another process that scribbles on the segment (docs/reliability.md, "Trust
 * model") is caught by the header check or the checksum, never trusted with a length.
 *
 * The header's format is the caller's, described by a small spec (struct load_header) that the
 * integration builds: the header's size, the prefix every header starts with, where each key's own
 * bytes (a digest of its name, say; the caller's) lie in it, and where it records the payload's length.
 * This file knows no integration's format.
 *
 * Per key: LOAD_HIT (copied, and verified when asked), LOAD_MISS (absent: a miss counted per mode),
 * LOAD_FOREIGN (a value whose header does not name this key, or of another length than the buffer;
 * the buffer untouched), LOAD_CORRUPT (the copy failed its checksum: the buffer zeroed), LOAD_REFUSED
 * (the pool's own verify_reads check failed, where view_many answers ValueCorrupt: the buffer
 * untouched), or SLOW: the Python path loads that key (expired, damaged metadata, out of pin records,
 * absent with a tier below), nothing changed for it.  The whole call answers SLOW, before anything
 * changed, when the lock is busy or marked dirty.  After the copies, a segment found truncated (the
 * Guard) or a Fast closed meanwhile turns every key SLOW, its hit already counted (the Python path then
 * raises). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <pthread.h>
#include <signal.h>
#include <stdlib.h>

#include "_fastpath.h"
#include "_fastpath_entries.h"
#define XXH_INLINE_ALL
#include "xxhash.h"

enum { LOAD_HIT = 0, LOAD_MISS = 1, LOAD_FOREIGN = 2, LOAD_CORRUPT = 3, LOAD_REFUSED = 4, LOAD_SLOW = 5 };

#define LOAD_HEADER_MAX 256 /* the largest header a spec may describe (it is copied onto the stack) */
#define LOAD_THREADED_BYTES (4u << 20) /* smaller batches: copied by the calling thread alone */
#define LOAD_MAX_THREADS 16
/* copy_hash streams large pieces past the cache (non-temporal stores), which pays when the destination is
 * cold.  A batch this small is likely in the cache already -- the engine's buffers were just written or
 * read -- and is hashed where it lands instead: copy_hash takes its plain, cached path for pieces under
 * COPY_HASH_STREAM_MIN, so each value is handed to it in such pieces (32 x 256 KiB into buffers just
 * zeroed, as LMCache's benchmark does: 1.5-1.7x the streamed copy; 32 x 1 MiB: 0.95x, so larger batches
 * stream). */
#define LOAD_CACHED_BYTES (16u << 20)
#define LOAD_PIECE (COPY_HASH_STREAM_MIN / 2)

/* What a value's header must hold, as the caller describes its format: `size` bytes before the payload,
 * starting with `prefix`; the key's own `key_len` bytes at `key_at`; the payload's length as a u64,
 * little-endian, at `length_at` (-1: not recorded).  The payload must fill the caller's buffer exactly. */
struct load_header {
    size_t size, prefix_len, key_at, key_len;
    Py_ssize_t length_at;
    const char *prefix;
};

/* One key of a batch: what the lock hold found (each field loaded once and checked by find()), and its
 * outcome.  Read and written without the GIL. */
struct load_job {
    char *dst;
    size_t room;        /* the buffer's size */
    const char *key_id; /* the key's own header bytes (the caller's, load_header.key_len of them) */
    const char *value;  /* the stored value in the segment: header, then payload */
    uint64_t len, cks;  /* its length and checksum */
    uint64_t pin;
    int64_t slot;
    int pinned, outcome;
};

struct load_batch {
    struct load_job *jobs;
    size_t n;
    struct load_header header;
    int verify, pool_verify;
    int cached;       /* a batch small enough to stay in the cache (LOAD_CACHED_BYTES) */
    size_t next;      /* the next job to take (atomic) */
    int want, joined; /* helpers asked for, and those that came (helpers.mu) */
    int users;        /* helpers working on it now (helpers.mu) */
};

static inline uint64_t le64(const unsigned char *p) {
    uint64_t v = 0;
    for (int k = 7; k >= 0; k--) v = v << 8 | p[k];
    return v;
}

/* copy_hash of one value's payload after its header: streamed, or (`cached`) in pieces that take
 * copy_hash's cached path.  No GIL. */
static uint64_t load_copy_hash(char *dst, const char *src, size_t n, const unsigned char *head, size_t head_len,
                               int cached) {
    struct copy_piece one = {dst, src, n}, *pieces = &one;
    size_t count = 1;
    if (cached && n > LOAD_PIECE && (pieces = malloc((n / LOAD_PIECE + 1) * sizeof *pieces)) != NULL) {
        for (count = 0; count * LOAD_PIECE < n; count++) {
            size_t off = count * LOAD_PIECE;
            pieces[count] = (struct copy_piece){dst + off, src + off, n - off < LOAD_PIECE ? n - off : LOAD_PIECE};
        }
    } else {
        pieces = &one; /* one piece, or no memory for the list (then streamed: the same bytes, slower) */
    }
    uint64_t h = copy_hash_impl(pieces, count, head, head_len);
    if (pieces != &one) free(pieces);
    return h;
}

/* One pinned value into its buffer: its outcome.  No GIL. */
static int load_one(const struct load_batch *b, const struct load_job *j) {
    const struct load_header *h = &b->header;
    unsigned char head[LOAD_HEADER_MAX];
    /* The pool's own verify_reads check comes first, over the bytes in place, as view_many's does (it
     * answers ValueCorrupt for the key): a value failing it never reaches the buffer. */
    if (b->pool_verify && XXH3_64bits(j->value, (size_t)j->len) != j->cks) return LOAD_REFUSED;
    if (j->len < h->size) return LOAD_FOREIGN;
    uint64_t n = j->len - h->size;
    memcpy(head, j->value, h->size); /* read once: what is checked is what is hashed */
    if (memcmp(head, h->prefix, h->prefix_len) != 0 || memcmp(head + h->key_at, j->key_id, h->key_len) != 0 ||
        (h->length_at >= 0 && le64(head + h->length_at) != n) || n != j->room)
        return LOAD_FOREIGN;
    if (!b->verify) {
        memcpy(j->dst, j->value + h->size, (size_t)n);
        return LOAD_HIT;
    }
    /* One pass over the pool's memory: each step hashed on its way to the buffer. */
    if (load_copy_hash(j->dst, j->value + h->size, (size_t)n, head, h->size, b->cached) == j->cks) return LOAD_HIT;
    memset(j->dst, 0, (size_t)n); /* nothing of a damaged value is left in the buffer */
    return LOAD_CORRUPT;
}

/* Take jobs until none is left (the calling thread and every helper that joins run this).  No GIL. */
static void load_worker(struct load_batch *b) {
    for (;;) {
        size_t k = __atomic_fetch_add(&b->next, 1, __ATOMIC_RELAXED);
        if (k >= b->n) return;
        struct load_job *j = &b->jobs[k];
        if (j->pinned) j->outcome = load_one(b, j);
    }
}

/* The copy helpers: threads started on first need and kept, asleep between batches, for every pool of
 * the process (starting threads per batch costs tens of microseconds each).  A batch is offered to them
 * while its caller copies too; the caller then withdraws it and waits only for the helpers that joined,
 * so a helper the scheduler has not run yet never delays a batch (on a busy machine, waiting for one
 * cost a time slice: a 256 KiB x 32 batch ran at a sixth of its speed).  One batch at a time: a second
 * caller meanwhile copies alone. */
static struct {
    pthread_mutex_t mu;
    pthread_cond_t wake, idle;
    int started;
    int atfork;
    struct load_batch *offered;
    uint64_t gen; /* counts offers: a helper joins each batch once */
} helpers = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, NULL, 0};

static void *load_helper(void *unused) {
    uint64_t done_gen = 0;
    pthread_mutex_lock(&helpers.mu);
    for (;;) {
        struct load_batch *b = helpers.offered;
        if (b == NULL || helpers.gen == done_gen || b->joined >= b->want) {
            pthread_cond_wait(&helpers.wake, &helpers.mu);
            continue;
        }
        done_gen = helpers.gen;
        b->joined++;
        b->users++;
        pthread_mutex_unlock(&helpers.mu);
        load_worker(b);
        pthread_mutex_lock(&helpers.mu);
        if (--b->users == 0) pthread_cond_broadcast(&helpers.idle);
    }
    return NULL;
}

/* A forked child has none of its parent's threads: it starts its own. */
static void load_helpers_after_fork(void) {
    pthread_mutex_init(&helpers.mu, NULL);
    pthread_cond_init(&helpers.wake, NULL);
    pthread_cond_init(&helpers.idle, NULL);
    helpers.started = 0;
    helpers.offered = NULL;
}

/* Up to `want` helpers running (helpers.mu held).  Asynchronous signals stay with Python's threads; a
 * SIGBUS (a truncated segment) is taken by the helper that faults, as the Guard needs. */
static void load_start_helpers(int want) {
    if (!helpers.atfork) helpers.atfork = pthread_atfork(NULL, NULL, load_helpers_after_fork) == 0;
    if (!helpers.atfork) return; /* a child could not be told it has no helpers: copy alone */
    sigset_t all, was;
    sigfillset(&all);
    sigdelset(&all, SIGBUS);
    sigdelset(&all, SIGSEGV);
    sigdelset(&all, SIGFPE);
    sigdelset(&all, SIGILL);
    pthread_sigmask(SIG_SETMASK, &all, &was);
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    while (helpers.started < want) {
        pthread_t t;
        if (pthread_create(&t, &attr, load_helper, NULL) != 0) break; /* fewer helpers: the rest copy */
        helpers.started++;
    }
    pthread_attr_destroy(&attr);
    pthread_sigmask(SIG_SETMASK, &was, NULL);
}

/* Every pinned job, on up to `threads` threads (the caller's included).  No GIL. */
static void load_all(struct load_batch *b, int threads) {
    int offered = 0;
    if (threads > 1) {
        pthread_mutex_lock(&helpers.mu);
        if (helpers.offered == NULL) {
            load_start_helpers(threads - 1);
            b->want = threads - 1;
            helpers.offered = b;
            helpers.gen++;
            offered = 1;
            pthread_cond_broadcast(&helpers.wake);
        }
        pthread_mutex_unlock(&helpers.mu);
    }
    load_worker(b);
    if (!offered) return;
    pthread_mutex_lock(&helpers.mu);
    helpers.offered = NULL; /* a helper woken from now on goes back to sleep */
    while (b->users > 0) pthread_cond_wait(&helpers.idle, &helpers.mu);
    pthread_mutex_unlock(&helpers.mu);
}

/* Unpin the pinned jobs among the first n, lock held: 0, or -1 with an exception set (a Python hook
 * failed: the rest go with this process, as unpin_many leaves them). */
static int load_unpin(Fast *self, struct load_job *jobs, Py_ssize_t n) {
    for (Py_ssize_t k = 0; k < n; k++) {
        if (!jobs[k].pinned) continue;
        jobs[k].pinned = 0;
        if (unpin(self, jobs[k].pin, jobs[k].slot) < 0) return -1;
    }
    return 0;
}

/* The lock hold: look up, pin and count every key, as Pool.view_many does.  1 done (the lock let go),
 * 0 the lock was not taken (nothing changed), -1 error (exception set, nothing left pinned). */
static int load_pin_all(Fast *self, PyObject *keys, struct load_job *jobs, Py_ssize_t n, int mode) {
    int got = take(self);
    if (got <= 0) return got;
    double t = now();
    for (Py_ssize_t k = 0; k < n; k++) {
        const char *kb;
        Py_ssize_t klen;
        uint64_t kh;
        Found f;
        if (parse_pair(keys, k, &kb, &klen, &kh) < 0) goto fail;
        /* Touched only once pinned: a key left to the Python path must be as it was. */
        int rc = lookup(self, kb, klen, kh, mode, -1, t, 0, 0, &f);
        int64_t j = rc == 1 ? pin(self, f.slot) : -1;
        if (rc != 1 || j < 0) { /* absent (a miss counted per mode), or SLOW: out of pin records, expired... */
            jobs[k].outcome = rc == 0 ? LOAD_MISS : LOAD_SLOW;
            continue;
        }
        jobs[k].pin = (uint64_t)j;
        jobs[k].slot = f.slot;
        jobs[k].value = self->base + f.off;
        jobs[k].len = f.len;
        jobs[k].cks = f.cks;
        jobs[k].pinned = 1;
        if (mode != MODE_QUIET && touch(self, f.slot, t) < 0) goto fail;
    }
    give(self, 1);
    return 1;
fail: { /* a bad key hash or a hook that failed: undo this batch's pins, then raise */
    PyObject *et, *ev, *etb;
    PyErr_Fetch(&et, &ev, &etb);
    load_unpin(self, jobs, n);
    PyErr_Clear();
    PyErr_Restore(et, ev, etb);
    give(self, 0);
    return -1;
}
}

/* Let the batch's pins go after the copies: None when done here; the (pin, slot) pairs still pinned when
 * the lock could not be taken again at once (the caller releases them, waiting: Core.release_pins); NULL
 * on error.  A closed handle's pins go with the process (as a Pin's do). */
static PyObject *load_release(Fast *self, struct load_job *jobs, Py_ssize_t n) {
    if (self->closing) Py_RETURN_NONE;
    int got = take(self);
    if (got == 1) {
        if (load_unpin(self, jobs, n) < 0) {
            give(self, 0);
            return NULL;
        }
        give(self, 1);
        Py_RETURN_NONE;
    }
    PyErr_Clear(); /* the caller's release_pins meets it again, and raises it */
    PyObject *left = PyList_New(0);
    for (Py_ssize_t k = 0; left != NULL && k < n; k++) {
        if (!jobs[k].pinned) continue;
        PyObject *p = Py_BuildValue("(KL)", (unsigned long long)jobs[k].pin, (long long)jobs[k].slot);
        if (p == NULL || PyList_Append(left, p) < 0) Py_CLEAR(left);
        Py_XDECREF(p);
    }
    return left;
}

/* The header spec (size, prefix, key_at, key_len, length_at) into *h, checked: 0, or -1 with a TypeError
 * (not that shape) or a ValueError (a part outside the header). */
static int load_parse_header(PyObject *spec, struct load_header *h) {
    Py_ssize_t v[5] = {0}; /* v[1], the prefix, is bytes */
    int shaped = PyTuple_Check(spec) && PyTuple_GET_SIZE(spec) == 5 && PyBytes_Check(PyTuple_GET_ITEM(spec, 1));
    for (int k = 0; shaped && k < 5; k++) {
        PyObject *item = PyTuple_GET_ITEM(spec, k);
        if (k != 1 && (!PyLong_Check(item) || ((v[k] = PyLong_AsSsize_t(item)) == -1 && PyErr_Occurred())))
            shaped = 0;
    }
    if (!shaped) {
        PyErr_Clear();
        PyErr_SetString(PyExc_TypeError, "load_many: header is (size, prefix: bytes, key_at, key_len, length_at)");
        return -1;
    }
    Py_ssize_t size = v[0], key_at = v[2], key_len = v[3], length_at = v[4];
    Py_ssize_t prefix_len = PyBytes_GET_SIZE(PyTuple_GET_ITEM(spec, 1));
    if (size < 1 || size > LOAD_HEADER_MAX || prefix_len > size || key_at < 0 || key_len < 0 ||
        key_len > size - key_at || length_at < -1 || (length_at >= 0 && length_at > size - 8)) {
        PyErr_Format(PyExc_ValueError,
                     "load_many: a header of 1 to %d bytes, its prefix, key bytes and length field inside it",
                     LOAD_HEADER_MAX);
        return -1;
    }
    *h = (struct load_header){(size_t)size, (size_t)prefix_len, (size_t)key_at, (size_t)key_len, length_at,
                              PyBytes_AS_STRING(PyTuple_GET_ITEM(spec, 1))};
    return 0;
}

/* load_many(keys: list[(kb, kh)], outs: list[buffer], header: (size, prefix, key_at, key_len, length_at),
 * key_ids: bytes (key_len a key), mode, verify: bool, workers: int) -> (outcomes, leftover) | SLOW.
 * outcomes: per key LOAD_HIT..LOAD_REFUSED (0-4) or SLOW; leftover: None, or the (pin, slot) pairs the
 * caller must release (load_release). */
FAST_METHOD(load_many) {
    if (nargs != 7 || !PyList_Check(args[0]) || !PyList_Check(args[1]) || !PyBytes_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError,
                        "load_many(keys: list, outs: list, header: tuple, key_ids: bytes, mode, verify, workers)");
        return NULL;
    }
    PyObject *keys = args[0], *outs = args[1];
    Py_ssize_t n = PyList_GET_SIZE(keys);
    int mode = (int)PyLong_AsLong(args[4]);
    if (mode == -1 && PyErr_Occurred()) return NULL;
    int verify = PyObject_IsTrue(args[5]);
    if (verify < 0) return NULL;
    long workers = PyLong_AsLong(args[6]);
    if (workers == -1 && PyErr_Occurred()) return NULL;
    struct load_header header;
    if (load_parse_header(args[2], &header) < 0) return NULL;
    if (PyList_GET_SIZE(outs) != n || PyBytes_GET_SIZE(args[3]) != n * (Py_ssize_t)header.key_len || workers < 1) {
        PyErr_SetString(PyExc_ValueError, "load_many: one buffer and key_len key bytes a key, workers >= 1");
        return NULL;
    }
    if (check_key_pairs(keys, "load_many") < 0) return NULL; /* every key before the lock is taken */
    PyObject *result = NULL;
    Py_buffer *bufs = PyMem_Calloc(n ? n : 1, sizeof(Py_buffer));
    struct load_job *jobs = PyMem_Calloc(n ? n : 1, sizeof(struct load_job));
    Py_ssize_t nbufs = 0;
    uint64_t total = 0;
    if (!bufs || !jobs) {
        PyErr_NoMemory();
        goto done;
    }
    for (; nbufs < n; nbufs++) { /* every buffer taken before the lock is */
        if (PyObject_GetBuffer(PyList_GET_ITEM(outs, nbufs), &bufs[nbufs], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
            goto done;
        jobs[nbufs].dst = bufs[nbufs].buf;
        jobs[nbufs].room = (size_t)bufs[nbufs].len;
        jobs[nbufs].key_id = PyBytes_AS_STRING(args[3]) + nbufs * (Py_ssize_t)header.key_len;
        total += (uint64_t)bufs[nbufs].len;
    }
    int got = load_pin_all(self, keys, jobs, n, mode);
    if (got <= 0) {
        result = got < 0 ? NULL : Py_NewRef(SLOW);
        goto done;
    }
    struct load_batch batch = {jobs, (size_t)n, header, verify, self->verify, total <= LOAD_CACHED_BYTES, 0, 0, 0, 0};
    long threads = total >= LOAD_THREADED_BYTES ? workers : 1;
    if (threads > LOAD_MAX_THREADS) threads = LOAD_MAX_THREADS;
    if (threads > n) threads = (long)n;
    Py_BEGIN_ALLOW_THREADS
    load_all(&batch, (int)threads);
    Py_END_ALLOW_THREADS
    /* A copy that met a truncated segment read zeros, and a close() meanwhile closed the lock's file:
     * either way every key goes to the Python path, which raises. */
    int lost = guard_gone(self->guard) || self->closing;
    PyObject *leftover = load_release(self, jobs, n);
    if (leftover == NULL) goto done;
    PyObject *outcomes = PyList_New(n);
    for (Py_ssize_t k = 0; outcomes != NULL && k < n; k++) {
        int o = lost ? LOAD_SLOW : jobs[k].outcome;
        PyObject *v = o == LOAD_SLOW ? Py_NewRef(SLOW) : PyLong_FromLong(o);
        if (v == NULL) Py_CLEAR(outcomes);
        else PyList_SET_ITEM(outcomes, k, v);
    }
    result = outcomes ? PyTuple_Pack(2, outcomes, leftover) : NULL;
    Py_XDECREF(outcomes);
    Py_DECREF(leftover);
done:
    for (Py_ssize_t k = 0; k < nbufs; k++) PyBuffer_Release(&bufs[k]);
    PyMem_Free(bufs);
    PyMem_Free(jobs);
    return result;
}
