/* The write path in C: put, put_many, reserve_many and seal_many, and the queue policies' evicted
 * (docs/internals.md, "The fast path").
 *
 * It shares the read path's lock (take/give), lookup (find) and bookkeeping (primary, the victim
 * list's fast exits: _fastpath_entries.h).  Each function does what core.py's reserve, put_small
 * and seal do, field for field and in the same order, under the same lock and dirty mark, so that C and
 * Python writers share a pool freely:
 *
 *   reserve   a slot from the free list, key cells and blocks where the two cursors point or the next
 *             free run beyond them (a pool with room, or the run an eviction or a replaced value just
 *             freed); in a full pool, step by step as Core._alloc_slot, _alloc_kcells and _alloc_blocks
 *             do, evicting for each (evict_one: _fastpath_evict.c); when nothing
 *             can go, or a field looks damaged, Core.reserve_or_corrupt does it all, lock held (and
 *             raises PoolFull);
 *   copy      copy_hash (the fused copy and checksum), inside the lock for values up to put_in_lock,
 *             outside it (the GIL released too) for larger ones, which are reserved in one lock hold and
 *             sealed in another, as tiers.py does;
 *   seal      the new entry stamped (sequence numbers, times, the LFU tick, the victim list told), chained
 *             into its bucket and made SEALED; an old value of the key removed first.
 *
 * As in the read path, anything unusual is answered SLOW before anything changed (the lock busy or
 * dirty, a damaged chain, a segment gone): the caller then runs the Python path.  An error raised by the
 * reserve hook leaves the metadata consistent when it is a CortexCacheError other than SegmentCorrupt
 * (PoolFull: the lock is given back clean); any other leaves the dirty mark for the next holder's repair,
 * as Core.locked does. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_fastpath.h"
#include "_fastpath_entries.h"

/* Is the run [first, first + n) of a one-byte-per-cell map free? */
static int run_free(const uint8_t *map, uint64_t first, uint64_t n) {
    for (uint64_t k = 0; k < n; k++)
        if (LOAD(map[first + k])) return 0;
    return 1;
}

/* allocator.find_run: the first run of k free cells at or after `hint`, else the first before it
 * (wrapping), or -1.  A plain scan: the cursor's neighbourhood is usually free. */
static int64_t find_run(const uint8_t *map, uint64_t n, uint64_t k, uint64_t hint) {
    if (k < 1 || k > n || hint > n) return -1;
    uint64_t ranges[2][2] = {{hint, n}, {0, hint + k - 1 < n ? hint + k - 1 : n}};
    for (int r = 0; r < 2; r++) {
        uint64_t run = 0;
        for (uint64_t j = ranges[r][0]; j < ranges[r][1]; j++) {
            if (LOAD(map[j]))
                run = 0;
            else if (++run == k)
                return (int64_t)(j + 1 - k);
        }
    }
    return -1;
}

/* allocator.run_around: after freeing [first, first + count), the start of a free run of k blocks that
 * touches it, or -1 (an eviction's check: each victim costs O(k), not a scan). */
static int64_t run_around(const uint8_t *map, uint64_t n, uint64_t first, uint64_t count, uint64_t k) {
    uint64_t lo = first >= k - 1 ? first - (k - 1) : 0;
    uint64_t hi = first + count + (k - 1) < n ? first + count + (k - 1) : n;
    uint64_t run = 0;
    for (uint64_t j = lo; j < hi; j++) {
        if (LOAD(map[j]))
            run = 0;
        else if (++run == k)
            return (int64_t)(j + 1 - k);
    }
    return -1;
}

/* Core._free_slot of a slot just taken from the free list. */
void give_slot(Fast *s, int64_t i) {
    s->state[i] = FREE;
    s->pins[i] = 0;
    s->khash[i] = 0;
    s->cks[i] = 0;
    s->next[i] = (int32_t)*s->free_slot;
    *s->free_slot = i;
}

/* Core._free_kcells of a run just taken. */
void give_kcells(Fast *s, uint64_t kf, uint64_t k) {
    memset(s->kmap + kf, 0, k);
    *s->used_kcells -= k;
    *s->key_hint = kf;
}

/* Core.reserve (lock held): _alloc_slot, _alloc_kcells and _alloc_blocks step by step -- the free list's
 * head, the run at each cursor or the next free one beyond it -- each evicting (evict_one, the policy's victim
 * list's choice) until it has what it needs when the pool is full, and placing as they do, so the pool
 * ends as core.py would leave it.  1 reserved; 0 left to Python with what this took given back (nothing
 * could be evicted: Core.reserve then raises PoolFull; or a damaged field); -1 the hook raised (what this
 * took given back). */
