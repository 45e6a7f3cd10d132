/* _cindex: the router's global index (router.native.NativeIndex) in C.
 *
 * Every known block key is one entry of a pool: its 16-byte key, the pool
 * index of its parent (or ROOT), how many known entries continue it, and
 * the set of holder slots holding it, a bitmap (slots 0-63 inline, further
 * words in a side array allocated only for entries held by a slot >= 64).
 * An open-addressing table (linear probing on a mix of the key's words,
 * deletion by backward shift) maps a key to its entry. No Python object is
 * held per key, so the collector never walks the index.
 *
 * A holder slot is one incarnation of a worker (router/native.py maps
 * workers to slots). Retiring a slot (a clear, a removed worker) is O(1):
 * the slot's bit leaves the live mask, so no query sees its entries, and
 * `sweep` later clears its bits in bounded slices, scanning the pool once
 * for every slot retired before the pass began; a slot is reused only once
 * swept. An entry with no bit and no child is freed, then its parent if that
 * leaves it unheld and childless (a hole left by a removal mid-chain).
 */
#include "_cindex.h"

/* new_slot() -> the lowest free slot, made live with nothing held. */
static PyObject *Index_new_slot(Index *ix, PyObject *unused) {
    uint32_t slot = 0;
    while (slot < ix->nslots && ix->state[slot] != S_FREE) slot++;
    if (cindex_ensure_slot(ix, slot) < 0) return NULL;
    ix->state[slot] = S_LIVE;
    ix->size[slot] = 0;
    ix->live[slot >> 6] |= 1ull << (slot & 63);
    return PyLong_FromUnsignedLong(slot);
}

/* retire(slot): O(1); its entries go stale until swept. */
static PyObject *Index_retire(Index *ix, PyObject *arg) {
    uint32_t slot;
    if (cindex_slot_arg(ix, arg, &slot, 1) < 0) return NULL;
    ix->live[slot >> 6] &= ~(1ull << (slot & 63));
    ix->stale += ix->size[slot];
    ix->state[slot] = ix->size[slot] ? S_DEAD : S_FREE;
    Py_RETURN_NONE;
}

/* store(slot, keys, parent) -> the slot's size, or -1: a key is known under
 * another parent or repeated (nothing changed). The caller checked `parent`. */
static PyObject *Index_store(Index *ix, PyObject *args) {
    PyObject *slot_o, *seq, *parent_o;
    if (!PyArg_ParseTuple(args, "OOO", &slot_o, &seq, &parent_o)) return NULL;
    uint32_t slot, pidx = ROOT;
    if (cindex_slot_arg(ix, slot_o, &slot, 1) < 0) return NULL;
    if (parent_o != Py_None) {
        uint64_t p0, p1;
        if (cindex_key_of(parent_o, &p0, &p1) < 0) return NULL;
        pidx = lookup(ix, p0, p1);
        if (pidx == ROOT || !has_bit(AT(ix, pidx), slot)) {
            PyErr_SetString(PyExc_ValueError, "the parent is not held by the slot");
            return NULL;
        }
    }
    Py_ssize_t n;
    uint64_t *keys = cindex_keys_of(seq, &n);
    if (!keys) return NULL;
    uint32_t *found = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(uint32_t));
    uint32_t smask = 1;
    while (smask < 2 * (uint64_t)n) smask <<= 1;
    uint32_t *seen = PyMem_Calloc(smask, sizeof(uint32_t)); /* i + 1 of the run's keys */
    long result = -1;
    if (!found || !seen) {
        PyErr_NoMemory();
        goto done;
    }
    smask--;
    uint32_t expected = pidx; /* ROOT also: the previous key is new */
    int prev_new = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + PREFETCH < n) prefetch_slot(ix, mix(keys[2 * (i + PREFETCH)], keys[2 * (i + PREFETCH) + 1]));
        if (i + PREFETCH / 2 < n)
            prefetch_entry(ix, mix(keys[2 * (i + PREFETCH / 2)], keys[2 * (i + PREFETCH / 2) + 1]));
        uint64_t k0 = keys[2 * i], k1 = keys[2 * i + 1];
        uint32_t h = (uint32_t)mix(k0, k1) & smask;
        for (; seen[h]; h = (h + 1) & smask) {
            uint32_t j = seen[h] - 1;
            if (keys[2 * j] == k0 && keys[2 * j + 1] == k1) goto done; /* repeated */
        }
        seen[h] = (uint32_t)i + 1;
        uint32_t idx = lookup(ix, k0, k1);
        if (idx != ROOT && (prev_new || AT(ix, idx)->parent != expected)) goto done;
        found[i] = idx;
        prev_new = idx == ROOT;
        expected = idx;
    }
    uint32_t up = pidx;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t idx = found[i];
        if (idx == ROOT) idx = cindex_new_entry(ix, keys[2 * i], keys[2 * i + 1], up);
        int added = idx == FREE ? -1 : set_bit(AT(ix, idx), slot);
        if (added < 0) { /* out of memory: the keys stored so far stay */
            PyErr_NoMemory();
            goto done;
        }
        ix->size[slot] += added;
        up = idx;
    }
    result = (long)ix->size[slot];
