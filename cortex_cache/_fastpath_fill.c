/* A background fill's batches in C (fill_columns.py drives them; fill.py says what a fill is).
 *
 * A fill loads a snapshot's entries into a published pool in batches: one lock hold reserves room for a
 * batch, the values are checked and written into their reservations without the lock, and one lock hold
 * seals them.  fill.py's Python batch does that an entry at a time (~20-45 us each); these do the same
 * steps over a batch's columns -- numpy arrays of the manifest, no object per entry -- with every rule of
 * the Python path kept:
 *
 *   fill_reserve  (the caller holds the lock) per entry: expired -> skip; gone (its position's mark, or its
 *                 key hash's) or present (the key is in memory) -> skip; else reserve a slot, key cells and
 *                 blocks, never evicting.  Stops at the first entry it cannot reserve (no room, or a field
 *                 it does not trust): the caller handles that one in Python (PoolFull ends the fill).
 *   fill_copy     (no lock, no GIL) per reserved entry: the value's xxh3_64 taken in the read buffer and
 *                 compared with the manifest's checksum, then written into its reservation with pwrite
 *                 (no page fault per 4 KiB, as a copy into the mapping takes).
 *   fill_seal     (the caller holds the lock) per entry processed: its position marked gone before memory
 *                 changes; a reservation whose value failed, was taken back, or whose key was put, deleted
 *                 or read early meanwhile (gone, or present) is given back; the others sealed with the
 *                 snapshot's metadata (Core.seal then Core.restore_meta, field for field).
 *
 * The arrays are the caller's (checked here for type width and length); the key blob is the manifest's
 * mapping (its keys' places checked here too: a place outside it stops the batch). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <unistd.h>

#include "_fastpath_entries.h"
#define XXH_INLINE_ALL
#include "xxhash.h"

#define WRITING 1
#define MAX_KEY 4096 /* layout.MAX_KEY_BYTES: a longer key is not one a pool can hold */

/* The slot codes fill_reserve writes for entries it reserved nothing for (fill_columns.py knows them). */
#define SKIP_EXPIRED (-1)
#define SKIP_PRESENT (-2)

#define GONE_POSITION 1 /* gone.py's bits */
#define GONE_HASH 2