int reserve_in_c(Fast *s, const char *kb, uint64_t klen, uint64_t kh, uint32_t flags, uint64_t vlen,
                 uint64_t nblk, int64_t *slot, uint64_t *off) {
    uint64_t vf = 0, vn = 0;
    int rc;
    int64_t i;
    while ((i = LOAD(*s->free_slot)) < 0)
        if ((rc = evict_one(s, &vf, &vn)) <= 0) return rc;
    if ((uint64_t)i >= s->n_slots || LOAD(s->state[i]) != FREE) return 0;
    int32_t after = LOAD(s->next[i]);
    if (after < -1 || (int64_t)after >= (int64_t)s->n_slots) return 0;
    *s->free_slot = after;
    s->next[i] = -1;
    uint64_t k = (klen + KEY_CELL - 1) / KEY_CELL;
    uint64_t kf = LOAD(*s->key_hint);
    int64_t at;
    if (kf <= s->n_kcells && k <= s->n_kcells - kf && run_free(s->kmap, kf, k)) {
        at = (int64_t)kf;
    } else {
        at = find_run(s->kmap, s->n_kcells, k, kf);
        while (at < 0) {
            if ((rc = evict_one(s, &vf, &vn)) <= 0) {
                give_slot(s, i);
                return rc;
            }
            at = find_run(s->kmap, s->n_kcells, k, 0);
        }
    }
    kf = (uint64_t)at;
    memset(s->kmap + kf, 1, k);
    *s->used_kcells += k;
    *s->key_hint = kf + k < s->n_kcells ? kf + k : 0;
    uint64_t first = LOAD(*s->alloc_hint);
    if (first <= s->n_blocks && nblk <= s->n_blocks - first && run_free(s->bmap, first, nblk)) {
        at = (int64_t)first;
    } else {
        uint64_t used = LOAD(*s->used_blocks);
        at = used <= s->n_blocks && nblk <= s->n_blocks - used ? find_run(s->bmap, s->n_blocks, nblk, first) : -1;
        while (at < 0) {
            if ((rc = evict_one(s, &vf, &vn)) <= 0) {
                give_kcells(s, kf, k);
                give_slot(s, i);
                return rc;
            }
            /* The victim's own run when it is as long (equal-sized KV chunks), else its neighbours. */
            if (vn >= nblk && vf <= s->n_blocks - nblk)
                at = (int64_t)vf;
            else if (vn > 0 && vf < s->n_blocks)
                at = run_around(s->bmap, s->n_blocks, vf, vn, nblk);
            else
                at = find_run(s->bmap, s->n_blocks, nblk, 0);
        }
    }
    first = (uint64_t)at;
    memset(s->bmap + first, 1, nblk);
    *s->used_blocks += nblk;
    *s->alloc_hint = first + nblk < s->n_blocks ? first + nblk : 0;
    memcpy(s->base + s->keys_off + kf * KEY_CELL, kb, klen);
    s->kcell[i] = kf;
    s->klen[i] = (uint32_t)klen;
    s->flags_col[i] = flags;
    s->pins[i] = 0;
    s->opid[i] = s->pid;
    s->khash[i] = kh;
    s->vlen[i] = vlen;
    s->first[i] = first;
    s->nblk[i] = nblk;
    s->ostart[i] = s->pstart;
    s->state[i] = 1; /* WRITING */
    *slot = i;
    *off = s->data_off + first * s->bs;
    return 1;
}

/* After the reserve hook raised: 1 if the metadata is consistent (give the lock back clean). */
static int error_is_clean(Fast *s) {
    return PyErr_ExceptionMatches(s->err_base) && !PyErr_ExceptionMatches(s->err_corrupt);
}

/* Core.reserve (lock held): in C, else (no room, a damaged field) by Core.reserve_or_corrupt.  1 reserved,
 * -1 an error (exception set). */
static int reserve(Fast *s, PyObject *kbo, uint64_t kh, uint32_t flags, uint64_t vlen, uint64_t nblk,
                   int64_t *slot, uint64_t *off) {
    const char *kb = PyBytes_AS_STRING(kbo);
    uint64_t klen = (uint64_t)PyBytes_GET_SIZE(kbo);
    int rc = reserve_in_c(s, kb, klen, kh, flags, vlen, nblk, slot, off);
    if (rc != 0) return rc;
    PyObject *r = PyObject_CallFunction(s->reserve_hook, "OKIKK", kbo, (unsigned long long)kh, (unsigned)flags,
                                        (unsigned long long)vlen, (unsigned long long)nblk);
    if (r == NULL) return -1;
    long long i = -1;
    unsigned long long o = 0;
    int ok = PyArg_ParseTuple(r, "LK", &i, &o);
    Py_DECREF(r);
    if (!ok) return -1;
    *slot = i;
    *off = o;
    return 1;
}

/* Core.remove of sealed entry i (lock held): 0, or -1 with nothing changed when i's fields or chain look
 * damaged (the caller raises; the repair fixes them).  Each field is loaded once, checked and only the
 * checked value used: another process may change any of them meanwhile (find(), _fastpath_entries.h). */
