/* The reads: read, read_many, pin_many and unpin_many (and, for tests and the fill, probe, still and
 * populate).
 *
 * Values larger than `copy_in_lock` are copied outside the lock without a pin,
 * seqlock style: the entry's state and insert_seq are read under the lock,
 * the bytes copied without it, then state and insert_seq read again; a value
 * whose slot was freed, reused or overwritten meanwhile fails that check and
 * is read again.  Every writer changes one of the two before it changes the
 * bytes (a slot is freed before its blocks are reused; an in-place overwrite
 * clears insert_seq first), and x86-64's store order makes that visible in
 * the same order.  core.py enables the seqlock copy only on x86-64. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <sys/mman.h>

#include "_fastpath.h"
#include "_fastpath_entries.h"
#define XXH_INLINE_ALL
#include "xxhash.h"

/* Is the entry still the one `f` found (the seqlock check after a copy outside the lock)? */
static inline int still(Fast *self, const Found *f) {
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    return LOAD(self->state[f->slot]) == SEALED && LOAD(self->iseq[f->slot]) == f->iseq;
}

static void copy_out(char *dst, const char *src, uint64_t n) {
    if (n >= 65536) {
        Py_BEGIN_ALLOW_THREADS
        memcpy(dst, src, n);
        Py_END_ALLOW_THREADS
    } else {
        memcpy(dst, src, n);
    }
}

/* Does a value copied out match the checksum its entry records?  (Pool.open(verify_reads=True): a
 * slot whose fields point at other bytes, or bytes changed in place, is then refused, not returned.) */
static int matches(const char *p, uint64_t n, uint64_t cks) {
    uint64_t h;
    if (n >= 65536) {
        Py_BEGIN_ALLOW_THREADS
        h = XXH3_64bits(p, (size_t)n);
        Py_END_ALLOW_THREADS
    } else {
        h = XXH3_64bits(p, (size_t)n);
    }
    return h == cks;
}

/* read(kb, kh, out, mode) -> bytes (out None) | int (bytes copied into out) | None (absent) | SLOW */
FAST_METHOD(read) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "read(kb, kh, out, mode)");
        return NULL;
    }
    const char *kb;
    Py_ssize_t klen;
    uint64_t kh;
    if (parse_key(args[0], args[1], &kb, &klen, &kh) < 0) return NULL;
    int mode = (int)PyLong_AsLong(args[3]);
    if (mode == -1 && PyErr_Occurred()) return NULL;
    Py_buffer ob;
    int have_out = args[2] != Py_None;
    if (have_out && PyObject_GetBuffer(args[2], &ob, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return NULL;
    PyObject *result = NULL;
    int counted = 0;
    for (int attempt = 0; attempt <= SEQ_RETRIES; attempt++) {
        int got = take(self);
        if (got <= 0) {
            result = got < 0 ? NULL : Py_NewRef(SLOW);
            break;
        }
        double t = now();
        Found f;
        /* A retry after a failed seqlock check has counted its hit already. */
        int rc = lookup(self, kb, klen, kh, counted ? MODE_QUIET : mode, have_out ? ob.len : -1, t, 1, 1, &f);
        if (rc != 1) {
            give(self, rc != -1);
            result = rc == -1 ? NULL : rc == 2 ? Py_NewRef(SLOW) : Py_NewRef(Py_None);
            break;
        }
        counted = 1;
        const char *src = self->base + f.off;
        /* A value that fails verification goes to the Python path, which refuses it (ValueCorrupt). */
        if (f.len <= self->copy_in_lock) {
            if (have_out) {
                memcpy(ob.buf, src, f.len);
                result = PyLong_FromUnsignedLongLong(f.len);
            } else {
                result = PyBytes_FromStringAndSize(src, (Py_ssize_t)f.len);
            }
            give(self, 1);
            if (result != NULL && (guard_gone(self->guard) || (self->verify &&
                !matches(have_out ? (const char *)ob.buf : PyBytes_AS_STRING(result), f.len, f.cks))))
                Py_SETREF(result, Py_NewRef(SLOW));
            break;
        }
        give(self, 1);
        if (have_out) {
            copy_out(ob.buf, src, f.len);
            if (guard_gone(self->guard)) { /* the copy met a truncated segment: the Python path raises */
                result = Py_NewRef(SLOW);
                break;
            }
            if (still(self, &f)) {
                result = !self->verify || matches(ob.buf, f.len, f.cks) ? PyLong_FromUnsignedLongLong(f.len)
                                                                       : Py_NewRef(SLOW);
                break;
            }
        } else {
            PyObject *b = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)f.len);
            if (b == NULL) break;
            copy_out(PyBytes_AS_STRING(b), src, f.len);
            if (guard_gone(self->guard)) {
                Py_DECREF(b);
                result = Py_NewRef(SLOW);
                break;
            }
            if (still(self, &f)) {
                if (self->verify && !matches(PyBytes_AS_STRING(b), f.len, f.cks)) {
                    Py_DECREF(b);
                    result = Py_NewRef(SLOW);
                } else {
                    result = b;
                }
                break;
            }
            Py_DECREF(b);
        }
        if (attempt == SEQ_RETRIES) result = Py_NewRef(SLOW);
    }
    if (have_out) PyBuffer_Release(&ob);
    return result;
}

