/* The lock, and what every path does under it (docs/design.md, "Invariants"): find a key's entry, look it
 * up for a read, count a hit (touch), take and let go a pin record -- what core.py's locked, find, touch,
 * pin and unpin do, field for field, so that C and Python share pools freely.
 *
 * Included by the files that work under the lock (_fastpath_read.c, _put.c, _load.c), its functions
 * static inline: each file inlines them into its per-key loops as the single file they came from did
 * (as calls across files, batched views and loads ran 3% slower). */
#ifndef CORTEX_FASTPATH_ENTRIES_H
#define CORTEX_FASTPATH_ENTRIES_H

#include <errno.h>
#include <math.h>
#include <time.h>

#include "_fastpath.h"

/* What a lookup found: every field the read uses, each loaded once from the segment and checked, for the
 * copy (inside or outside the lock) and the Pin.  Nothing here is read from the segment again. */
typedef struct {
    int64_t slot;
    uint64_t off, len, iseq, cks;
} Found;

static inline double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static inline int expired(Fast *self, int64_t i, double t) {
    double e = self->expiry[i];
    return e > 0 && e <= t;
}

/* ------------------------------------------------------------------ lock */

/* 1: held, with the dirty mark set; 0: not taken (busy, or a dirty mark to repair: the caller's Python
 * path waits or repairs); -1: error, exception set. */
static inline int take(Fast *self) {
    if (guard_gone(self->guard)) return 0; /* the Python path raises */
    if (self->thread_acquire) {
        PyObject *r = PyObject_CallOneArg(self->thread_acquire, Py_False);
        if (r == NULL) return -1;
        int ok = PyObject_IsTrue(r);
        Py_DECREF(r);
        if (ok <= 0) return ok;
    }
    for (int k = 0; k < SPIN; k++) {
        if (fcntl(self->fd, F_OFD_SETLK, &self->lk) == 0) {
            if (*self->dirty) { /* a holder died mid-change: Python repairs */
                fcntl(self->fd, F_OFD_SETLK, &self->unlk);
                break;
            }
            *self->dirty = 1;
            return 1;
        }
        if (errno != EAGAIN && errno != EACCES && errno != EINTR) {
            PyErr_SetFromErrno(PyExc_OSError);
            goto fail;
        }
    }
    if (self->thread_release) {
        PyObject *r = PyObject_CallNoArgs(self->thread_release);
        if (r == NULL) return -1;
        Py_DECREF(r);
    }
    return 0;
fail:
    if (self->thread_release) {
        PyObject *t, *v, *tb;
        PyErr_Fetch(&t, &v, &tb);
        PyObject *r = PyObject_CallNoArgs(self->thread_release);
        Py_XDECREF(r);
        PyErr_Restore(t, v, tb);
    }
    return -1;
}

/* Let the lock go; `clean` clears the dirty mark (leave it after an error mid-change: the next holder
 * repairs).  Keeps any pending exception. */
static inline void give(Fast *self, int clean) {
    if (clean) *self->dirty = 0;
    fcntl(self->fd, F_OFD_SETLK, &self->unlk);
    if (self->thread_release) {
        PyObject *t, *v, *tb;
        PyErr_Fetch(&t, &v, &tb);
        PyObject *r = PyObject_CallNoArgs(self->thread_release);
        Py_XDECREF(r);
        if (t) PyErr_Restore(t, v, tb);
    }
}

/* ------------------------------------------------------------------ entries (lock held) */

/* Key kb's sealed entry into *out: 1 found, 0 none, -1 if the metadata looks damaged (the Python path
 * reports and repairs).  Another process that can write the segment may change any field at any moment,
 * even while we hold the lock (docs/reliability.md, "Trust model"): each is loaded once (LOAD) into a
 * local, checked, and only that local used, so a field changed between the check and its use cannot
 * send a copy outside the data region or the caller's buffer. */