done:
    PyMem_Free(keys);
    PyMem_Free(found);
    PyMem_Free(seen);
    if (result < 0 && PyErr_Occurred()) return NULL;
    return PyLong_FromLong(result);
}

/* remove(slot, keys) -> the slot's size, or -1: it does not hold one of them. */
static PyObject *Index_remove(Index *ix, PyObject *args) {
    PyObject *slot_o, *seq;
    if (!PyArg_ParseTuple(args, "OO", &slot_o, &seq)) return NULL;
    uint32_t slot;
    if (cindex_slot_arg(ix, slot_o, &slot, 1) < 0) return NULL;
    Py_ssize_t n;
    uint64_t *keys = cindex_keys_of(seq, &n);
    if (!keys) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t idx = lookup(ix, keys[2 * i], keys[2 * i + 1]);
        if (idx == ROOT || !has_bit(AT(ix, idx), slot)) {
            PyMem_Free(keys);
            return PyLong_FromLong(-1);
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t idx = lookup(ix, keys[2 * i], keys[2 * i + 1]);
        if (idx == ROOT || !has_bit(AT(ix, idx), slot)) continue; /* repeated */
        clear_bit(AT(ix, idx), slot);
        ix->size[slot]--;
        cindex_prune(ix, idx);
    }
    PyMem_Free(keys);
    return PyLong_FromLongLong(ix->size[slot]);
}

/* holds(slot, key) -> bool */
static PyObject *Index_holds(Index *ix, PyObject *args) {
    PyObject *slot_o, *key;
    uint64_t k0, k1;
    uint32_t slot;
    if (!PyArg_ParseTuple(args, "OO", &slot_o, &key) || cindex_slot_arg(ix, slot_o, &slot, 1) < 0 ||
        cindex_key_of(key, &k0, &k1) < 0)
        return NULL;
    uint32_t idx = lookup(ix, k0, k1);
    return PyBool_FromLong(idx != ROOT && has_bit(AT(ix, idx), slot));
}

static PyObject *key_bytes(const Entry *e) {
    char buf[16];
    memcpy(buf, &e->k0, 8);
    memcpy(buf + 8, &e->k1, 8);
    return PyBytes_FromStringAndSize(buf, 16);
}

/* parent_of(key) -> (known, parent key or None) */
static PyObject *Index_parent_of(Index *ix, PyObject *key) {
    uint64_t k0, k1;
    if (cindex_key_of(key, &k0, &k1) < 0) return NULL;
    uint32_t idx = lookup(ix, k0, k1);
    if (idx == ROOT) return Py_BuildValue("(OO)", Py_False, Py_None);
    uint32_t up = AT(ix, idx)->parent;
    if (up == ROOT) return Py_BuildValue("(OO)", Py_True, Py_None);
    PyObject *p = key_bytes(AT(ix, up));
    return p ? Py_BuildValue("(ON)", Py_True, p) : NULL;
}

