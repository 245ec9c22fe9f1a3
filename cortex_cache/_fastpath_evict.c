/* Victim choice in C: the shared victim lists (eviction.VictimCache: peek, take, may_expire), the queue
 * policies' next_victim (queues.QueueVictims), and the eviction itself (Core.evict_one), for the write
 * path making room (docs/internals.md, "The fast path").
 *
 * Each function does what its Python reference does, field for field and in the same order, so that the
 * two paths choose the same victims and leave the same bits (tests/test_fast_evict.py runs one trace
 * through both, every policy).  What stays in Python, called from here under the lock:
 *
 *   refill    a list found stale (invalid, an entry expired since its scan, a new LFU epoch) or used up
 *             is filled again by the vectorised scan (VictimCache.fill, through Core.refill_or_corrupt):
 *             once per list's worth of victims;
 *   the rest  a pool with a spill (a disk tier's on_evict), no victim to give (Core.evict_one then reaps
 *             dead processes' leftovers), or a list row that looks damaged: Core.evict_or_corrupt does
 *             the whole eviction, as before.  Nothing has been evicted here when it is called.
 *
 * The score of an entry offered to a list (VictimCache.on_score_change, on_unpin) stays in Python too:
 * it is called only for an entry scoring below the last listed victim (_fastpath_entries.h). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_fastpath.h"
#include "_fastpath_entries.h"

/* eviction.Auto's constants used here (the put path's auto_admit has the others). */
#define AUTO_RECENCY 0.3
#define AUTO_LOOP_SHARE 0.05
#define AUTO_LOOP 1

enum { V_NONE = -1, V_ERROR = -2, V_PYTHON = -3 }; /* next_victim's answers besides a slot */

/* VictimCache.fill of list q, in Python: 1 it listed something, 0 nothing to list, -1 it raised. */
static int refill(Fast *s, int q) {
    PyObject *r = PyObject_CallFunction(s->refill_hook, "i", q);
    if (r == NULL) return -1;
    int got = PyObject_IsTrue(r);
    Py_DECREF(r);
    return got;
}

/* VictimCache.peek: the slot at the head of list q (left there), *expired whether it has expired; V_NONE,
 * V_ERROR (the refill raised) or V_PYTHON (a damaged row or word: nothing more changed here). */
static int64_t list_peek(Fast *s, int q, double t, int *expired) {
    VList *l = &s->vl[q];
    for (int attempt = 0; attempt < 2; attempt++) {
        if (!*l->valid || t >= *l->next_expiry || *l->epoch != *s->lfu_epoch) {
            int rc = refill(s, q);
            if (rc < 0) return V_ERROR;
            if (rc == 0) return V_NONE;
        }
        /* Each word and row loaded once, checked, and only the checked value used: another process may
         * change any of them meanwhile (find(), _fastpath_entries.h).  A damaged one: Python reports it. */
        uint32_t pos = LOAD(*l->pos), count = LOAD(*l->count);
        if (count > l->rows || pos > count) return V_PYTHON;
        for (; pos < count; pos++) {
            int32_t i = LOAD(l->slot[pos]);
            if (i < 0 || (uint64_t)i >= s->n_slots) {
                *l->pos = pos;
                return V_PYTHON;
            }
            /* Skipped rows (pinned, changed, gone) come back through on_unpin / on_score_change. */
            if (s->state[i] == SEALED && s->pins[i] == 0 && s->ident[i] == l->ident[pos]) {
                *l->pos = pos;
                double e = s->expiry[i];
                *expired = e > 0 && e <= t;
                return i;
            }
        }
        *l->pos = pos;
        *l->valid = 0;
    }
    return V_NONE;
}

/* VictimCache.may_expire: could list q's peek give an expired entry? */
static int list_may_expire(Fast *s, int q, double t) {
    VList *l = &s->vl[q];
    if (!*l->valid || t >= *l->next_expiry) return 1;
    uint32_t pos = LOAD(*l->pos);
    return pos < *l->count && pos < l->rows && l->prim[pos] == -INFINITY;
}

/* QueueVictims.share and _from_queue0: take from queue 0 while it holds more than its target. */
static int from_queue0(Fast *s, uint64_t n0, uint64_t n1) {
    if (s->qadapt == ADAPT_ARC) return (double)n0 > *s->qtarget;
    double share = s->qadapt == ADAPT_AUTO && *s->qregime == AUTO_LOOP ? AUTO_LOOP_SHARE : *s->qtarget;
    return (double)n0 >= share * (double)(n0 + n1);
}

/* QueueVictims.frequency_regime: a read earns up to three rounds of queue 1 (s3fifo; auto in one regime). */
static int frequency_regime(Fast *s) {
    if (s->qadapt != ADAPT_AUTO) return 1;
    return *s->qregime != AUTO_LOOP && *s->qtarget < AUTO_RECENCY;
}

/* QueueVictims._expired_first: the soonest expired head of either list, taken off it (*q = -1); else the
 * rule's choice, not taken (*q its queue); V_NONE if neither list gives one. */