static inline int find(Fast *self, const char *kb, Py_ssize_t klen, uint64_t kh, Found *out) {
    int32_t i = LOAD(self->buckets[kh & self->mask]);
    uint64_t steps = 0;
    while (i >= 0) {
        if ((uint64_t)i >= self->n_slots) return -1;
        if (LOAD(self->khash[i]) == kh && LOAD(self->klen[i]) == (uint64_t)klen) {
            uint64_t kc = LOAD(self->kcell[i]);
            if (kc > self->n_kcells || ((uint64_t)klen + KEY_CELL - 1) / KEY_CELL > self->n_kcells - kc) return -1;
            if (memcmp(self->base + self->keys_off + kc * KEY_CELL, kb, (size_t)klen) == 0) {
                uint64_t f = LOAD(self->first[i]), nb = LOAD(self->nblk[i]), len = LOAD(self->vlen[i]);
                /* Inside the data region, and filling exactly its blocks (repair.py's rule). */
                if (f > self->n_blocks || nb > self->n_blocks - f || len > nb * self->bs ||
                    (nb > 0 && len <= (nb - 1) * self->bs))
                    return -1;
                out->slot = i;
                out->off = self->data_off + f * self->bs;
                out->len = len;
                out->iseq = LOAD(self->iseq[i]);
                out->cks = LOAD(self->cks[i]);
                return 1;
            }
        }
        i = LOAD(self->next[i]);
        if (++steps > self->n_slots) return -1;
    }
    return 0;
}

/* eviction.py's primary_one for this pool's policy. */
static inline double primary(Fast *self, int64_t i) {
    switch (self->policy) {
    case POL_FIFO: return (double)self->iseq[i];
    case POL_LFU: {
        uint64_t age = *self->lfu_epoch - self->lfuep[i];
        return (double)(self->acount[i] >> (age < 63 ? age : 63));
    }
    case POL_PRIORITY: return (double)self->prio[i];
    case POL_TTL: return self->expiry[i] > 0 ? self->expiry[i] : INFINITY;
    case POL_SIZE: return -(double)self->vlen[i];
    default: return 0.0;
    }
}

/* Could entry i, just given a new score, belong in the victim list (VictimCache._offer's test: expired, or
 * scoring below the last listed victim, access_seq breaking a tie)?  When not, on_score_change would
 * change nothing, and is not called. */
static inline int below_last_victim(Fast *self, int64_t i, double t) {
    if (expired(self, i, t)) return 1;
    double p = primary(self, i), mp = *self->cand_max_primary;
    return p < mp || (p == mp && self->aseq[i] < *self->cand_max_secondary);
}

/* Move rows [from, to) of list l by `by` rows (-1 or 1), every column. */
static inline void shift_rows(VList *l, uint32_t from, uint32_t to, int by) {
    size_t n = to - from;
    memmove(l->slot + from + by, l->slot + from, n * sizeof *l->slot);
    memmove(l->ident + from + by, l->ident + from, n * sizeof *l->ident);
    memmove(l->prim + from + by, l->prim + from, n * sizeof *l->prim);
    memmove(l->sec + from + by, l->sec + from, n * sizeof *l->sec);
}

/* VictimCache._offer (list 0, the only list of a non-monotone policy): put entry i into the list if it
 * scores below the last listed victim, where its score sorts -- the fewer rows moving: those before it
 * into the row taken last, or those after it down one (a full list dropping its last row). */
