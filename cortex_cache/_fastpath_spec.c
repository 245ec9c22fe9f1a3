/* Fast.__init__(buffer, fd, spec): a Fast over one mapped segment, from the layout spec core_fast.py builds
 * (layout.py's offsets and widths, the policy, the hooks into Python).  Every region the object will
 * touch is checked to lie inside the mapping before any pointer is made from it. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_fastpath.h"

static int get_u64(PyObject *spec, const char *name, uint64_t *out) {
    PyObject *v = PyDict_GetItemString(spec, name);
    if (v == NULL) {
        PyErr_Format(PyExc_KeyError, "fast path spec lacks %s", name);
        return -1;
    }
    unsigned long long x = PyLong_AsUnsignedLongLong(v);
    if (x == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    *out = x;
    return 0;
}

static PyObject *get_obj(PyObject *spec, const char *name) {
    PyObject *v = PyDict_GetItemString(spec, name);
    if (v == NULL || v == Py_None) return NULL;
    Py_INCREF(v);
    return v;
}

/* The victim lists (_fastpath_evict.c): "lists" of them (two for a queue policy), "list_rows" rows each,
 * the columns' offsets ("victims_<column>", list q from row q x list_rows), each list's words ("l<q>_<word>",
 * absolute offsets), the policy's identity column and the eviction counters; all checked inside the
 * mapping. */
static int init_victim_lists(Fast *self, PyObject *spec, uint64_t size) {
    static const char *words[] = {"valid", "count", "pos", "next_expiry", "max_primary", "max_secondary", "epoch"};
    uint64_t lists, rows, cols[4], ident, counters[3], w[2][7];
    const char *col_names[4] = {"victims_slot", "victims_ident", "victims_primary", "victims_secondary"};
    const char *counter_names[3] = {"h_expirations", "h_evictions", "h_bytes_evicted"};
    if (get_u64(spec, "lists", &lists) < 0 || get_u64(spec, "list_rows", &rows) < 0 ||
        get_u64(spec, "ident_col", &ident) < 0)
        return -1;
    if (lists < 1 || lists > 2 || rows < 1 || rows > UINT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "fast path: bad victim lists");
        return -1;
    }
    uint64_t widths[4] = {4, 8, 8, 8};
    for (int c = 0; c < 4; c++) {
        if (get_u64(spec, col_names[c], &cols[c]) < 0) return -1;
        if (cols[c] > size || lists * rows * widths[c] > size - cols[c] || cols[c] % widths[c]) goto outside;
    }
    if (ident > size || self->n_slots * 8 > size - ident || ident % 8) goto outside;
    for (int c = 0; c < 3; c++) {
        if (get_u64(spec, counter_names[c], &counters[c]) < 0) return -1;
        if (counters[c] > size - 8 || counters[c] % 8) goto outside;
    }
    for (uint64_t q = 0; q < lists; q++) {
        for (int k = 0; k < 7; k++) {
            char name[32];
            snprintf(name, sizeof name, "l%d_%s", (int)q, words[k]);
            if (get_u64(spec, name, &w[q][k]) < 0) return -1;
            uint64_t width = k < 3 ? 4 : 8;
            if (w[q][k] > size - width || w[q][k] % width) goto outside;
        }
    }
    char *b = self->base;
    for (uint64_t q = 0; q < lists; q++) {
        VList *l = &self->vl[q];
        l->valid = (volatile uint32_t *)(b + w[q][0]);
        l->count = (uint32_t *)(b + w[q][1]);
        l->pos = (uint32_t *)(b + w[q][2]);
        l->next_expiry = (double *)(b + w[q][3]);
        l->max_primary = (double *)(b + w[q][4]);
        l->max_secondary = (uint64_t *)(b + w[q][5]);
        l->epoch = (uint64_t *)(b + w[q][6]);
        l->slot = (int32_t *)(b + cols[0]) + q * rows;
        l->ident = (uint64_t *)(b + cols[1]) + q * rows;
        l->prim = (double *)(b + cols[2]) + q * rows;
        l->sec = (uint64_t *)(b + cols[3]) + q * rows;
        l->rows = (uint32_t)rows;
    }
    self->ident = (uint64_t *)(b + ident);
    self->expirations = (uint64_t *)(b + counters[0]);
    self->evictions = (uint64_t *)(b + counters[1]);
    self->bytes_evicted = (uint64_t *)(b + counters[2]);
    return 0;