static int64_t expired_first(Fast *s, uint64_t n0, uint64_t n1, double t, int *q) {
    int e0 = 0, e1 = 0;
    int64_t i0 = n0 ? list_peek(s, 0, t, &e0) : V_NONE;
    if (i0 < V_NONE) return i0;
    int64_t i1 = n1 ? list_peek(s, 1, t, &e1) : V_NONE;
    if (i1 < V_NONE) return i1;
    if (i0 < 0) e0 = 0;
    if (i1 < 0) e1 = 0;
    if (e0 || e1) {
        int first = e0 && !(e1 && s->expiry[i1] < s->expiry[i0]) ? 0 : 1;
        *s->vl[first].pos += 1;
        *q = -1;
        return first == 0 ? i0 : i1;
    }
    *q = 0;
    if (i0 < 0 && i1 < 0) return V_NONE;
    if (i1 < 0 || (i0 >= 0 && from_queue0(s, n0, n1))) return i0;
    *q = 1;
    return i1;
}

/* QueueVictims._move of slot i from queue a to queue b. */
static void queue_move(Fast *s, int64_t i, int a, int b) {
    s->queue[i] = (uint8_t)b;
    if (s->qcount[a]) s->qcount[a] -= 1;
    s->qcount[b] += 1;
    double e = s->expiry[i]; /* queue b's list was filled without it (VictimCache.on_expiry_set) */
    if (e > 0 && e < *s->vl[b].next_expiry) *s->vl[b].next_expiry = e;
}

/* QueueVictims.next_victim: the next entry to evict, taken off its list (*expired: it has expired). */
static int64_t queue_next_victim(Fast *s, double t, int *expired) {
    int second_chance = s->qkind == Q_COUNT_READS;
    for (;;) {
        uint64_t n0 = s->qcount[0], n1 = s->qcount[1];
        int64_t i;
        int q = 0, e = 0;
        if ((n0 && list_may_expire(s, 0, t)) || (n1 && list_may_expire(s, 1, t))) {
            i = expired_first(s, n0, n1, t, &q);
            if (i < 0 || q < 0) {
                *expired = q < 0 && i >= 0;
                return i;
            }
        } else {
            /* The queue the rule picks, or the other when the rule's has nothing to give. */
            q = n0 && (!n1 || from_queue0(s, n0, n1)) ? 0 : 1;
            i = (q ? n1 : n0) ? list_peek(s, q, t, &e) : V_NONE;
            if (i < V_NONE) return i;
            if (i < 0) {
                q = 1 - q;
                i = (q ? n1 : n0) ? list_peek(s, q, t, &e) : V_NONE;
                if (i < 0) return i;
            }
        }
        *s->vl[q].pos += 1;
        if (!(second_chance && s->qfreq[i])) {
            *expired = 0;
            return i;
        }
        /* Read since it was queued: it moves on, and the next head is looked at. */
        if (q == 0) {
            queue_move(s, i, 0, 1);
            s->qfreq[i] = 0;
        } else if (frequency_regime(s)) {
            s->qfreq[i] -= 1;
        } else {
            s->qfreq[i] = 0;
        }
        s->qseq[i] = ++*s->qclock;
    }
}

/* Core.evict_one's victim, in Python: 1 a victim went (its run of blocks in *first, *n), 0 nothing could
 * go, -1 the hook raised. */
static int evict_in_python(Fast *s, uint64_t *first, uint64_t *n) {
    PyObject *r = PyObject_CallNoArgs(s->evict_hook);
    if (r == NULL) return -1;
    if (r == Py_None) {
        Py_DECREF(r);
        return 0;
    }
    unsigned long long f = 0, c = 0;
    int ok = PyArg_ParseTuple(r, "KK", &f, &c);
    Py_DECREF(r);
    if (!ok) return -1;
    *first = f;
    *n = c;
    return 1;
}

/* Core.evict_one (lock held): evict one victim by policy, expired entries first.  1 a victim went, its run
 * of blocks in *first, *n; 0 nothing could go; -1 an error (exception set). */
int evict_one(Fast *s, uint64_t *first, uint64_t *n) {
    if (s->no_evict) return 0; /* a fill's reservation: it never evicts (its PoolFull ends the fill) */
    if (s->spill) return evict_in_python(s, first, n); /* on_evict sees each victim first */
    int expired = 0;
    int64_t i;
    double t = now(); /* one instant for the whole choice (the reference reads its clock at each look) */
    if (s->qkind) {
        i = queue_next_victim(s, t, &expired);
    } else {
        i = list_peek(s, 0, t, &expired);
        if (i >= 0) *s->vl[0].pos += 1;
    }
    if (i == V_ERROR) return -1;
    if (i < 0) return evict_in_python(s, first, n); /* none (dead processes' leftovers?), or damage */
    /* What the eviction's bookkeeping reads, as it was before the entry left (Core.evict_one's order). */
    uint64_t entries = *s->n_entries, kh = s->khash[i], vlen = s->vlen[i];
    uint8_t q = s->qkind ? s->queue[i] & 1 : 0;
    *first = s->first[i];
    *n = s->nblk[i];
    GhostRing *g = &s->ghost[q];
    if (s->qkind && !expired && g->n) __builtin_prefetch(&g->bkt[(kh ? kh : 1) & g->mask]); /* for ghost_add */
    if (remove_entry(s, i) < 0) {
        PyErr_SetString(s->err_corrupt, "a pool's victim has damaged fields or chain; it is repaired on its next "
                                        "use, or with `cortex cache verify NAME --repair`");
        return -1;
    }
    if (expired) {
        *s->expirations += 1;
    } else {
        *s->evictions += 1;
        *s->bytes_evicted += vlen;
        if (s->qkind) ghost_add(g, kh, entries);
    }
    s->evicted_in_c += 1;
    return 1;
}