static inline void offer(Fast *self, int64_t i, double t) {
    VList *l = &self->vl[0];
    double e = self->expiry[i], p;
    uint64_t sec;
    if (e > 0 && e <= t) { /* expired: first, soonest to expire first (eviction._expiry_key) */
        p = -INFINITY;
        memcpy(&sec, &e, sizeof sec);
    } else {
        p = primary(self, i);
        sec = self->aseq[i];
    }
    double mp = *l->max_primary;
    if (!(p < mp || (p == mp && sec < *l->max_secondary))) return;
    uint32_t pos = *l->pos, count = *l->count;
    if (count > l->rows || pos > count) return; /* damaged words: the next scan, or the repair, rewrites them */
    uint32_t lo = pos, hi = count; /* the first row scoring above (p, sec): the rows are sorted */
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (l->prim[mid] > p || (l->prim[mid] == p && l->sec[mid] > sec))
            hi = mid;
        else
            lo = mid + 1;
    }
    uint32_t k = lo;
    if (k == count) return; /* the list is used up: the next eviction rescans anyway */
    if (pos > 0 && k - pos < count - k) {
        shift_rows(l, pos, k, -1);
        k -= 1;
        *l->pos = pos - 1;
    } else {
        uint32_t end = count < l->rows ? count : count - 1;
        shift_rows(l, k, end, 1);
        count = end + 1;
        *l->count = count;
    }
    l->slot[k] = (int32_t)i;
    l->ident[k] = self->ident[i];
    l->prim[k] = p;
    l->sec[k] = sec;
    *l->max_primary = l->prim[count - 1];
    *l->max_secondary = l->sec[count - 1];
}

/* Core.touch: count a hit on entry i.  0 (an int for its callers, which once met a Python hook's error). */
static inline int touch(Fast *self, int64_t i, double t) {
    uint64_t seq = *self->seq + 1;
    *self->seq = seq;
    self->aseq[i] = seq;
    self->lastacc[i] = t;
    uint64_t ops = *self->ops + 1;
    *self->ops = ops;
    uint64_t period = *self->lfu_period;
    if (period && ops % period == 0) *self->lfu_epoch += 1;
    uint64_t epoch = *self->lfu_epoch;
    uint64_t age = epoch - self->lfuep[i];
    self->acount[i] = (self->acount[i] >> (age < 63 ? age : 63)) + 1;
    self->lfuep[i] = epoch;
    *self->hits += 1;
    if (self->qkind == Q_COUNT_READS) { /* QueueVictims.hit */
        if (self->qfreq[i] < 3) self->qfreq[i] += 1;
    } else if (self->qkind == Q_PROMOTE && self->queue[i] == 0) {
        self->queue[i] = 1;
        if (self->qcount[0]) self->qcount[0] -= 1;
        self->qcount[1] += 1;
        double e = self->expiry[i]; /* queue 1's list was filled without it (QueueVictims._move) */
        if (e > 0 && e < *self->cand1_next_expiry) *self->cand1_next_expiry = e;
    }
    /* VictimCache.on_score_change */
    if (!self->monotone && *self->cand_valid && below_last_victim(self, i, t)) offer(self, i, t);
    return 0;
}

static inline uint32_t *pin_pid(Fast *self, uint64_t j) { return (uint32_t *)(self->pinrec + j * self->pin_size + self->pin_off_pid); }
static inline int32_t *pin_slot(Fast *self, uint64_t j) { return (int32_t *)(self->pinrec + j * self->pin_size + self->pin_off_slot); }
static inline uint64_t *pin_start(Fast *self, uint64_t j) { return (uint64_t *)(self->pinrec + j * self->pin_size + self->pin_off_start); }

/* Core.pin: a pin record for entry i, or -1 when none is free (Python reaps dead pins or says PoolBusy). */
static inline int64_t pin(Fast *self, int64_t i) {
    uint64_t j = self->pin_hint;
    if (j >= self->n_pins || *pin_pid(self, j) != 0) {
        uint64_t k;
        for (k = 0; k < self->n_pins; k++)
            if (*pin_pid(self, k) == 0) break;
        if (k == self->n_pins) return -1;
        j = k;
    }
    *pin_slot(self, j) = (int32_t)i;
    *pin_start(self, j) = self->pstart;
    *pin_pid(self, j) = self->pid;
    self->pins[i] += 1;
    self->pin_hint = (j + 1) % self->n_pins;
    return (int64_t)j;
}