int remove_entry(Fast *s, int64_t i) {
    uint64_t f = LOAD(s->first[i]), n = LOAD(s->nblk[i]), kf = LOAD(s->kcell[i]);
    uint64_t k = ((uint64_t)LOAD(s->klen[i]) + KEY_CELL - 1) / KEY_CELL;
    if (f > s->n_blocks || n > s->n_blocks - f || kf > s->n_kcells || k > s->n_kcells - kf) return -1;
    int32_t *link = &s->buckets[LOAD(s->khash[i]) & s->mask];
    for (uint64_t steps = 0;; steps++) {
        int32_t j = LOAD(*link);
        if (j == i) break;
        if (j < 0 || (uint64_t)j >= s->n_slots || steps > s->n_slots) return -1;
        link = &s->next[j];
    }
    *link = s->next[i];
    if (s->qkind) { /* QueueVictims.removed */
        uint8_t q = s->queue[i] & 1;
        if (s->qcount[q]) s->qcount[q] -= 1;
    }
    *s->n_entries -= 1;
    *s->gone_seq += 1; /* a memoized lookup may have counted it (layout.py, gone_seq) */
    if (s->pins[i]) {
        s->state[i] = ZOMBIE;
        return 0;
    }
    free_room(s, i, f, n, kf, k);
    return 0;
}

/* Core._free_entry of slot i, its n blocks from f and k key cells from kf (checked by the caller): the
 * blocks, key cells and the slot back (lock held). */
void free_room(Fast *s, int64_t i, uint64_t f, uint64_t n, uint64_t kf, uint64_t k) {
    memset(s->bmap + f, 0, n);
    *s->used_blocks -= n;
    *s->alloc_hint = f;
    give_kcells(s, kf, k);
    give_slot(s, i);
}

/* Ghosts.take: forget hash kh if ring g holds it; its depth (ghosts added after it) if it did, else -1.
 * Links are checked: a damaged chain ends the walk (the next repair rebuilds it). */
static int64_t ghost_take(GhostRing *g, uint64_t kh) {
    if (!g->n) return -1;
    if (!kh) kh = 1; /* 0 marks an empty place */
    int32_t *link = &g->bkt[kh & g->mask];
    for (uint64_t steps = 0; steps <= g->n; steps++) {
        int32_t p = LOAD(*link); /* loaded once: another process may change it (remove_entry) */
        if (p < 0 || (uint64_t)p >= g->n) break;
        if (g->hash[p] == kh) {
            *link = g->next[p];
            g->hash[p] = 0;
            g->next[p] = -1;
            if (*g->live) *g->live -= 1;
            /* place p holds the ghost whose sequence number s has s % n == p, the last one before head */
            uint64_t last = *g->head ? *g->head - 1 : 0;
            return (int64_t)((last % g->n + g->n - (uint64_t)p) % g->n);
        }
        link = &g->next[p];
    }
    return -1;
}

/* Ghosts._forget: take place p out of its chain and empty it. */
static void ghost_forget(GhostRing *g, int32_t p) {
    int32_t *link = &g->bkt[g->hash[p] & g->mask];
    for (uint64_t steps = 0; steps <= g->n; steps++) {
        int32_t j = LOAD(*link);
        if (j < 0 || (uint64_t)j >= g->n) break;
        if (j == p) {
            *link = g->next[p];
            break;
        }
        link = &g->next[j];
    }
    g->hash[p] = 0;
    g->next[p] = -1;
    if (*g->live) *g->live -= 1;
}

/* Ghosts.add (lock held): remember hash kh in ring g, forgetting what falls out of its window of
 * factor x `entries` ghosts (kh itself is not looked for: its put took it back). */
void ghost_add(GhostRing *g, uint64_t kh, uint64_t entries) {
    if (!g->n) return;
    if (!kh) kh = 1;
    uint64_t head = *g->head, tail = *g->tail;
    uint64_t window = g->factor * (entries ? entries : 1);
    if (window > g->n || window / (entries ? entries : 1) != g->factor) window = g->n;
    if (tail > head || head - tail > g->n) tail = head; /* damaged: the next repair says so */
    while (head + 1 - tail > window) {
        uint64_t q = tail % g->n;
        if (g->hash[q]) ghost_forget(g, (int32_t)q);
        tail++;
    }
    *g->tail = tail;
    uint64_t p = head % g->n, b = kh & g->mask;
    g->hash[p] = kh;
    g->next[p] = g->bkt[b];
    g->bkt[b] = (int32_t)p;
    *g->head = head + 1;
    *g->live += 1;
    /* The next add forgets the ghost at the tail: its chain's head, fetched now, is in cache by then. */
    uint64_t next = g->hash[tail % g->n];
    if (next) __builtin_prefetch(&g->bkt[next & g->mask]);
}

/* Fast.evicted(slot): QueueVictims.evicted -- the victim's key goes into its queue's ghost ring.  The
 * caller (Core.evict_one, in Python) holds the lock. */
PyObject *do_evicted(Fast *s, PyObject *const *args, Py_ssize_t nargs) {
    long long i = nargs == 1 ? PyLong_AsLongLong(args[0]) : -1;
    if (i == -1 && PyErr_Occurred()) return NULL;
    if (!s->qkind || i < 0 || (uint64_t)i >= s->n_slots) {
        PyErr_SetString(PyExc_ValueError, "evicted(slot) of a queue policy's pool");
        return NULL;
    }
    ghost_add(&s->ghost[s->queue[i] & 1], s->khash[i], *s->n_entries);
    Py_RETURN_NONE;
}