/* One argument's buffer, checked: `n` items of `width` bytes, writable if asked. */
static int arg_array(PyObject *o, Py_buffer *b, Py_ssize_t width, Py_ssize_t n, int writable, const char *what) {
    if (PyObject_GetBuffer(o, b, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0) return -1;
    if ((n >= 0 && b->len != n * width) || b->len % width) {
        PyBuffer_Release(b);
        PyErr_Format(PyExc_ValueError, "fill: %s holds %zd bytes, not %zd items of %zd", what, b->len, n, width);
        return -1;
    }
    return 0;
}

/* Every buffer a call took, released on the way out. */
typedef struct {
    Py_buffer b[20];
    int n;
} Bufs;

static void *take_array(Bufs *bs, PyObject *o, Py_ssize_t width, Py_ssize_t n, int writable, const char *what) {
    Py_buffer *b = &bs->b[bs->n];
    if (arg_array(o, b, width, n, writable, what) < 0) return NULL;
    bs->n++;
    return b->buf ? b->buf : (void *)"";
}

/* The first argument of each call: the bytes its offsets index (a key blob, the read values), and the entry
 * count comes from the length of the u64 array that follows it. */
static const char *take_bytes(Bufs *bs, PyObject *o, uint64_t *len) {
    Py_buffer *b = &bs->b[bs->n];
    if (PyObject_GetBuffer(o, b, PyBUF_SIMPLE) < 0) return NULL;
    bs->n++;
    *len = (uint64_t)b->len;
    return b->buf ? b->buf : "";
}

static void release_all(Bufs *bs) {
    while (bs->n > 0) PyBuffer_Release(&bs->b[--bs->n]);
}

/* gone.py's GoneMarks.gone: is the snapshot's entry at `pos` (key hash kh) no longer the answer? */
static inline int is_gone(Fast *s, uint64_t pos, uint64_t kh) {
    if (s->gone == NULL) return 0;       /* a pool made before the marks */
    if (pos >= s->gone_len) return 1;    /* never (fill.follow bounds the snapshot): a miss */
    return (LOAD(s->gone[pos]) & GONE_POSITION) || (LOAD(s->gone[kh % s->n_slots]) & GONE_HASH);
}

static inline void mark_gone(Fast *s, uint64_t pos) {
    if (s->gone != NULL && pos < s->gone_len) s->gone[pos] |= GONE_POSITION;
}

/* The key of batch entry j in the manifest's key blob, or NULL (its place lies outside the blob). */
static inline const char *key_at(const char *blob, uint64_t blob_len, const uint64_t *koff, const uint16_t *klen,
                                 Py_ssize_t j) {
    uint64_t off = koff[j], n = klen[j];
    if (n == 0 || n > MAX_KEY || n > blob_len || off > blob_len - n) return NULL;
    return blob + off;
}

/* Core.abort: give a reservation back (the caller checked it is WRITING): Core._free_entry of a slot that
 * was never chained. */
static void give_back(Fast *s, int64_t i) {
    uint64_t f = s->first[i], n = s->nblk[i], kf = s->kcell[i];
    uint64_t k = ((uint64_t)s->klen[i] + KEY_CELL - 1) / KEY_CELL;
    if (f <= s->n_blocks && n <= s->n_blocks - f && kf <= s->n_kcells && k <= s->n_kcells - kf)
        free_room(s, i, f, n, kf, k);
    else
        give_slot(s, i); /* damaged fields: their room is the repair's to take back */
}

/* fill_reserve(blob, key_off, key_len, flags, length, expiry, start, first_pos, now, kh_out, slot_out,
 * off_out) -> the index it stopped at (n: all done).  The caller holds the lock.  From entry `start` on:
 * kh_out[j] its key's xxh3_64; slot_out[j] the slot reserved (off_out[j] where its value goes), or
 * SKIP_EXPIRED / SKIP_PRESENT.  It stops at an entry it cannot reserve -- no free room (it never evicts),
 * a value larger than the pool, a damaged field, a key outside the blob -- for the caller's Python path. */
FAST_METHOD(fill_reserve) {
    if (nargs != 12) {
        PyErr_SetString(PyExc_TypeError, "fill_reserve(blob, key_off, key_len, flags, length, expiry, start, "
                                         "first_pos, now, kh_out, slot_out, off_out)");
        return NULL;
    }
    Bufs bs = {.n = 0};
    PyObject *result = NULL;
    uint64_t blob_len;
    const char *kb = take_bytes(&bs, args[0], &blob_len);
    const uint64_t *koff = kb ? take_array(&bs, args[1], 8, -1, 0, "key_off") : NULL;
    Py_ssize_t n = koff ? bs.b[1].len / 8 : 0;
    const uint16_t *klen = koff ? take_array(&bs, args[2], 2, n, 0, "key_len") : NULL;
    const uint8_t *flags = klen ? take_array(&bs, args[3], 1, n, 0, "flags") : NULL;
    const uint64_t *length = flags ? take_array(&bs, args[4], 8, n, 0, "length") : NULL;
    const double *expiry = length ? take_array(&bs, args[5], 8, n, 0, "expiry") : NULL;
    uint64_t *kh_out = expiry ? take_array(&bs, args[9], 8, n, 1, "kh_out") : NULL;
    int64_t *slot_out = kh_out ? take_array(&bs, args[10], 8, n, 1, "slot_out") : NULL;
    uint64_t *off_out = slot_out ? take_array(&bs, args[11], 8, n, 1, "off_out") : NULL;
    if (off_out == NULL) goto done;
    Py_ssize_t start = PyLong_AsSsize_t(args[6]);
    uint64_t first_pos = PyLong_AsUnsignedLongLong(args[7]);
    double t = PyFloat_AsDouble(args[8]);
    if (PyErr_Occurred()) goto done;
    Py_ssize_t j = start < 0 ? 0 : start;
    self->no_evict = 1;
    for (; j < n; j++) {
        if (expiry[j] > 0 && expiry[j] <= t) {
            slot_out[j] = SKIP_EXPIRED;
            continue;
        }
        const char *key = key_at(kb, blob_len, koff, klen, j);
        if (key == NULL) break;
        uint64_t kh = XXH3_64bits(key, klen[j]);
        kh_out[j] = kh;
        if (is_gone(self, first_pos + (uint64_t)j, kh)) {
            slot_out[j] = SKIP_PRESENT;
            continue;
        }
        Found f;
        int rc = find(self, key, klen[j], kh, &f);
        if (rc < 0) break;
        if (rc == 1) {
            slot_out[j] = SKIP_PRESENT;
            continue;
        }
        uint64_t nblk = length[j] == 0 ? 0 : (length[j] + self->bs - 1) / self->bs;
        if (nblk > self->n_blocks) break; /* ValueTooLarge, in Python */
        int64_t slot;
        uint64_t off;
        if (reserve_in_c(self, key, klen[j], kh, flags[j] & 1u, length[j], nblk, &slot, &off) != 1) break;
        slot_out[j] = slot;
        off_out[j] = off;
    }
    self->no_evict = 0;
    result = PyLong_FromSsize_t(j);
done:
    release_all(&bs);
    return result;
}

/* fill_copy(values, src, length, slot, dst, checksum, ok_out) -> entries written.  No lock; the GIL let go.
 * For each entry with slot[j] >= 0 and src[j] not ~0 (its read failed): the xxh3_64 of values[src[j]:
 * +length[j]] compared with checksum[j], and if it matches, the bytes pwritten at dst[j] of the segment
 * (ok_out[j] 1; else 0).  An error of the write raises OSError (the caller gives the batch back). */
FAST_METHOD(fill_copy) {
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "fill_copy(values, src, length, slot, dst, checksum, ok_out)");
        return NULL;
    }
    Bufs bs = {.n = 0};
    PyObject *result = NULL;
    uint64_t vlen;
    const char *v = take_bytes(&bs, args[0], &vlen);
    const uint64_t *src = v ? take_array(&bs, args[1], 8, -1, 0, "src") : NULL;
    Py_ssize_t n = src ? bs.b[1].len / 8 : 0;
    const uint64_t *length = src ? take_array(&bs, args[2], 8, n, 0, "length") : NULL;
    const int64_t *slot = length ? take_array(&bs, args[3], 8, n, 0, "slot") : NULL;
    const uint64_t *dst = slot ? take_array(&bs, args[4], 8, n, 0, "dst") : NULL;
    const uint64_t *cks = dst ? take_array(&bs, args[5], 8, n, 0, "checksum") : NULL;
    uint8_t *ok = cks ? take_array(&bs, args[6], 1, n, 1, "ok_out") : NULL;
    if (ok == NULL) goto done;
    uint64_t lo = self->data_off, hi = self->data_off + self->n_blocks * self->bs;
    for (Py_ssize_t j = 0; j < n; j++) { /* every place checked before the GIL goes */
        ok[j] = 0;
        if (slot[j] < 0 || src[j] == UINT64_MAX) continue;
        if (length[j] > vlen || src[j] > vlen - length[j] || dst[j] < lo || length[j] > hi - dst[j]) {
            PyErr_SetString(PyExc_ValueError, "fill_copy: a value's place lies outside its buffer or the data");
            goto done;
        }
    }
    Py_ssize_t written = 0;
    int err = 0;
    int fd = self->fd;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t j = 0; j < n && !err; j++) {
        if (slot[j] < 0 || src[j] == UINT64_MAX) continue;
        const char *p = v + src[j];
        if (XXH3_64bits(p, length[j]) != cks[j]) continue;
        uint64_t done = 0;
        while (done < length[j]) {
            ssize_t w = pwrite(fd, p + done, length[j] - done, (off_t)(dst[j] + done));
            if (w < 0) {
                if (errno == EINTR) continue;
                err = errno;
                break;
            }
            if (w == 0) {
                err = EIO;
                break;
            }
            done += (uint64_t)w;
        }
        if (!err) {
            ok[j] = 1;
            written++;
        }
    }
    Py_END_ALLOW_THREADS
    if (err) {
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    result = PyLong_FromSsize_t(written);
done:
    release_all(&bs);
    return result;
}

