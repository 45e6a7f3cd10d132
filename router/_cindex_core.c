/* _cindex_core.c: the table (sharded open addressing) and the pool (fixed
 * chunks, a free list) of router/_cindex.c; see its opening comment. */
#include "_cindex.h"

static void table_put(uint64_t *table, uint32_t mask, uint64_t v) {
    uint32_t i = (uint32_t)(v >> 32) & mask;
    while (table[i]) i = (i + 1) & mask;
    table[i] = v;
}

static int grow_shard(Index *ix, uint32_t s) {
    uint64_t *old = ix->table[s];
    uint32_t cap = old ? (ix->table_mask[s] + 1) * 2 : 16;
    uint64_t *table = calloc(cap, sizeof(uint64_t));
    if (!table) return -1;
    for (uint32_t i = 0; old && i <= ix->table_mask[s]; i++)
        if (old[i]) table_put(table, cap - 1, old[i]);
    free(old);
    ix->table[s] = table;
    ix->table_mask[s] = cap - 1;
    return 0;
}

static void table_delete(Index *ix, uint32_t idx) {
    uint64_t h = mix(AT(ix, idx)->k0, AT(ix, idx)->k1);
    uint32_t s = shard_of(h), mask = ix->table_mask[s], i = (uint32_t)h & mask;
    uint64_t *table = ix->table[s];
    while ((uint32_t)table[i] != idx + 1) i = (i + 1) & mask;
    uint32_t j = i;
    for (;;) { /* backward shift: no tombstones */
        j = (j + 1) & mask;
        uint64_t v = table[j];
        if (!v) break;
        uint32_t home = (uint32_t)(v >> 32) & mask;
        if (((j - home) & mask) >= ((j - i) & mask)) {
            table[i] = v;
            i = j;
        }
    }
    table[i] = 0;
    ix->table_count[s]--;
}

uint32_t cindex_new_entry(Index *ix, uint64_t k0, uint64_t k1, uint32_t parent) {
    uint64_t h = mix(k0, k1);
    uint32_t s = shard_of(h);
    if (!ix->table[s] || (uint64_t)(ix->table_count[s] + 1) * 10 > (uint64_t)(ix->table_mask[s] + 1) * 7)
        if (grow_shard(ix, s) < 0) return FREE;
    uint32_t idx;
    if (ix->free_head != ROOT) {
        idx = ix->free_head;
        ix->free_head = AT(ix, idx)->children;
    } else {
        if (ix->pool_len == ix->nchunks * CHUNK) {
            if (ix->pool_len >= FREE - CHUNK) return FREE; /* 2^32 - 2 entries at most */
            Entry **chunks = realloc(ix->chunks, (ix->nchunks + 1) * sizeof(Entry *));
            if (!chunks) return FREE;
            ix->chunks = chunks;
            void *chunk = NULL;
            if (posix_memalign(&chunk, HUGE, CHUNK * sizeof(Entry))) return FREE;
#ifdef MADV_HUGEPAGE
            madvise(chunk, CHUNK * sizeof(Entry) / HUGE * HUGE, MADV_HUGEPAGE); /* a hint: fewer TLB misses */
#endif
            chunks[ix->nchunks] = chunk;
            ix->nchunks++;
        }
        idx = ix->pool_len++;
    }
    Entry *e = AT(ix, idx);
    e->k0 = k0;
    e->k1 = k1;
    e->bits = 0;
    e->ext = NULL;
    e->parent = parent;
    e->children = 0;
    if (parent != ROOT) AT(ix, parent)->children++;
    table_put(ix->table[s], ix->table_mask[s], (h << 32) | (idx + 1));
    ix->table_count[s]++;
    ix->count++;
    return idx;
}

/* Free `idx` and then each ancestor left unheld and childless. */
void cindex_prune(Index *ix, uint32_t idx) {
    while (idx != ROOT) {
        Entry *e = AT(ix, idx);
        if (e->children || any_bit(e)) return;
        uint32_t up = e->parent;
        table_delete(ix, idx);
        free(e->ext);
        e->ext = NULL;
        e->parent = FREE;
        e->children = ix->free_head;
        ix->free_head = idx;
        ix->count--;
        if (up != ROOT) AT(ix, up)->children--;
        idx = up;
    }
}


/* A sequence of keys as pairs of words (PyMem_Free it); NULL on error. */
uint64_t *cindex_keys_of(PyObject *seq, Py_ssize_t *n) {
    PyObject *fast = PySequence_Fast(seq, "keys must be a sequence");
    if (!fast) return NULL;
    *n = PySequence_Fast_GET_SIZE(fast);
    uint64_t *keys = PyMem_Malloc((size_t)(*n ? *n : 1) * 16);
    if (!keys) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return NULL;
    }
    PyObject **items = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t i = 0; i < *n; i++)
        if (cindex_key_of(items[i], &keys[2 * i], &keys[2 * i + 1]) < 0) {
            PyMem_Free(keys);
            Py_DECREF(fast);
            return NULL;
        }
    Py_DECREF(fast);
    return keys;
}

int cindex_ensure_slot(Index *ix, uint32_t slot) {
    if (slot < ix->nslots) return 0;
    uint32_t n = ix->nslots ? ix->nslots : 64;
    while (n <= slot) n *= 2;
    uint8_t *state = realloc(ix->state, n);
    if (state) ix->state = state;
    int64_t *size = realloc(ix->size, n * sizeof(int64_t));
    if (size) ix->size = size;
    uint32_t words = n / 64;
    uint64_t *live = realloc(ix->live, words * sizeof(uint64_t));
    if (live) ix->live = live;
    uint64_t *sweeping = realloc(ix->sweeping, words * sizeof(uint64_t));
    if (sweeping) ix->sweeping = sweeping;
    if (!state || !size || !live || !sweeping) {
        PyErr_NoMemory();
        return -1;
    }
    memset(ix->state + ix->nslots, S_FREE, n - ix->nslots);
    memset(ix->size + ix->nslots, 0, (n - ix->nslots) * sizeof(int64_t));
    memset(ix->live + ix->nwords, 0, (words - ix->nwords) * sizeof(uint64_t));
    memset(ix->sweeping + ix->nwords, 0, (words - ix->nwords) * sizeof(uint64_t));
    ix->nslots = n;
    ix->nwords = words;
    return 0;
}

int cindex_slot_arg(Index *ix, PyObject *o, uint32_t *slot, int live) {
    long v = PyLong_AsLong(o);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (v < 0 || (uint64_t)v >= ix->nslots || (live && ix->state[v] != S_LIVE)) {
        PyErr_Format(PyExc_ValueError, "slot %ld is not a live slot", v);
        return -1;
    }
    *slot = (uint32_t)v;
    return 0;
}