/* QueueVictims._adapt_arc: a ghost of queue 0 (sign 1) or 1 (sign -1) moves ARC's p. */
static void queue_adapt_arc(Fast *s, int sign, uint64_t other, uint64_t this, uint64_t entries) {
    uint64_t step = other / (this ? this : 1);
    double t = *s->qtarget + sign * (double)(step ? step : 1);
    t = t < 0.0 ? 0.0 : t;
    *s->qtarget = t < (double)entries ? t : (double)entries;
}

/* eviction.Auto's constants (the Python reference reads them there; these must be the same). */
#define AUTO_TAPER 3.0
#define AUTO_NEAR 0.05
#define AUTO_RECENCY 0.3
#define AUTO_LOOP_ENTER 0.5
#define AUTO_LOOP_LEAVE 0.4
enum { AUTO_ADAPTIVE, AUTO_LOOP };
static const double AUTO_NEAR_BOOST[2] = {12.0, 4.0};

/* queues._auto_weight: how much a ghost `depth` deep moves auto's share. */
static double auto_weight(int64_t depth, double n, double boost) {
    double far = 1.0 - (double)depth / (AUTO_TAPER * n), near = 1.0 - (double)depth / (AUTO_NEAR * n);
    far = far > 0.0 ? far : 0.0;
    near = near > 0.0 ? near : 0.0;
    return far * (1.0 + boost * near);
}

/* QueueVictims._auto_admit: auto's regime from its two rates, then the queue of key hash kh (and, outside
 * the loop regime, the move of queue 0's share), in the Python reference's order of operations. */
static uint8_t auto_admit(Fast *s, uint64_t kh, uint64_t entries, uint64_t live0, uint64_t live1) {
    double n = (double)(entries ? entries : 1);
    /* The ghost taken first (the reference asks whether it is one, then takes it): one walk of each chain,
     * not two, and the same bits, since the rates below read neither ring. */
    int64_t d0 = ghost_take(&s->ghost[0], kh);
    int64_t d1 = d0 < 0 ? ghost_take(&s->ghost[1], kh) : -1;
    double ghost = d0 >= 0 || d1 >= 0 ? 1.0 : 0.0;
    uint64_t hits = *s->hits, seen = *s->qhits_seen;
    double fresh = hits >= seen ? (double)(hits - seen) : 0.0; /* a counter reset is no burst of hits */
    *s->qhits_seen = hits;
    double rate = *s->qghost_rate + (ghost - *s->qghost_rate) / n;
    double hit_rate = *s->qhit_rate + (fresh - *s->qhit_rate) / n;
    *s->qghost_rate = rate;
    *s->qhit_rate = hit_rate;
    if (*s->qregime == AUTO_LOOP) {
        if (rate < AUTO_LOOP_LEAVE) *s->qregime = AUTO_ADAPTIVE;
    } else if (rate > AUTO_LOOP_ENTER && hit_rate < rate) {
        *s->qregime = AUTO_LOOP;
    }
    if (*s->qregime == AUTO_LOOP) return d0 >= 0 ? 1 : 0;
    double t = *s->qtarget;
    if (d0 >= 0) {
        double ratio = (double)live1 / (double)(live0 ? live0 : 1);
        double w = auto_weight(d0, n, AUTO_NEAR_BOOST[0]) * (ratio > 1.0 ? ratio : 1.0);
        t = t + w / n;
        *s->qtarget = t < 1.0 ? t : 1.0;
        return 1;
    }
    if (d1 >= 0) {
        double ratio = (double)live0 / (double)(live1 ? live1 : 1);
        double w = auto_weight(d1, n, AUTO_NEAR_BOOST[1]) * (ratio > 1.0 ? ratio : 1.0);
        t = t - w / n;
        t = t > 0.0 ? t : 0.0;
        *s->qtarget = t;
        return t < AUTO_RECENCY ? 1 : 0;
    }
    return 0;
}

/* QueueVictims.admit (lock held): slot i, just given a new value, joins queue 1 if its key is a ghost of
 * either queue (the target moved), else queue 0 -- auto: as auto_admit says. */
static void queue_admit(Fast *s, int64_t i) {
    if (s->state[i] == SEALED) { /* written over in place: it leaves its queue first */
        uint8_t q = s->queue[i] & 1;
        if (s->qcount[q]) s->qcount[q] -= 1;
    }
    uint64_t kh = s->khash[i], entries = *s->n_entries;
    uint64_t live0 = *s->ghost[0].live, live1 = *s->ghost[1].live;
    uint8_t q = 1;
    if (s->qadapt == ADAPT_AUTO)
        q = auto_admit(s, kh, entries, live0, live1);
    else if (ghost_take(&s->ghost[0], kh) >= 0) {
        if (s->qadapt == ADAPT_ARC) queue_adapt_arc(s, 1, live1, live0, entries);
    } else if (ghost_take(&s->ghost[1], kh) >= 0) {
        if (s->qadapt == ADAPT_ARC) queue_adapt_arc(s, -1, live0, live1, entries);
    } else
        q = 0;
    s->queue[i] = q;
    s->qfreq[i] = 0;
    s->qseq[i] = ++*s->qclock;
    s->qcount[q] += 1;
}