typedef struct {
    uint64_t k0, k1, h;
} Ahead;

/* Read query key j into ring[j % 64] and prefetch its table slot. */
static inline int look_ahead(const Index *ix, PyObject **items, Py_ssize_t j, Ahead *ring) {
    Ahead *a = &ring[j & 63];
    if (cindex_key_of(items[j], &a->k0, &a->k1) < 0) return -1;
    a->h = mix(a->k0, a->k1);
    prefetch_slot(ix, a->h);
    return 0;
}

/* Prefetch the pool entry of ring[j % 64] if its home slot names it. */
static inline void entry_ahead(const Index *ix, const Ahead *ring, Py_ssize_t j) {
    prefetch_entry(ix, ring[j & 63].h);
}

/* find(keys, names, early_exit) -> {names[slot]: score} for the live slots
 * holding keys[0] (a root block): how many leading keys, each continuing
 * the one before, they hold. With early_exit the walk stops once at most
 * one slot still matches (its score then a lower bound). */
static PyObject *Index_find(Index *ix, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyList_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "find(keys, names: list, early_exit)");
        return NULL;
    }
    PyObject *seq = args[0], *names = args[1];
    int early = PyObject_IsTrue(args[2]);
    if (early < 0) return NULL;
    PyObject *fast = PySequence_Fast(seq, "keys must be a sequence");
    if (!fast) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    PyObject *out = PyDict_New();
    uint32_t nw = ix->nwords ? ix->nwords : 1;
    uint64_t one = 0, *active = nw > 1 ? PyMem_Calloc(nw, sizeof(uint64_t)) : &one;
    Py_ssize_t few[64], *scores = nw > 1 ? PyMem_Malloc(64 * (size_t)nw * sizeof(Py_ssize_t)) : few;
    uint32_t first = ROOT;
    uint64_t k0, k1;
    if (!out || !active || !scores) {
        if (out) PyErr_NoMemory();
        goto fail;
    }
    if (n && ix->nwords) {
        if (cindex_key_of(items[0], &k0, &k1) < 0) goto fail;
        first = lookup(ix, k0, k1);
        if (first != ROOT && AT(ix, first)->parent != ROOT) first = ROOT;
    }
    if (first == ROOT) goto finish;
    Py_ssize_t alive = 0, stop = n;
    uint32_t prev = first;
    for (uint32_t w = 0; w < nw; w++) {
        active[w] = word_of(AT(ix, first), w) & ix->live[w];
        alive += __builtin_popcountll(active[w]);
    }
    if (!alive) goto finish;
    if (early && alive <= 1) stop = 1;
    Ahead ring[64]; /* keys i+1 .. i+PREFETCH: table slots, then entries, fetched ahead */
    for (Py_ssize_t j = 1; j < stop && j <= PREFETCH; j++)
        if (look_ahead(ix, items, j, ring) < 0) goto fail;
    for (Py_ssize_t i = 1; i < stop; i++) {
        if (i + 2 * PREFETCH < stop) __builtin_prefetch(items[i + 2 * PREFETCH]);
        if (i + PREFETCH < stop && look_ahead(ix, items, i + PREFETCH, ring) < 0) goto fail;
        if (i + PREFETCH / 2 < stop) entry_ahead(ix, ring, i + PREFETCH / 2);
        const Ahead *a = &ring[i & 63];
        uint32_t idx = lookup_h(ix, a->k0, a->k1, a->h);
        const Entry *e = idx == ROOT ? NULL : AT(ix, idx);
        if (!e || e->parent != prev) {
            stop = i;
            break;
        }
        prev = idx;
        int drop = 0;
        for (uint32_t w = 0; w < nw; w++) {
            uint64_t dropped = active[w] & ~word_of(e, w);
            if (!dropped) continue;
            drop = 1;
            active[w] &= ~dropped;
            alive -= __builtin_popcountll(dropped);
            for (; dropped; dropped &= dropped - 1) scores[64 * w + __builtin_ctzll(dropped)] = i;
        }
        if (!alive) {
            stop = i;
            break;
        }
        if (drop && early && alive <= 1) {
            stop = i + 1;
            break;
        }
    }
    for (uint32_t w = 0; w < nw; w++) /* the slots still matching where the walk stopped */
        for (uint64_t left = active[w]; left; left &= left - 1)
            scores[64 * w + __builtin_ctzll(left)] = stop;
    for (uint32_t w = 0; w < nw; w++)
        for (uint64_t b = word_of(AT(ix, first), w) & ix->live[w]; b; b &= b - 1) {
            Py_ssize_t slot = 64 * (Py_ssize_t)w + __builtin_ctzll(b);
            if (slot >= PyList_GET_SIZE(names)) {
                PyErr_SetString(PyExc_IndexError, "names has no entry for a slot");
                goto fail;
            }
            PyObject *score = PyLong_FromSsize_t(scores[slot]);
            if (!score || PyDict_SetItem(out, PyList_GET_ITEM(names, slot), score) < 0) {
                Py_XDECREF(score);
                goto fail;
            }
            Py_DECREF(score);
        }