/* read_many(keys: list[(kb, kh)], outs: list[buffer], mode) -> list of int | None | SLOW per key.
 * One lock hold for every lookup; copies outside it (seqlock-checked) or inside it for small values. */
FAST_METHOD(read_many) {
    if (nargs != 3 || !PyList_Check(args[0]) || !PyList_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "read_many(keys: list, outs: list, mode)");
        return NULL;
    }
    PyObject *keys = args[0], *outs = args[1];
    Py_ssize_t n = PyList_GET_SIZE(keys);
    if (PyList_GET_SIZE(outs) != n) {
        PyErr_SetString(PyExc_ValueError, "read_many: one buffer per key");
        return NULL;
    }
    int mode = (int)PyLong_AsLong(args[2]);
    if (mode == -1 && PyErr_Occurred()) return NULL;
    PyObject *result = PyList_New(n);
    if (result == NULL) return NULL;
    Py_buffer *bufs = PyMem_Calloc(n ? n : 1, sizeof(Py_buffer));
    Found *found = PyMem_Calloc(n ? n : 1, sizeof(Found));
    char *status = PyMem_Calloc(n ? n : 1, 1); /* 0 done, 1 found: copy later, 2 copied: verify later */
    Py_ssize_t nbufs = 0;
    int ok = 0;
    if (!bufs || !found || !status) {
        PyErr_NoMemory();
        goto done;
    }
    for (; nbufs < n; nbufs++)
        if (PyObject_GetBuffer(PyList_GET_ITEM(outs, nbufs), &bufs[nbufs], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
            goto done;
    if (check_key_pairs(keys, "read_many") < 0) goto done; /* every key before the lock is taken */
    int got = take(self);
    if (got < 0) goto done;
    if (got == 0) {
        for (Py_ssize_t k = 0; k < n; k++) PyList_SET_ITEM(result, k, Py_NewRef(SLOW));
        ok = 1;
        goto done;
    }
    double t = now();
    for (Py_ssize_t k = 0; k < n; k++) {
        const char *kb;
        Py_ssize_t klen;
        uint64_t kh;
        if (parse_pair(keys, k, &kb, &klen, &kh) < 0) {
            give(self, 0);
            goto done;
        }
        int rc = lookup(self, kb, klen, kh, mode, bufs[k].len, t, 1, 1, &found[k]);
        if (rc == -1) {
            give(self, 0);
            goto done;
        }
        if (rc == 1 && found[k].len <= self->copy_in_lock) {
            memcpy(bufs[k].buf, self->base + found[k].off, found[k].len);
            status[k] = self->verify ? 2 : 0; /* verified once the lock is let go */
            PyList_SET_ITEM(result, k, PyLong_FromUnsignedLongLong(found[k].len));
        } else if (rc == 1) {
            status[k] = 1;
        } else {
            PyList_SET_ITEM(result, k, Py_NewRef(rc == 2 ? SLOW : Py_None));
        }
    }
    give(self, 1);
    int gone = guard_gone(self->guard); /* an in-lock copy met a truncated segment */
    for (Py_ssize_t k = 0; k < n; k++) {
        if (gone && status[k] != 1 && PyLong_CheckExact(PyList_GET_ITEM(result, k))) status[k] = 3;
        if (status[k] == 3) { /* copied from a segment found gone: the Python path raises */
            PyObject *was = PyList_GET_ITEM(result, k);
            PyList_SET_ITEM(result, k, Py_NewRef(SLOW));
            Py_DECREF(was);
            continue;
        }
        if (status[k] != 1) {
            if (PyList_GET_ITEM(result, k) == NULL) goto done; /* PyLong_From... failed */
            if (status[k] == 2 && !matches(bufs[k].buf, found[k].len, found[k].cks)) {
                PyObject *was = PyList_GET_ITEM(result, k);
                PyList_SET_ITEM(result, k, Py_NewRef(SLOW));
                Py_DECREF(was);
            }
            continue;
        }
        copy_out(bufs[k].buf, self->base + found[k].off, found[k].len);
        /* A value changed under the copy (or failing verification): the Python path reads it again, pinned
         * (counting a second hit). */
        int ok_copy = !guard_gone(self->guard) && still(self, &found[k]) &&
                      (!self->verify || matches(bufs[k].buf, found[k].len, found[k].cks));
        PyList_SET_ITEM(result, k, ok_copy ? PyLong_FromUnsignedLongLong(found[k].len) : Py_NewRef(SLOW));
        if (PyList_GET_ITEM(result, k) == NULL) goto done;
    }
    ok = 1;
done:
    for (Py_ssize_t k = 0; k < nbufs; k++) PyBuffer_Release(&bufs[k]);
    PyMem_Free(bufs);
    PyMem_Free(found);
    PyMem_Free(status);
    if (!ok) {
        Py_DECREF(result);
        return NULL;
    }
    return result;
}

/* pin_many(keys: list[(kb, kh)], mode) -> list of Pin | None | SLOW per
 * key, in one lock hold (the batched views).  None when the lock is busy (nothing done). */
FAST_METHOD(pin_many) {
    if (nargs != 2 || !PyList_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "pin_many(keys: list, mode)");
        return NULL;
    }
    PyObject *keys = args[0];
    int mode = (int)PyLong_AsLong(args[1]);
    if (mode == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(keys);
    if (check_key_pairs(keys, "pin_many") < 0) return NULL;
    PyObject *result = PyList_New(n);
    if (result == NULL) return NULL;
    int got = take(self);
    if (got <= 0) {
        Py_DECREF(result);
        if (got < 0) return NULL;
        Py_RETURN_NONE;
    }
    double t = now();
    Py_ssize_t k;
    for (k = 0; k < n; k++) {
        const char *kb;
        Py_ssize_t klen;
        uint64_t kh;
        if (parse_pair(keys, k, &kb, &klen, &kh) < 0) break;
        Found f;
        /* Touch only once pinned: a key left to the Python path must be as it was. */
        int rc = lookup(self, kb, klen, kh, mode, -1, t, 0, 0, &f);
        if (rc == 1) {
            int64_t j = pin(self, f.slot);
            if (j < 0) {
                PyList_SET_ITEM(result, k, Py_NewRef(SLOW));
                continue;
            }
            if (mode != MODE_QUIET && touch(self, f.slot, t) < 0) {
                unpin(self, (uint64_t)j, f.slot);
                break;
            }
            PyObject *tup = new_pin(self, (uint64_t)j, f.slot, f.off, f.len, f.cks);
            if (tup == NULL) {
                unpin(self, (uint64_t)j, f.slot);
                break;
            }
            PyList_SET_ITEM(result, k, tup);
        } else if (rc == -1) {
            break;
        } else {
            PyList_SET_ITEM(result, k, Py_NewRef(rc == 2 ? SLOW : Py_None));
        }
    }
    if (k < n) { /* an error: undo this batch's pins, then raise */
        PyObject *t0, *v0, *tb0;
        PyErr_Fetch(&t0, &v0, &tb0);
        for (Py_ssize_t m = 0; m < k; m++) {
            PyObject *it = PyList_GET_ITEM(result, m);
            if (Py_IS_TYPE(it, &PinType)) {
                unpin(self, ((Pin *)it)->pin, ((Pin *)it)->slot);
                ((Pin *)it)->state = PIN_DONE;
            }
        }
        PyErr_Clear();
        PyErr_Restore(t0, v0, tb0);
        give(self, 0);
        for (Py_ssize_t m = k; m < n; m++) PyList_SET_ITEM(result, m, Py_NewRef(Py_None));
        Py_DECREF(result);
        return NULL;
    }
    give(self, 1);
    return result;
}

/* unpin_many(pins: list of Pin or (pin, slot)) -> True, or False when the lock is busy (nothing done). */
FAST_METHOD(unpin_many) {
    if (nargs != 1 || !PyList_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "unpin_many(pins: list)");
        return NULL;
    }
    PyObject *pins = args[0];
    Py_ssize_t n = PyList_GET_SIZE(pins);
    uint64_t *js = PyMem_Malloc((n ? n : 1) * 2 * sizeof(uint64_t));
    if (js == NULL) return PyErr_NoMemory();
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *p = PyList_GET_ITEM(pins, k);
        if (Py_IS_TYPE(p, &PinType)) {
            js[2 * k] = ((Pin *)p)->pin;
            js[2 * k + 1] = (uint64_t)((Pin *)p)->slot;
            continue; /* marked done below, once unpinned */
        }
        PyObject *a = PySequence_GetItem(p, 0), *b = a ? PySequence_GetItem(p, 1) : NULL;
        if (b == NULL) {
            Py_XDECREF(a);
            PyMem_Free(js);
            return NULL;
        }
        js[2 * k] = PyLong_AsUnsignedLongLong(a);
        js[2 * k + 1] = PyLong_AsUnsignedLongLong(b);
        Py_DECREF(a);
        Py_DECREF(b);
        if (PyErr_Occurred()) {
            PyMem_Free(js);
            return NULL;
        }
    }
    int got = take(self);
    if (got <= 0) {
        PyMem_Free(js);
        if (got < 0) return NULL;
        Py_RETURN_FALSE;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *p = PyList_GET_ITEM(pins, k);
        if (Py_IS_TYPE(p, &PinType)) ((Pin *)p)->state = PIN_DONE;
        if (unpin(self, js[2 * k], (int64_t)js[2 * k + 1]) < 0) {
            /* A hook failed: the remaining pins go with this process (or the next repair). */
            PyMem_Free(js);
            give(self, 0);
            return NULL;
        }
    }
    PyMem_Free(js);
    give(self, 1);
    Py_RETURN_TRUE;
}