/* Core._stamp: the metadata of a new put on slot i (lock held). */
void stamp(Fast *s, int64_t i, uint64_t cks, double ttl, int64_t prio, double t) {
    double e = ttl > 0 ? t + ttl : 0.0;
    uint64_t seq = *s->seq + 1;
    *s->seq = seq;
    s->cks[i] = cks;
    s->created[i] = t;
    s->lastacc[i] = t;
    s->expiry[i] = e;
    s->iseq[i] = seq;
    s->aseq[i] = seq;
    s->acount[i] = 1;
    uint64_t ops = *s->ops + 1; /* Core._tick */
    *s->ops = ops;
    uint64_t period = *s->lfu_period;
    if (period && ops % period == 0) *s->lfu_epoch += 1;
    s->lfuep[i] = *s->lfu_epoch;
    s->prio[i] = prio;
    s->ostart[i] = 0;
    s->opid[i] = 0;
    *s->puts += 1;
    /* VictimCache.on_score_change and on_expiry_set, as touch() does. */
    if (!s->monotone && *s->cand_valid && below_last_victim(s, i, t)) offer(s, i, t);
    if (s->qkind) {
        queue_admit(s, i);
        if (e > 0 && e < *s->cand1_next_expiry) *s->cand1_next_expiry = e;
    }
    if (e > 0 && e < *s->cand_next_expiry) *s->cand_next_expiry = e;
}

/* Core.seal's end: chain stamped slot i into its bucket and make it visible (lock held). */
void chain_in(Fast *s, int64_t i, uint64_t kh) {
    int32_t *head = &s->buckets[kh & s->mask];
    s->next[i] = *head;
    *head = (int32_t)i;
    s->state[i] = SEALED;
    *s->n_entries += 1;
}

/* Copy a value into the segment and checksum it, the GIL let go for large ones (copy_hash's rule). */
static uint64_t copy_in(char *dst, const char *src, uint64_t n) {
    struct copy_piece one = {dst, src, (size_t)n};
    uint64_t h;
    if (n >= COPY_HASH_GIL_FREE) {
        Py_BEGIN_ALLOW_THREADS
        h = copy_hash_impl(&one, 1, NULL, 0);
        Py_END_ALLOW_THREADS
    } else {
        h = copy_hash_impl(&one, 1, NULL, 0);
    }
    return h;
}

/* The places at the heads of key hash kh's chains in both ghost rings, fetched ahead of the admission's
 * walks (a ghost ring is larger than the caches close to the core: each walk would wait on memory). */
static void prefetch_ghost_heads(Fast *s, uint64_t kh) {
    for (int r = 0; r < 2; r++) {
        GhostRing *g = &s->ghost[r];
        if (!g->n) continue;
        int32_t p = g->bkt[(kh ? kh : 1) & g->mask];
        if (p >= 0 && (uint64_t)p < g->n) {
            __builtin_prefetch(&g->hash[p]);
            __builtin_prefetch(&g->next[p]);
        }
    }
}

/* One put whose value is copied in this lock hold: Core.put_small.  1 done (*slot), 2 SLOW (nothing
 * changed), -1 error (exception set; *dirty says whether the metadata may be half-changed). */
static int put_held(Fast *s, PyObject *kbo, uint64_t kh, uint32_t flags, const char *v, uint64_t vlen,
                    uint64_t nblk, double ttl, int64_t prio, double t, int64_t *slot, int *dirty) {
    if (s->qkind) { /* the admission looks the key up in both ghost rings: their buckets, on the way */
        for (int r = 0; r < 2; r++)
            if (s->ghost[r].n) __builtin_prefetch(&s->ghost[r].bkt[(kh ? kh : 1) & s->ghost[r].mask]);
    }
    Found f;
    int rc = find(s, PyBytes_AS_STRING(kbo), PyBytes_GET_SIZE(kbo), kh, &f);
    if (rc < 0) return 2;
    *dirty = 1;
    if (rc == 1) {
        int64_t old = f.slot;
        if (s->nblk[old] == nblk && s->pins[old] == 0) {
            /* The same room and nobody reading it: written over in place.  insert_seq first, so that a
             * seqlock reader copying it outside the lock reads again. */
            s->iseq[old] = 0;
            *s->gone_seq += 1;
            uint64_t cks = copy_in(s->base + f.off, v, vlen);
            s->vlen[old] = vlen;
            s->flags_col[old] = flags;
            stamp(s, old, cks, ttl, prio, t);
            *slot = old;
            *dirty = 0;
            return 1;
        }
        (void)remove_entry(s, old); /* find() walked its chain */
    }
    int64_t i;
    uint64_t off;
    if (reserve(s, kbo, kh, flags, vlen, nblk, &i, &off) < 0) {
        *dirty = !error_is_clean(s);
        return -1;
    }
    if (s->qkind) prefetch_ghost_heads(s, kh); /* their buckets came in meanwhile; the copy hides the rest */
    uint64_t cks = copy_in(s->base + off, v, vlen);
    stamp(s, i, cks, ttl, prio, t);
    chain_in(s, i, kh);
    *slot = i;
    *dirty = 0;
    return 1;
}