/* Core.restore_meta of just-sealed slot i: the snapshot's metadata, not counted as a put. */
static void restore_meta(Fast *s, int64_t i, double created, double last_access, double expiry, uint64_t iseq,
                         uint64_t aseq, uint64_t count) {
    *s->puts -= 1;
    s->created[i] = created;
    s->lastacc[i] = last_access;
    s->expiry[i] = expiry;
    s->iseq[i] = iseq;
    s->aseq[i] = aseq;
    s->acount[i] = count > 1 ? count : 1;
    if (aseq > *s->seq) *s->seq = aseq;
    int lists = s->qkind ? 2 : 1;
    for (int q = 0; q < lists; q++) { /* VictimCache.invalidate and on_expiry_set, each list */
        *s->vl[q].valid = 0;
        if (expiry > 0 && expiry < *s->vl[q].next_expiry) *s->vl[q].next_expiry = expiry;
    }
}

/* fill_seal(blob, key_off, key_len, kh, slot, ok, start, stop, first_pos, meta, counts) -> the index it
 * stopped at (stop: all done).  The caller holds the lock and checked the fill's generation.  For entries
 * start..stop-1: the position marked gone; a reservation sealed with its metadata, or given back (its value
 * failed, it was taken back, or its key was put, deleted or read early meanwhile); sealed_out (a column of
 * `meta`) says which.  `meta`: (priority i64, created f64, last_access f64, expiry f64, insert_seq u64,
 * access_seq u64, access_count u64, checksum u64, sealed_out u8).  counts (u64[3], added to): loaded, bytes,
 * present skips.  It stops at an entry whose chain it cannot walk, for the caller's Python path. */