/* probe(kb, kh) -> (slot, insert_seq) of the key's live entry, or None; counts nothing.  With still(),
 * for tests: what a seqlock reader records under the lock, and its check after the copy. */
FAST_METHOD(probe) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "probe(kb, kh)");
        return NULL;
    }
    const char *kb;
    Py_ssize_t klen;
    uint64_t kh;
    if (parse_key(args[0], args[1], &kb, &klen, &kh) < 0) return NULL;
    int got = take(self);
    if (got <= 0) return got < 0 ? NULL : Py_NewRef(SLOW);
    Found f;
    int rc = lookup(self, kb, klen, kh, MODE_QUIET, -1, now(), 0, 0, &f);
    give(self, 1);
    if (rc != 1) return Py_NewRef(rc == 2 ? SLOW : Py_None);
    return Py_BuildValue("(LK)", (long long)f.slot, (unsigned long long)f.iseq);
}

FAST_METHOD(still) {
    Found f = {0};
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "still(slot, insert_seq)");
        return NULL;
    }
    f.slot = PyLong_AsLongLong(args[0]);
    f.iseq = PyLong_AsUnsignedLongLong(args[1]);
    if (PyErr_Occurred()) return NULL;
    if (f.slot < 0 || (uint64_t)f.slot >= self->n_slots) {
        PyErr_SetString(PyExc_IndexError, "no such slot");
        return NULL;
    }
    return PyBool_FromLong(still(self, &f));
}

/* populate(off, len) -> bool: map [off, off+len) of the segment into this process's page tables
 * (MADV_POPULATE_WRITE, Linux >= 5.14), the GIL released; False where the kernel cannot. */
FAST_METHOD(populate) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "populate(off, len)");
        return NULL;
    }
    Py_ssize_t off = PyLong_AsSsize_t(args[0]), len = PyLong_AsSsize_t(args[1]);
    if (PyErr_Occurred()) return NULL;
    if (off < 0 || len < 0 || off % 4096 || len > self->buf.len - off) {
        PyErr_SetString(PyExc_ValueError, "populate: a page-aligned range inside the segment");
        return NULL;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = len ? madvise(self->base + off, (size_t)len, 23 /* MADV_POPULATE_WRITE */) : 0;
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(rc == 0);
}