/* Seal reserved slot i as key kbo's value, replacing its old one (lock held): 1 sealed, 0 the slot is
 * no longer this reservation (a repair took it back: Tiers.seal's silent case), 2 SLOW (nothing changed:
 * a damaged chain; the Python path seals), -1 error (the metadata half-changed). */
static int seal_held(Fast *s, int64_t i, PyObject *kbo, uint64_t kh, uint64_t cks, double ttl, int64_t prio,
                     double t) {
    if (i < 0 || (uint64_t)i >= s->n_slots || LOAD(s->state[i]) != 1 /* WRITING */) return 0;
    Found f;
    int rc = find(s, PyBytes_AS_STRING(kbo), PyBytes_GET_SIZE(kbo), kh, &f);
    if (rc < 0) return 2;
    if (rc == 1) (void)remove_entry(s, f.slot);
    stamp(s, i, cks, ttl, prio, t);
    chain_in(s, i, kh);
    return 1;
}

/* The pending exception, as one key's result in a batch (PoolFull and its kind: the batch goes on). */
static PyObject *error_result(void) {
    PyObject *tp, *val, *tb;
    PyErr_Fetch(&tp, &val, &tb);
    PyErr_NormalizeException(&tp, &val, &tb);
    if (tb != NULL) PyException_SetTraceback(val, tb);
    Py_XDECREF(tp);
    Py_XDECREF(tb);
    return val;
}

/* A batch's result list given up at item `from` (an error): its unset items filled, so it can be freed. */
static void fill_none(PyObject *list, Py_ssize_t from) {
    for (Py_ssize_t r = from; r < PyList_GET_SIZE(list); r++) PyList_SET_ITEM(list, r, Py_NewRef(Py_None));
}

/* The arguments every put shares, parsed: key bytes and hash, slot flags, blocks. */
typedef struct {
    PyObject *kb;
    uint64_t kh, nblk;
    uint32_t flags;
} PutKey;

static int parse_put_key(PyObject *kb, PyObject *kh, PyObject *flags, PyObject *nblk, PutKey *out) {
    if (!PyBytes_Check(kb)) {
        PyErr_SetString(PyExc_TypeError, "key must be bytes");
        return -1;
    }
    out->kb = kb;
    out->kh = PyLong_AsUnsignedLongLong(kh);
    out->flags = (uint32_t)PyLong_AsUnsignedLong(flags);
    out->nblk = PyLong_AsUnsignedLongLong(nblk);
    return PyErr_Occurred() ? -1 : 0;
}

/* The number of blocks a value of vlen bytes takes must be what the caller said (layout.blocks_for): a
 * mismatch is a caller's bug, and would write past the reservation. */
static int blocks_match(Fast *s, uint64_t vlen, uint64_t nblk) {
    uint64_t want = vlen == 0 ? 0 : (vlen + s->bs - 1) / s->bs;
    if (want != nblk || nblk > s->n_blocks) {
        PyErr_SetString(PyExc_ValueError, "fast path: blocks do not match the value's length");
        return 0;
    }
    return 1;
}

/* put(kb, kh, flags, value, nblk, ttl, prio) -> slot | SLOW | (slot, checksum): Pool.put of one value.
 * A value up to put_in_lock is put in one lock hold; a larger one is reserved, copied and checksummed with
 * neither the lock nor the GIL held, then sealed.  (slot, checksum): the value is copied but the lock was
 * busy for its seal -- the caller seals it (Core.locked(Tiers.seal, ...)). */