outside:
    PyErr_SetString(PyExc_ValueError, "fast path: a victim list lies outside the segment");
    return -1;
}

int Fast_init(Fast *self, PyObject *args, PyObject *kwds) {
    PyObject *buffer, *spec;
    int fd;
    if (!PyArg_ParseTuple(args, "OiO!", &buffer, &fd, &PyDict_Type, &spec)) return -1;
    if (self->have_buf) {
        PyErr_SetString(PyExc_RuntimeError, "Fast is already initialised");
        return -1;
    }
    if (PyObject_GetBuffer(buffer, &self->buf, PyBUF_WRITABLE) < 0) return -1;
    self->have_buf = 1;
    self->base = (char *)self->buf.buf;
    self->fd = fd;
    uint64_t size = (uint64_t)self->buf.len;

    uint64_t lock_byte, policy, monotone, seqlock, verify, pid, n_buckets;
    uint64_t o_dirty, o_cand_valid, o_seq, o_hits, o_misses, o_ops, o_lfu_epoch, o_lfu_period;
    uint64_t o_cmax_p, o_cmax_s, o_cnext, o_buckets, o_pins_region;
    uint64_t c_state, c_pins, c_klen, c_next, c_khash, c_vlen, c_first, c_nblk, c_cks, c_lastacc;
    uint64_t c_expiry, c_iseq, c_aseq, c_acount, c_lfuep, c_prio, c_kcell;
    uint64_t o_free_slot, o_alloc_hint, o_used_blocks, o_key_hint, o_used_kcells, o_n_entries, o_puts, o_gone_seq;
    uint64_t o_bmap, o_kmap, c_flags, c_opid, c_ostart, c_created, o_gone;
    struct { const char *name; uint64_t *out; } fields[] = {
        {"lock_byte", &lock_byte}, {"policy", &policy}, {"monotone", &monotone}, {"seqlock", &seqlock},
        {"verify", &verify},
        {"pid", &pid}, {"start", &self->pstart}, {"block_size", &self->bs}, {"n_blocks", &self->n_blocks},
        {"n_slots", &self->n_slots}, {"n_buckets", &n_buckets}, {"n_pins", &self->n_pins},
        {"data_off", &self->data_off}, {"keys_off", &self->keys_off}, {"n_kcells", &self->n_kcells},
        {"copy_in_lock", &self->copy_in_lock},
        {"h_dirty", &o_dirty}, {"h_cand_valid", &o_cand_valid}, {"h_seq", &o_seq}, {"h_hits", &o_hits},
        {"h_misses", &o_misses}, {"h_ops", &o_ops}, {"h_lfu_epoch", &o_lfu_epoch},
        {"h_lfu_period", &o_lfu_period}, {"h_cand_max_primary", &o_cmax_p},
        {"h_cand_max_secondary", &o_cmax_s}, {"h_cand_next_expiry", &o_cnext},
        {"buckets_off", &o_buckets}, {"pins_off", &o_pins_region}, {"pin_size", &self->pin_size},
        {"pin_pid", &self->pin_off_pid}, {"pin_slot", &self->pin_off_slot}, {"pin_start", &self->pin_off_start},
        {"state", &c_state}, {"pins", &c_pins}, {"key_len", &c_klen}, {"next", &c_next},
        {"key_hash", &c_khash}, {"value_len", &c_vlen}, {"first_block", &c_first}, {"n_blocks_col", &c_nblk},
        {"checksum", &c_cks}, {"last_access", &c_lastacc}, {"expiry", &c_expiry}, {"insert_seq", &c_iseq},
        {"access_seq", &c_aseq}, {"access_count", &c_acount}, {"lfu_epoch_col", &c_lfuep},
        {"priority", &c_prio}, {"key_cell", &c_kcell},
        {"h_free_slot", &o_free_slot}, {"h_alloc_hint", &o_alloc_hint}, {"h_used_blocks", &o_used_blocks},
        {"h_key_hint", &o_key_hint}, {"h_used_kcells", &o_used_kcells}, {"h_n_entries", &o_n_entries},
        {"h_puts", &o_puts}, {"h_gone_seq", &o_gone_seq}, {"blockmap_off", &o_bmap}, {"keymap_off", &o_kmap},
        {"flags", &c_flags}, {"owner_pid", &c_opid}, {"owner_start", &c_ostart}, {"created", &c_created},
        {"put_in_lock", &self->put_in_lock}, {"gone_off", &o_gone}, {"gone_len", &self->gone_len},
    };
    uint64_t qkind = 0, qadapt = 0, c_queue = 0, c_qfreq = 0, c_qseq = 0, o_qcount = 0, o_cnext1 = 0;
    uint64_t o_qtarget = 0, o_qclock = 0, g_n[2] = {0, 0}, g_hash[2] = {0, 0}, g_next[2] = {0, 0};
    uint64_t g_bkt[2] = {0, 0}, g_nb[2] = {0, 0}, g_live[2] = {0, 0}, g_head[2] = {0, 0}, g_tail[2] = {0, 0};
    uint64_t g_factor[2] = {0, 0}, o_qregime = 0, o_qgrate = 0, o_qhrate = 0, o_qhseen = 0;
    struct { const char *name; uint64_t *out; } qfields[] = {
        {"queue_col", &c_queue}, {"freq_col", &c_qfreq}, {"qseq_col", &c_qseq}, {"h_q_count0", &o_qcount},
        {"h_cand1_next_expiry", &o_cnext1}, {"h_q_target", &o_qtarget}, {"h_q_seq", &o_qclock},
        {"adapt", &qadapt}, {"g0_n", &g_n[0]}, {"g0_hash", &g_hash[0]}, {"g0_next", &g_next[0]},
        {"g0_buckets", &g_bkt[0]}, {"g0_n_buckets", &g_nb[0]}, {"h_g0_live", &g_live[0]}, {"g1_n", &g_n[1]},
        {"g1_hash", &g_hash[1]}, {"g1_next", &g_next[1]}, {"g1_buckets", &g_bkt[1]}, {"g1_n_buckets", &g_nb[1]},
        {"h_g1_live", &g_live[1]}, {"h_g0_head", &g_head[0]}, {"h_g0_tail", &g_tail[0]}, {"h_g1_head", &g_head[1]},
        {"h_g1_tail", &g_tail[1]}, {"g0_factor", &g_factor[0]}, {"g1_factor", &g_factor[1]},
        {"h_q_regime", &o_qregime}, {"h_q_ghost_rate", &o_qgrate}, {"h_q_hit_rate", &o_qhrate},
        {"h_q_hits_seen", &o_qhseen},
    };
    if (PyDict_GetItemString(spec, "queues") != NULL) {
        if (get_u64(spec, "queues", &qkind) < 0) return -1;
        if (qkind > Q_PROMOTE || qadapt > ADAPT_AUTO) {
            PyErr_SetString(PyExc_ValueError, "fast path: bad queue kind");
            return -1;
        }
        for (size_t k = 0; qkind && k < sizeof(qfields) / sizeof(qfields[0]); k++)
            if (get_u64(spec, qfields[k].name, qfields[k].out) < 0) return -1;
    }
    for (size_t k = 0; k < sizeof(fields) / sizeof(fields[0]); k++)
        if (get_u64(spec, fields[k].name, fields[k].out) < 0) return -1;
    if (init_victim_lists(self, spec, size) < 0) return -1;

    /* Everything this object will touch must lie inside the mapping. */
    uint64_t n = self->n_slots;
    struct { uint64_t off, len; } regions[] = {
        {o_dirty, 4}, {o_cand_valid, 4}, {o_seq, 8}, {o_hits, 8}, {o_misses, 8}, {o_ops, 8},
        {o_lfu_epoch, 8}, {o_lfu_period, 8}, {o_cmax_p, 8}, {o_cmax_s, 8}, {o_cnext, 8},
        {o_buckets, n_buckets * 4}, {o_pins_region, self->n_pins * self->pin_size},
        {c_state, n * 4}, {c_pins, n * 4}, {c_klen, n * 4}, {c_next, n * 4}, {c_khash, n * 8},
        {c_vlen, n * 8}, {c_first, n * 8}, {c_nblk, n * 8}, {c_cks, n * 8}, {c_lastacc, n * 8},
        {c_expiry, n * 8}, {c_iseq, n * 8}, {c_aseq, n * 8}, {c_acount, n * 8}, {c_lfuep, n * 8},
        {c_prio, n * 8}, {c_kcell, n * 8}, {self->keys_off, self->n_kcells * KEY_CELL},
        {self->data_off, self->n_blocks * self->bs},
        {o_free_slot, 8}, {o_alloc_hint, 8}, {o_used_blocks, 8}, {o_key_hint, 8}, {o_used_kcells, 8},
        {o_n_entries, 8}, {o_puts, 8}, {o_gone_seq, 8}, {o_bmap, self->n_blocks}, {o_kmap, self->n_kcells},
        {c_flags, n * 4}, {c_opid, n * 4}, {c_ostart, n * 8}, {c_created, n * 8}, {o_gone, self->gone_len},
    };
    for (size_t k = 0; k < sizeof(regions) / sizeof(regions[0]); k++) {
        if (regions[k].off > size || regions[k].len > size - regions[k].off || regions[k].off % 4) {
            PyErr_SetString(PyExc_ValueError, "fast path: a region lies outside the segment");
            return -1;
        }
    }
    if (qkind) {
        struct { uint64_t off, len; } qregions[] = {
            {c_queue, n}, {c_qfreq, n}, {c_qseq, n * 8}, {o_qcount, 16}, {o_cnext1, 8}, {o_qtarget, 8},
            {o_qclock, 8}, {g_live[0], 8}, {g_live[1], 8}, {g_head[0], 8}, {g_head[1], 8}, {g_tail[0], 8},
            {g_tail[1], 8}, {o_qregime, 4}, {o_qgrate, 8}, {o_qhrate, 8}, {o_qhseen, 8},
            {g_hash[0], g_n[0] * 8}, {g_next[0], g_n[0] * 4}, {g_bkt[0], g_nb[0] * 4},
            {g_hash[1], g_n[1] * 8}, {g_next[1], g_n[1] * 4}, {g_bkt[1], g_nb[1] * 4},
        };
        for (size_t k = 0; k < sizeof(qregions) / sizeof(qregions[0]); k++) {
            if (qregions[k].off > size || qregions[k].len > size - qregions[k].off || qregions[k].off == 0) {
                PyErr_SetString(PyExc_ValueError, "fast path: a queue region lies outside the segment");
                return -1;
            }
        }
        for (int r = 0; r < 2; r++) {
            if (g_n[r] && (g_nb[r] < g_n[r] || (g_nb[r] & (g_nb[r] - 1)) || g_n[r] >= (1ULL << 31))) {
                PyErr_SetString(PyExc_ValueError, "fast path: bad ghost ring sizes");
                return -1;
            }
        }
    }
    if (n_buckets == 0 || (n_buckets & (n_buckets - 1)) || self->pin_size < 16 || self->n_pins == 0) {
        PyErr_SetString(PyExc_ValueError, "fast path: bad table sizes");
        return -1;
    }
    self->mask = n_buckets - 1;
    self->policy = (int)policy;
    self->monotone = (int)monotone;
    self->seqlock = (int)seqlock;
    self->verify = (int)verify;
    self->pid = (uint32_t)pid;
    self->pin_hint = 0;
    char *b = self->base;
    self->dirty = (volatile uint32_t *)(b + o_dirty);
    self->cand_valid = (volatile uint32_t *)(b + o_cand_valid);
    self->seq = (uint64_t *)(b + o_seq);
    self->hits = (uint64_t *)(b + o_hits);
    self->misses = (uint64_t *)(b + o_misses);
    self->ops = (uint64_t *)(b + o_ops);
    self->lfu_epoch = (uint64_t *)(b + o_lfu_epoch);
    self->lfu_period = (uint64_t *)(b + o_lfu_period);
    self->cand_max_primary = (double *)(b + o_cmax_p);
    self->cand_max_secondary = (uint64_t *)(b + o_cmax_s);
    self->cand_next_expiry = (double *)(b + o_cnext);
    self->buckets = (int32_t *)(b + o_buckets);
    self->pinrec = b + o_pins_region;
    self->state = (volatile uint32_t *)(b + c_state);
    self->pins = (uint32_t *)(b + c_pins);
    self->klen = (uint32_t *)(b + c_klen);
    self->next = (int32_t *)(b + c_next);
    self->khash = (uint64_t *)(b + c_khash);
    self->vlen = (uint64_t *)(b + c_vlen);
    self->first = (uint64_t *)(b + c_first);
    self->nblk = (uint64_t *)(b + c_nblk);
    self->cks = (uint64_t *)(b + c_cks);
    self->lastacc = (double *)(b + c_lastacc);
    self->expiry = (double *)(b + c_expiry);
    self->iseq = (volatile uint64_t *)(b + c_iseq);
    self->aseq = (uint64_t *)(b + c_aseq);
    self->acount = (uint64_t *)(b + c_acount);
    self->lfuep = (uint64_t *)(b + c_lfuep);
    self->prio = (int64_t *)(b + c_prio);
    self->kcell = (uint64_t *)(b + c_kcell);
    self->free_slot = (int64_t *)(b + o_free_slot);
    self->alloc_hint = (uint64_t *)(b + o_alloc_hint);
    self->used_blocks = (uint64_t *)(b + o_used_blocks);
    self->key_hint = (uint64_t *)(b + o_key_hint);
    self->used_kcells = (uint64_t *)(b + o_used_kcells);
    self->n_entries = (uint64_t *)(b + o_n_entries);
    self->puts = (uint64_t *)(b + o_puts);
    self->gone_seq = (uint64_t *)(b + o_gone_seq);
    self->bmap = (uint8_t *)(b + o_bmap);
    self->kmap = (uint8_t *)(b + o_kmap);
    self->flags_col = (uint32_t *)(b + c_flags);
    self->opid = (uint32_t *)(b + c_opid);
    self->ostart = (uint64_t *)(b + c_ostart);
    self->created = (double *)(b + c_created);
    self->gone = self->gone_len && self->gone_len >= n ? (uint8_t *)(b + o_gone) : NULL; /* hash marks need n */
    self->qkind = (int)qkind;
    self->qadapt = (int)qadapt;
    if (qkind) {
        self->queue = (uint8_t *)(b + c_queue);
        self->qfreq = (uint8_t *)(b + c_qfreq);
        self->qseq = (uint64_t *)(b + c_qseq);
        self->qcount = (uint64_t *)(b + o_qcount);
        self->qclock = (uint64_t *)(b + o_qclock);
        self->qtarget = (double *)(b + o_qtarget);
        self->cand1_next_expiry = (double *)(b + o_cnext1);
        self->qregime = (uint32_t *)(b + o_qregime);
        self->qghost_rate = (double *)(b + o_qgrate);
        self->qhit_rate = (double *)(b + o_qhrate);
        self->qhits_seen = (uint64_t *)(b + o_qhseen);
        for (int r = 0; r < 2; r++) {
            GhostRing *g = &self->ghost[r];
            g->n = g_n[r];
            g->live = (uint64_t *)(b + g_live[r]);
            g->head = (uint64_t *)(b + g_head[r]);
            g->tail = (uint64_t *)(b + g_tail[r]);
            g->factor = g_factor[r];
            if (g->n) {
                g->hash = (uint64_t *)(b + g_hash[r]);
                g->next = (int32_t *)(b + g_next[r]);
                g->bkt = (int32_t *)(b + g_bkt[r]);
                g->mask = g_nb[r] - 1;
            }
        }
    }

    struct flock lk = {0};
    lk.l_type = F_WRLCK;
    lk.l_whence = SEEK_SET;
    lk.l_start = (off_t)lock_byte;
    lk.l_len = 1;
    self->lk = lk;
    lk.l_type = F_UNLCK;
    self->unlk = lk;

    self->guard = -1;
    PyObject *g = PyDict_GetItemString(spec, "guard");
    if (g != NULL && g != Py_None) {
        if (!Py_IS_TYPE(g, &GuardType)) {
            PyErr_SetString(PyExc_TypeError, "fast path spec: guard must be a Guard");
            return -1;
        }
        self->guard = ((Guard *)g)->slot;
    }
    PyObject *tl = PyDict_GetItemString(spec, "thread_lock");
    if (tl != NULL && tl != Py_None) {
        self->thread_acquire = PyObject_GetAttrString(tl, "acquire");
        self->thread_release = PyObject_GetAttrString(tl, "release");
        if (!self->thread_acquire || !self->thread_release) return -1;
    }
    self->on_unpin = get_obj(spec, "on_unpin");
    self->free_entry = get_obj(spec, "free_entry");
    self->late_unpin = get_obj(spec, "late_unpin");
    self->reserve_hook = get_obj(spec, "reserve_hook");
    self->evict_hook = get_obj(spec, "evict_hook");
    self->refill_hook = get_obj(spec, "refill_hook");
    self->err_base = get_obj(spec, "error");
    self->err_corrupt = get_obj(spec, "corrupt_error");
    if (!self->on_unpin || !self->free_entry || !self->late_unpin || !self->reserve_hook || !self->evict_hook ||
        !self->refill_hook || !self->err_base || !self->err_corrupt) {
        PyErr_SetString(PyExc_ValueError, "fast path spec needs on_unpin, free_entry, late_unpin, reserve_hook, "
                                          "evict_hook, refill_hook, error and corrupt_error");
        return -1;
    }
    return 0;
}