FAST_METHOD(fill_seal) {
    if (nargs != 11 || !PyTuple_Check(args[9]) || PyTuple_GET_SIZE(args[9]) != 9) {
        PyErr_SetString(PyExc_TypeError, "fill_seal(blob, key_off, key_len, kh, slot, ok, start, stop, first_pos, "
                                         "meta: (priority, created, last_access, expiry, insert_seq, access_seq, "
                                         "access_count, checksum, sealed_out), counts)");
        return NULL;
    }
    Bufs bs = {.n = 0};
    PyObject *result = NULL, *meta = args[9];
    uint64_t blob_len;
    const char *kb = take_bytes(&bs, args[0], &blob_len);
    const uint64_t *koff = kb ? take_array(&bs, args[1], 8, -1, 0, "key_off") : NULL;
    Py_ssize_t n = koff ? bs.b[1].len / 8 : 0;
    const uint16_t *klen = koff ? take_array(&bs, args[2], 2, n, 0, "key_len") : NULL;
    const uint64_t *khs = klen ? take_array(&bs, args[3], 8, n, 0, "kh") : NULL;
    const int64_t *slot = khs ? take_array(&bs, args[4], 8, n, 0, "slot") : NULL;
    const uint8_t *ok = slot ? take_array(&bs, args[5], 1, n, 0, "ok") : NULL;
    const int64_t *prio = ok ? take_array(&bs, PyTuple_GET_ITEM(meta, 0), 8, n, 0, "priority") : NULL;
    const double *created = prio ? take_array(&bs, PyTuple_GET_ITEM(meta, 1), 8, n, 0, "created") : NULL;
    const double *lastacc = created ? take_array(&bs, PyTuple_GET_ITEM(meta, 2), 8, n, 0, "last_access") : NULL;
    const double *expiry = lastacc ? take_array(&bs, PyTuple_GET_ITEM(meta, 3), 8, n, 0, "expiry") : NULL;
    const uint64_t *iseq = expiry ? take_array(&bs, PyTuple_GET_ITEM(meta, 4), 8, n, 0, "insert_seq") : NULL;
    const uint64_t *aseq = iseq ? take_array(&bs, PyTuple_GET_ITEM(meta, 5), 8, n, 0, "access_seq") : NULL;
    const uint64_t *acount = aseq ? take_array(&bs, PyTuple_GET_ITEM(meta, 6), 8, n, 0, "access_count") : NULL;
    const uint64_t *cks = acount ? take_array(&bs, PyTuple_GET_ITEM(meta, 7), 8, n, 0, "checksum") : NULL;
    uint8_t *sealed = cks ? take_array(&bs, PyTuple_GET_ITEM(meta, 8), 1, n, 1, "sealed_out") : NULL;
    uint64_t *counts = sealed ? take_array(&bs, args[10], 8, 3, 1, "counts") : NULL;
    if (counts == NULL) goto done;
    Py_ssize_t start = PyLong_AsSsize_t(args[6]), stop = PyLong_AsSsize_t(args[7]);
    uint64_t first_pos = PyLong_AsUnsignedLongLong(args[8]);
    if (PyErr_Occurred()) goto done;
    if (start < 0 || stop > n || start > stop) {
        PyErr_SetString(PyExc_ValueError, "fill_seal: start and stop outside the batch");
        goto done;
    }
    double t = now();
    Py_ssize_t j = start;
    for (; j < stop; j++) {
        uint64_t pos = first_pos + (uint64_t)j;
        sealed[j] = 0;
        int64_t i = slot[j];
        if (i < 0) { /* skipped at the reservation: expired, gone or present */
            mark_gone(self, pos);
            continue;
        }
        if ((uint64_t)i >= self->n_slots) break;
        int gone = is_gone(self, pos, khs[j]);
        int writing = LOAD(self->state[i]) == WRITING;
        int rc = 0;
        if (ok[j] && writing) {
            const char *key = key_at(kb, blob_len, koff, klen, j);
            Found f;
            rc = key == NULL ? -1 : find(self, key, klen[j], khs[j], &f);
            if (rc < 0) break; /* for the caller's Python path, nothing of this entry done */
        }
        mark_gone(self, pos); /* before memory changes: a filler killed from here on never loads it again */
        if (!ok[j] || !writing) {
            if (writing) give_back(self, i);
            continue;
        }
        if (gone || rc == 1) { /* put, deleted or read early while we read: the snapshot's copy is not the answer */
            give_back(self, i);
            counts[2] += 1;
            continue;
        }
        uint64_t vlen = self->vlen[i];
        stamp(self, i, cks[j], 0.0, prio[j], t);
        chain_in(self, i, khs[j]);
        restore_meta(self, i, created[j], lastacc[j], expiry[j], iseq[j], aseq[j], acount[j]);
        sealed[j] = 1;
        counts[0] += 1;
        counts[1] += vlen;
    }
    result = PyLong_FromSsize_t(j);
done:
    release_all(&bs);
    return result;
}