FAST_METHOD(put) {
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "put(kb, kh, flags, value, nblk, ttl, prio)");
        return NULL;
    }
    PutKey k;
    if (parse_put_key(args[0], args[1], args[2], args[4], &k) < 0) return NULL;
    double ttl = args[5] == Py_None ? 0.0 : PyFloat_AsDouble(args[5]);
    int64_t prio = PyLong_AsLongLong(args[6]);
    if (PyErr_Occurred()) return NULL;
    Py_buffer vb;
    if (PyObject_GetBuffer(args[3], &vb, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    PyObject *result = NULL;
    uint64_t vlen = (uint64_t)vb.len;
    if (!blocks_match(self, vlen, k.nblk)) goto done;
    int got = take(self);
    if (got <= 0) {
        if (got == 0) result = Py_NewRef(SLOW);
        goto done;
    }
    double t = now();
    int64_t slot;
    if (vlen <= self->put_in_lock) {
        int dirty = 0;
        int rc = put_held(self, k.kb, k.kh, k.flags, vb.buf, vlen, k.nblk, ttl, prio, t, &slot, &dirty);
        if (rc == 2) {
            give(self, 1);
            result = Py_NewRef(SLOW);
        } else if (rc < 0) {
            give(self, !dirty);
        } else if (guard_gone(self->guard)) { /* the copy met a truncated segment: the Python path raises */
            give(self, 0);
            result = Py_NewRef(SLOW);
        } else {
            give(self, 1);
            result = PyLong_FromLongLong(slot);
        }
        goto done;
    }
    uint64_t off;
    if (reserve(self, k.kb, k.kh, k.flags, vlen, k.nblk, &slot, &off) < 0) {
        give(self, error_is_clean(self));
        goto done;
    }
    give(self, 1);
    uint64_t cks = copy_in(self->base + off, vb.buf, vlen);
    if (guard_gone(self->guard) || (got = take(self)) <= 0) {
        result = got < 0 ? NULL : Py_BuildValue("(LK)", (long long)slot, (unsigned long long)cks);
        goto done;
    }
    int rc = seal_held(self, slot, k.kb, k.kh, cks, ttl, prio, now());
    if (rc == 2) {
        give(self, 1);
        result = Py_BuildValue("(LK)", (long long)slot, (unsigned long long)cks);
    } else {
        give(self, rc >= 0);
        if (rc >= 0) result = PyLong_FromLongLong(slot);
    }
done:
    PyBuffer_Release(&vb);
    return result;
}

/* put_many(items: list[(kb, kh, flags, value, nblk)], ttl, prio) -> list of None | error | SLOW, or SLOW
 * (the lock busy: nothing done).  Every value up to put_in_lock, all in one lock hold (batch.put_many's
 * small ones); a key's CortexCacheError (PoolFull) is its result and the batch goes on. */
FAST_METHOD(put_many) {
    if (nargs != 3 || !PyList_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "put_many(items: list, ttl, prio)");
        return NULL;
    }
    PyObject *items = args[0];
    double ttl = args[1] == Py_None ? 0.0 : PyFloat_AsDouble(args[1]);
    int64_t prio = PyLong_AsLongLong(args[2]);
    if (PyErr_Occurred()) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(items);
    PutKey *keys = PyMem_Calloc(n ? n : 1, sizeof(PutKey));
    Py_buffer *bufs = PyMem_Calloc(n ? n : 1, sizeof(Py_buffer));
    PyObject *result = NULL;
    Py_ssize_t nbufs = 0;
    if (!keys || !bufs) {
        PyErr_NoMemory();
        goto done;
    }
    /* Everything parsed and checked before the lock is taken: a bad item changes nothing. */
    for (; nbufs < n; nbufs++) {
        PyObject *it = PyList_GET_ITEM(items, nbufs);
        if (!PyTuple_Check(it) || PyTuple_GET_SIZE(it) != 5) {
            PyErr_SetString(PyExc_TypeError, "put_many: items are (kb, kh, flags, value, nblk)");
            goto done;
        }
        if (parse_put_key(PyTuple_GET_ITEM(it, 0), PyTuple_GET_ITEM(it, 1), PyTuple_GET_ITEM(it, 2),
                          PyTuple_GET_ITEM(it, 4), &keys[nbufs]) < 0)
            goto done;
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(it, 3), &bufs[nbufs], PyBUF_C_CONTIGUOUS) < 0) goto done;
        if ((uint64_t)bufs[nbufs].len > self->put_in_lock || !blocks_match(self, (uint64_t)bufs[nbufs].len,
                                                                              keys[nbufs].nblk)) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "put_many: a value larger than put_in_lock");
            nbufs++;
            goto done;
        }
    }
    PyObject *out = PyList_New(n);
    if (out == NULL) goto done;
    int got = take(self);
    if (got <= 0) {
        Py_DECREF(out);
        if (got == 0) result = Py_NewRef(SLOW);
        goto done;
    }
    double t = now();
    for (Py_ssize_t m = 0; m < n; m++) {
        int64_t slot;
        int dirty = 0;
        int rc = put_held(self, keys[m].kb, keys[m].kh, keys[m].flags, bufs[m].buf, (uint64_t)bufs[m].len,
                          keys[m].nblk, ttl, prio, t, &slot, &dirty);
        if (rc < 0 && !dirty) { /* PoolFull and its kind: this key's result; the metadata is whole */
            PyList_SET_ITEM(out, m, error_result());
            continue;
        }
        if (rc < 0) {
            give(self, 0);
            fill_none(out, m);
            Py_DECREF(out);
            goto done;
        }
        PyList_SET_ITEM(out, m, Py_NewRef(rc == 2 ? SLOW : Py_None));
    }
    if (guard_gone(self->guard)) { /* a copy met a truncated segment: the Python path raises */
        give(self, 0);
        Py_DECREF(out);
        result = Py_NewRef(SLOW);
        goto done;
    }
    give(self, 1);
    result = out;
done:
    for (Py_ssize_t m = 0; m < nbufs; m++) PyBuffer_Release(&bufs[m]);
    PyMem_Free(bufs);
    PyMem_Free(keys);
    return result;
}

/* reserve_many(items: list[(kb, kh, flags, nbytes, nblk)]) -> list of (slot, offset) | error, or SLOW (the
 * lock busy: nothing reserved).  One lock hold for all (Pool.reserve_write_many, batch.put_large_many); a
 * key's PoolFull is its result and the batch goes on. */