finish:
    if (nw > 1) {
        PyMem_Free(active);
        PyMem_Free(scores);
    }
    Py_DECREF(fast);
    return out;
fail:
    if (nw > 1) {
        PyMem_Free(active);
        PyMem_Free(scores);
    }
    Py_DECREF(fast);
    Py_XDECREF(out);
    return NULL;
}

/* sweep(max_bits) -> whether stale bits are left: clears up to max_bits bits
 * of retired slots, visiting at most SCAN_PER_SWEEP pool entries. */
static PyObject *Index_sweep(Index *ix, PyObject *arg) {
    long budget = PyLong_AsLong(arg);
    if (budget == -1 && PyErr_Occurred()) return NULL;
    if (budget < 0) {
        PyErr_SetString(PyExc_ValueError, "max_blocks must be >= 0");
        return NULL;
    }
    uint32_t scanned = 0;
    while (budget > 0 && scanned < SCAN_PER_SWEEP) {
        if (ix->sweep_left == 0) { /* start a pass: every slot retired so far */
            int any = 0;
            for (uint32_t s = 0; s < ix->nslots; s++) {
                if (ix->state[s] == S_SWEEPING) ix->state[s] = S_FREE;
                if (ix->state[s] == S_DEAD) {
                    ix->state[s] = S_SWEEPING;
                    ix->sweep_left += ix->size[s];
                    any = 1;
                }
            }
            memset(ix->sweeping, 0, ix->nwords * sizeof(uint64_t));
            for (uint32_t s = 0; s < ix->nslots; s++)
                if (ix->state[s] == S_SWEEPING) ix->sweeping[s >> 6] |= 1ull << (s & 63);
            ix->cursor = 0;
            if (!any) break;
        }
        if (ix->cursor >= ix->pool_len) { /* cannot happen while bits are left */
            PyErr_SetString(PyExc_RuntimeError, "router index: stale count out of step");
            return NULL;
        }
        Entry *e = AT(ix, ix->cursor);
        int done = 1;
        if (e->parent != FREE)
            for (uint32_t w = 0; w < ix->nwords; w++) {
                uint64_t b = word_of(e, w) & ix->sweeping[w];
                for (; b && budget > 0; b &= b - 1, budget--) {
                    uint32_t s = 64 * w + __builtin_ctzll(b);
                    clear_bit(e, s);
                    ix->size[s]--;
                    ix->sweep_left--;
                    ix->stale--;
                }
                if (b) done = 0;
            }
        scanned++;
        if (!done) break;
        uint32_t at = ix->cursor++;
        if (e->parent != FREE) cindex_prune(ix, at);
    }
    if (ix->sweep_left == 0)
        for (uint32_t s = 0; s < ix->nslots; s++)
            if (ix->state[s] == S_SWEEPING) ix->state[s] = S_FREE;
    return PyBool_FromLong(ix->stale > 0);
}