/* Core.unpin.  -1 with an exception set if a Python hook failed. */
static inline int unpin(Fast *self, uint64_t j, int64_t i) {
    if (j >= self->n_pins || i < 0 || (uint64_t)i >= self->n_slots) return 0;
    if (*pin_pid(self, j) != self->pid || *pin_slot(self, j) != i) return 0; /* reclaimed by a repair */
    *pin_pid(self, j) = 0;
    *pin_slot(self, j) = -1;
    uint32_t p = self->pins[i];
    if (p > 0) {
        p -= 1;
        self->pins[i] = p;
    }
    if (p != 0) return 0;
    PyObject *hook = NULL;
    uint32_t st = LOAD(self->state[i]);
    if (st == ZOMBIE) {
        hook = self->free_entry;
    } else if (st == SEALED && self->qkind) {
        hook = self->on_unpin; /* QueueVictims.on_unpin: the list of the entry's queue decides */
    } else if (st == SEALED && *self->cand_valid) {
        /* VictimCache.on_unpin: nothing to do when the entry scores above the last listed victim
         * (it cannot belong in the list) and has not expired; then only its expiry matters. */
        if (!below_last_victim(self, i, now())) {
            double e = self->expiry[i];
            if (e > 0 && e < *self->cand_next_expiry) *self->cand_next_expiry = e;
            return 0;
        }
        hook = self->on_unpin;
    }
    if (hook == NULL) return 0;
    PyObject *r = PyObject_CallFunction(hook, "L", (long long)i);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

/* Look key kb up, lock held: 1 found (counted and touched per mode, when `touch_now`), 0 absent (a miss
 * counted per mode), 2 SLOW (nothing changed), -1 error.  `room` < 0: no buffer limit.  `for_copy`: the
 * caller copies the value (without the seqlock, a large value is left to the Python path, which pins). */
static inline int lookup(Fast *self, const char *kb, Py_ssize_t klen, uint64_t kh, int mode, Py_ssize_t room,
                         double t, int touch_now, int for_copy, Found *out) {
    int rc = find(self, kb, klen, kh, out);
    if (rc < 0) return 2;
    if (rc == 1 && expired(self, out->slot, t)) {
        if (mode != MODE_QUIET) return 2; /* Python expires it and counts */
        rc = 0;
    }
    if (rc == 0) {
        if (mode == MODE_HITS) return 2;
        if (mode == MODE_GET) *self->misses += 1;
        return 0;
    }
    if (room >= 0 && (uint64_t)room < out->len) return 2; /* Python raises BufferTooSmall */
    if (for_copy && !self->seqlock && out->len > self->copy_in_lock) return 2;
    if (touch_now && mode != MODE_QUIET && touch(self, out->slot, t) < 0) return -1;
    return 1;
}

static inline int parse_key(PyObject *kb, PyObject *kh, const char **p, Py_ssize_t *n, uint64_t *h) {
    if (!PyBytes_Check(kb)) {
        PyErr_SetString(PyExc_TypeError, "key must be bytes");
        return -1;
    }
    *p = PyBytes_AS_STRING(kb);
    *n = PyBytes_GET_SIZE(kb);
    *h = PyLong_AsUnsignedLongLong(kh);
    if (*h == (uint64_t)-1 && PyErr_Occurred()) return -1;
    return 0;
}

/* parse_key of keys[k], a (bytes, int) pair that check_key_pairs let through. */
static inline int parse_pair(PyObject *keys, Py_ssize_t k, const char **p, Py_ssize_t *n, uint64_t *h) {
    PyObject *pair = PyList_GET_ITEM(keys, k);
    return parse_key(PyTuple_GET_ITEM(pair, 0), PyTuple_GET_ITEM(pair, 1), p, n, h);
}

/* Are `keys` a list of (bytes, int) pairs?  Checked before the lock is taken: 0, or -1 with a TypeError
 * naming the call. */
static inline int check_key_pairs(PyObject *keys, const char *what) {
    for (Py_ssize_t k = 0; k < PyList_GET_SIZE(keys); k++) {
        PyObject *pair = PyList_GET_ITEM(keys, k);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2 || !PyBytes_Check(PyTuple_GET_ITEM(pair, 0))) {
            PyErr_Format(PyExc_TypeError, "%s: keys are (bytes, int) pairs", what);
            return -1;
        }
    }
    return 0;
}

#endif