FAST_METHOD(reserve_many) {
    if (nargs != 1 || !PyList_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "reserve_many(items: list)");
        return NULL;
    }
    PyObject *items = args[0];
    Py_ssize_t n = PyList_GET_SIZE(items);
    PutKey *keys = PyMem_Calloc(n ? n : 1, sizeof(PutKey));
    uint64_t *lens = PyMem_Calloc(n ? n : 1, sizeof(uint64_t));
    PyObject *result = NULL, *out = NULL;
    if (!keys || !lens) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t m = 0; m < n; m++) {
        PyObject *it = PyList_GET_ITEM(items, m);
        if (!PyTuple_Check(it) || PyTuple_GET_SIZE(it) != 5) {
            PyErr_SetString(PyExc_TypeError, "reserve_many: items are (kb, kh, flags, nbytes, nblk)");
            goto done;
        }
        if (parse_put_key(PyTuple_GET_ITEM(it, 0), PyTuple_GET_ITEM(it, 1), PyTuple_GET_ITEM(it, 2),
                          PyTuple_GET_ITEM(it, 4), &keys[m]) < 0)
            goto done;
        lens[m] = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(it, 3));
        if (PyErr_Occurred() || !blocks_match(self, lens[m], keys[m].nblk)) goto done;
    }
    out = PyList_New(n);
    if (out == NULL) goto done;
    int got = take(self);
    if (got <= 0) {
        if (got == 0) result = Py_NewRef(SLOW);
        goto done;
    }
    for (Py_ssize_t m = 0; m < n; m++) {
        int64_t slot;
        uint64_t off;
        if (reserve(self, keys[m].kb, keys[m].kh, keys[m].flags, lens[m], keys[m].nblk, &slot, &off) < 0) {
            if (!error_is_clean(self)) {
                give(self, 0);
                fill_none(out, m);
                goto done; /* the reservations so far are this process's: the repair takes them back */
            }
            PyList_SET_ITEM(out, m, error_result());
            continue;
        }
        PyObject *pair = Py_BuildValue("(LK)", (long long)slot, (unsigned long long)off);
        if (pair == NULL) {
            give(self, 0);
            fill_none(out, m);
            goto done;
        }
        PyList_SET_ITEM(out, m, pair);
    }
    give(self, 1);
    result = Py_NewRef(out);
done:
    Py_XDECREF(out);
    PyMem_Free(keys);
    PyMem_Free(lens);
    return result;
}

/* seal_many(items: list[(slot, kb, kh, checksum, ttl, prio)]) -> list of True (sealed) | False (the
 * reservation was taken back by a repair) | SLOW, or SLOW (the lock busy: nothing sealed).  One lock hold
 * for all (Pool.commit_many, EntryWriter.commit, batch.put_large_many). */
FAST_METHOD(seal_many) {
    if (nargs != 1 || !PyList_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "seal_many(items: list)");
        return NULL;
    }
    PyObject *items = args[0];
    Py_ssize_t n = PyList_GET_SIZE(items);
    struct sealing { int64_t slot, prio; PyObject *kb; uint64_t kh, cks; double ttl; } *todo;
    todo = PyMem_Calloc(n ? n : 1, sizeof *todo);
    if (todo == NULL) return PyErr_NoMemory();
    PyObject *out = NULL;
    /* Everything parsed before the lock is taken: a bad item changes nothing. */
    for (Py_ssize_t m = 0; m < n; m++) {
        PyObject *it = PyList_GET_ITEM(items, m);
        if (!PyTuple_Check(it) || PyTuple_GET_SIZE(it) != 6 || !PyBytes_Check(PyTuple_GET_ITEM(it, 1))) {
            PyErr_SetString(PyExc_TypeError, "seal_many: items are (slot, kb, kh, checksum, ttl, prio)");
            goto done;
        }
        struct sealing *w = &todo[m];
        w->slot = PyLong_AsLongLong(PyTuple_GET_ITEM(it, 0));
        w->kb = PyTuple_GET_ITEM(it, 1);
        w->kh = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(it, 2));
        w->cks = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(it, 3));
        PyObject *ttl = PyTuple_GET_ITEM(it, 4);
        w->ttl = ttl == Py_None ? 0.0 : PyFloat_AsDouble(ttl);
        w->prio = PyLong_AsLongLong(PyTuple_GET_ITEM(it, 5));
        if (PyErr_Occurred()) goto done;
    }
    PyObject *list = PyList_New(n);
    if (list == NULL) goto done;
    int got = take(self);
    if (got <= 0) {
        Py_DECREF(list);
        if (got == 0) out = Py_NewRef(SLOW);
        goto done;
    }
    double t = now();
    for (Py_ssize_t m = 0; m < n; m++) {
        struct sealing *w = &todo[m];
        int rc = seal_held(self, w->slot, w->kb, w->kh, w->cks, w->ttl, w->prio, t);
        if (rc < 0) {
            give(self, 0);
            fill_none(list, m);
            Py_DECREF(list);
            goto done;
        }
        PyList_SET_ITEM(list, m, Py_NewRef(rc == 2 ? SLOW : rc ? Py_True : Py_False));
    }
    give(self, 1);
    out = list;
done:
    PyMem_Free(todo);
    return out;
}