static PyObject *Index_stale(Index *ix, PyObject *unused) { return PyLong_FromLongLong(ix->stale); }

static PyObject *Index_size(Index *ix, PyObject *arg) {
    uint32_t slot;
    if (cindex_slot_arg(ix, arg, &slot, 1) < 0) return NULL;
    return PyLong_FromLongLong(ix->size[slot]);
}

/* entries() -> [(key, parent key or None, [live slots])], every known key
 * (stale bits left out), in pool order. */
static PyObject *Index_entries(Index *ix, PyObject *unused) {
    PyObject *out = PyList_New(0);
    for (uint32_t i = 0; out && i < ix->pool_len; i++) {
        const Entry *e = AT(ix, i);
        if (e->parent == FREE) continue;
        PyObject *slots = PyList_New(0), *key = key_bytes(e), *up = NULL;
        if (slots && key) {
            up = e->parent == ROOT ? Py_NewRef(Py_None) : key_bytes(AT(ix, e->parent));
            for (uint32_t w = 0; up && w < ix->nwords; w++)
                for (uint64_t b = word_of(e, w) & ix->live[w]; b; b &= b - 1) {
                    PyObject *s = PyLong_FromLong(64 * (long)w + __builtin_ctzll(b));
                    if (!s || PyList_Append(slots, s) < 0) Py_CLEAR(up);
                    Py_XDECREF(s);
                    if (!up) break;
                }
        }
        PyObject *row = up ? PyTuple_Pack(3, key, up, slots) : NULL;
        Py_XDECREF(slots);
        Py_XDECREF(key);
        Py_XDECREF(up);
        if (!row || PyList_Append(out, row) < 0) Py_CLEAR(out);
        Py_XDECREF(row);
    }
    return out;
}

/* load(key, parent key or None, slots): one entry of a checked dump, its
 * parent loaded before it. */
static PyObject *Index_load(Index *ix, PyObject *args) {
    PyObject *key, *parent_o, *slots;
    uint64_t k0, k1, p0, p1;
    if (!PyArg_ParseTuple(args, "OOO!", &key, &parent_o, &PyList_Type, &slots)) return NULL;
    if (cindex_key_of(key, &k0, &k1) < 0) return NULL;
    uint32_t up = ROOT;
    if (parent_o != Py_None) {
        if (cindex_key_of(parent_o, &p0, &p1) < 0) return NULL;
        up = lookup(ix, p0, p1);
        if (up == ROOT) {
            PyErr_SetString(PyExc_ValueError, "the parent is not loaded");
            return NULL;
        }
    }
    if (lookup(ix, k0, k1) != ROOT) {
        PyErr_SetString(PyExc_ValueError, "the key is already loaded");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(slots);
    uint32_t slot, *checked = PyMem_Malloc((size_t)(n + 1) * sizeof(uint32_t));
    if (!checked) return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < n; i++) {
        if (cindex_slot_arg(ix, PyList_GET_ITEM(slots, i), &slot, 1) < 0) {
            PyMem_Free(checked);
            return NULL;
        }
        checked[i] = slot;
    }
    uint32_t idx = cindex_new_entry(ix, k0, k1, up);
    for (Py_ssize_t i = 0; idx != FREE && i < n; i++) {
        int added = set_bit(AT(ix, idx), checked[i]);
        if (added < 0) idx = FREE;
        else ix->size[checked[i]] += added;
    }
    PyMem_Free(checked);
    if (idx == FREE) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* memory() -> bytes the index has allocated (pool, table, side words). */
static PyObject *Index_memory(Index *ix, PyObject *unused) {
    size_t total = (size_t)ix->nchunks * CHUNK * sizeof(Entry);
    for (uint32_t s = 0; s < SHARDS; s++)
        total += ix->table[s] ? (size_t)(ix->table_mask[s] + 1) * sizeof(uint64_t) : 0;
    for (uint32_t i = 0; i < ix->pool_len; i++)
        if (AT(ix, i)->parent != FREE && AT(ix, i)->ext)
            total += (AT(ix, i)->ext[0] + 1) * sizeof(uint64_t);
    return PyLong_FromSize_t(total);
}

static PyObject *Index_len(Index *ix, PyObject *unused) { return PyLong_FromUnsignedLong(ix->count); }

static void Index_dealloc(Index *ix) {
    for (uint32_t i = 0; i < ix->pool_len; i++)
        if (AT(ix, i)->parent != FREE) free(AT(ix, i)->ext);
    for (uint32_t c = 0; c < ix->nchunks; c++) free(ix->chunks[c]);
    free(ix->chunks);
    for (uint32_t s = 0; s < SHARDS; s++) free(ix->table[s]);
    free(ix->state);
    free(ix->size);
    free(ix->live);
    free(ix->sweeping);
    Py_TYPE(ix)->tp_free((PyObject *)ix);
}

static PyObject *Index_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    if (PyTuple_GET_SIZE(args) || (kw && PyDict_GET_SIZE(kw))) {
        PyErr_SetString(PyExc_TypeError, "Index() takes no arguments");
        return NULL;
    }
    Index *ix = (Index *)type->tp_alloc(type, 0);
    if (ix) ix->free_head = ROOT;
    return (PyObject *)ix;
}

static PyMethodDef Index_methods[] = {
    {"new_slot", (PyCFunction)Index_new_slot, METH_NOARGS, "The lowest free slot, made live."},
    {"retire", (PyCFunction)Index_retire, METH_O, "Retire a live slot (O(1))."},
    {"store", (PyCFunction)Index_store, METH_VARARGS, "store(slot, keys, parent) -> size or -1."},
    {"remove", (PyCFunction)Index_remove, METH_VARARGS, "remove(slot, keys) -> size or -1."},
    {"holds", (PyCFunction)Index_holds, METH_VARARGS, "holds(slot, key) -> bool."},
    {"parent_of", (PyCFunction)Index_parent_of, METH_O, "(known, parent key or None)."},
    {"find", (PyCFunction)(void (*)(void))Index_find, METH_FASTCALL, "find(keys, names, early_exit) -> scores."},
    {"sweep", (PyCFunction)Index_sweep, METH_O, "sweep(max_bits) -> whether stale bits are left."},
    {"stale", (PyCFunction)Index_stale, METH_NOARGS, "Stale bits not swept yet."},
    {"size", (PyCFunction)Index_size, METH_O, "Blocks a live slot holds."},
    {"entries", (PyCFunction)Index_entries, METH_NOARGS, "Every known key, pool order."},
    {"load", (PyCFunction)Index_load, METH_VARARGS, "load(key, parent, slots)."},
    {"memory", (PyCFunction)Index_memory, METH_NOARGS, "Bytes allocated."},
    {"known", (PyCFunction)Index_len, METH_NOARGS, "Known keys."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject IndexType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "router._cindex.Index",
    .tp_basicsize = sizeof(Index),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The router's index: block keys -> holder slots (see router/native.py).",
    .tp_new = Index_new,
    .tp_dealloc = (destructor)Index_dealloc,
    .tp_methods = Index_methods,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, .m_name = "_cindex", .m_size = -1};

PyMODINIT_FUNC PyInit__cindex(void) {
    if (PyType_Ready(&IndexType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddObjectRef(m, "Index", (PyObject *)&IndexType) < 0) Py_CLEAR(m);
    return m;
}
