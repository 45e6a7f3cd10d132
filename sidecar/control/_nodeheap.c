/* NodeHeap: the eviction policies' candidate heap, with entries in one
 * contiguous array of C structs.
 *
 * Same contract as sidecar.control.policies.LazyHeap (the pure-Python
 * fallback, and the reference the tests compare against): a min-heap of
 * nodes ordered by (k0, k1, k2, seq), O(1) removal by invalidation through
 * `node.heap_token`, and a rebuild when stale entries outnumber live ones.
 *
 * Why C: popping from a heapq of Python tuples dereferences two or three
 * scattered objects per comparison; once the heap outgrows the CPU caches
 * that memory traffic, not the O(log n) comparisons, sets the cost. Here a
 * comparison reads 32 contiguous bytes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

typedef struct {
    double k0;
    double k1;
    int64_t k2;
    int64_t seq;
    PyObject *node; /* strong reference */
} Entry;

typedef struct {
    PyObject_HEAD
    Entry *data;
    Py_ssize_t len;  /* entries, live and stale */
    Py_ssize_t cap;
    Py_ssize_t size; /* live entries: nodes whose heap_token is set */
} NodeHeap;

static PyObject *str_heap_token;

/* Tokens come from one counter for every heap in the process (next_token()
 * gives the Python heaps theirs): a node moved to another heap leaves a
 * stale entry in the old one, and a token that heap could also hand out
 * would bring that entry back to life (popped from both heaps, or neither). */
static int64_t last_token = 0;

static inline int entry_less(const Entry *a, const Entry *b) {
    if (a->k0 != b->k0) return a->k0 < b->k0;
    if (a->k1 != b->k1) return a->k1 < b->k1;
    if (a->k2 != b->k2) return a->k2 < b->k2;
    return a->seq < b->seq;
}

static void sift_up(Entry *d, Py_ssize_t i) {
    Entry item = d[i];
    while (i > 0) {
        Py_ssize_t parent = (i - 1) >> 1;
        if (!entry_less(&item, &d[parent])) break;
        d[i] = d[parent];
        i = parent;
    }
    d[i] = item;
}

static void sift_down(Entry *d, Py_ssize_t n, Py_ssize_t i) {
    Entry item = d[i];
    for (;;) {
        Py_ssize_t child = 2 * i + 1;
        if (child >= n) break;
        if (child + 1 < n && entry_less(&d[child + 1], &d[child])) child++;
        if (!entry_less(&d[child], &item)) break;
        d[i] = d[child];
        i = child;
    }
    d[i] = item;
}

/* 1 if entry's node still carries this entry's token, 0 if stale, -1 on error. */
static int entry_live(const Entry *e) {
    PyObject *token = PyObject_GetAttr(e->node, str_heap_token);
    if (token == NULL) return -1;
    int live = 0;
    if (token != Py_None) {
        long long value = PyLong_AsLongLong(token);
        if (value == -1 && PyErr_Occurred()) {
            Py_DECREF(token);
            return -1;
        }
        live = value == e->seq;
    }
    Py_DECREF(token);
    return live;
}

static int set_token(PyObject *node, PyObject *value) {
    return PyObject_SetAttr(node, str_heap_token, value);
}

/* Drop stale entries and re-heapify. On an error reading a token, the
 * entries not yet looked at are kept as they are (after those kept so far),
 * so no entry whose node was released stays in the array. */
static int compact(NodeHeap *self) {
    Py_ssize_t kept = 0, i = 0;
    int rc = 0;
    for (; i < self->len; i++) {
        int live = entry_live(&self->data[i]);
        if (live < 0) {
            rc = -1;
            break;
        }
        if (live) {
            self->data[kept++] = self->data[i];
        } else {
            Py_DECREF(self->data[i].node);
        }
    }
    for (; i < self->len; i++) self->data[kept++] = self->data[i];
    self->len = kept;
    for (Py_ssize_t j = kept / 2 - 1; j >= 0; j--) sift_down(self->data, kept, j);
    return rc;
}

static PyObject *NodeHeap_push(NodeHeap *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "push(node, k0, k1, k2) takes 4 arguments");
        return NULL;
    }
    PyObject *node = args[0];
    double k0 = PyFloat_AsDouble(args[1]);
    if (k0 == -1.0 && PyErr_Occurred()) return NULL;
    double k1 = PyFloat_AsDouble(args[2]);
    if (k1 == -1.0 && PyErr_Occurred()) return NULL;
    long long k2 = PyLong_AsLongLong(args[3]);
    if (k2 == -1 && PyErr_Occurred()) return NULL;
    PyObject *old = PyObject_GetAttr(node, str_heap_token);
    if (old == NULL) return NULL;
    int was_live = old != Py_None;
    Py_DECREF(old);
    int64_t seq = ++last_token; /* taken first: setting the token may run Python code */
    PyObject *token = PyLong_FromLongLong(seq);
    if (token == NULL) return NULL;
    int rc = set_token(node, token);
    Py_DECREF(token);
    if (rc < 0) return NULL;
    if (!was_live) self->size++;
    /* Room is made only now: the attribute calls above run Python code
     * (a property) that may itself push into this heap. */
    if (self->len == self->cap) {
        Py_ssize_t cap = self->cap ? 2 * self->cap : 1024;
        Entry *data = PyMem_Realloc(self->data, (size_t)cap * sizeof(Entry));
        if (data == NULL) return PyErr_NoMemory();
        self->data = data;
        self->cap = cap;
    }
    Entry *e = &self->data[self->len];
    e->k0 = k0;
    e->k1 = k1;
    e->k2 = k2;
    e->seq = seq;
    Py_INCREF(node);
    e->node = node;
    self->len++;
    sift_up(self->data, self->len - 1);
    if (self->len > 2 * self->size + 1024 && compact(self) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *NodeHeap_remove(NodeHeap *self, PyObject *node) {
    PyObject *token = PyObject_GetAttr(node, str_heap_token);
    if (token == NULL) return NULL;
    int live = token != Py_None;
    Py_DECREF(token);
    if (live) {
        if (set_token(node, Py_None) < 0) return NULL;
        self->size--;
    }
    Py_RETURN_NONE;
}

static PyObject *NodeHeap_pop(NodeHeap *self, PyObject *Py_UNUSED(ignored)) {
    while (self->len > 0) {
        Entry top = self->data[0];
        self->len--;
        if (self->len > 0) {
            self->data[0] = self->data[self->len];
            sift_down(self->data, self->len, 0);
        }
        int live = entry_live(&top);
        if (live < 0) {
            Py_DECREF(top.node);
            return NULL;
        }
        if (live) {
            if (set_token(top.node, Py_None) < 0) {
                Py_DECREF(top.node);
                return NULL;
            }
            self->size--;
            return top.node; /* the heap's reference passes to the caller */
        }
        Py_DECREF(top.node);
    }
    Py_RETURN_NONE;
}

/* The node pop() would return, left in place; stale entries on top are dropped. */
static PyObject *NodeHeap_peek(NodeHeap *self, PyObject *Py_UNUSED(ignored)) {
    while (self->len > 0) {
        int live = entry_live(&self->data[0]);
        if (live < 0) return NULL;
        if (live) {
            Py_INCREF(self->data[0].node);
            return self->data[0].node;
        }
        Entry top = self->data[0];
        self->len--;
        if (self->len > 0) {
            self->data[0] = self->data[self->len];
            sift_down(self->data, self->len, 0);
        }
        Py_DECREF(top.node);
    }
    Py_RETURN_NONE;
}

static PyObject *NodeHeap_get_size(NodeHeap *self, void *Py_UNUSED(closure)) {
    return PyLong_FromSsize_t(self->size);
}

static Py_ssize_t NodeHeap_len(NodeHeap *self) { return self->len; }

static int NodeHeap_traverse(NodeHeap *self, visitproc visit, void *arg) {
    for (Py_ssize_t i = 0; i < self->len; i++) Py_VISIT(self->data[i].node);
    return 0;
}

static int NodeHeap_clear(NodeHeap *self) {
    Py_ssize_t n = self->len;
    self->len = 0;
    for (Py_ssize_t i = 0; i < n; i++) Py_DECREF(self->data[i].node);
    return 0;
}

static void NodeHeap_dealloc(NodeHeap *self) {
    PyObject_GC_UnTrack(self);
    NodeHeap_clear(self);
    PyMem_Free(self->data);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef NodeHeap_methods[] = {
    {"push", (PyCFunction)(void (*)(void))NodeHeap_push, METH_FASTCALL,
     "push(node, k0, k1, k2): (re)insert node with key (k0, k1, k2)."},
    {"remove", (PyCFunction)NodeHeap_remove, METH_O, "remove(node): drop node's live entry."},
    {"pop", (PyCFunction)NodeHeap_pop, METH_NOARGS, "pop() -> node with the least key, or None."},
    {"peek", (PyCFunction)NodeHeap_peek, METH_NOARGS, "peek() -> what pop() would return, left in place."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef NodeHeap_getset[] = {
    {"size", (getter)NodeHeap_get_size, NULL, "live entries", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods NodeHeap_as_sequence = {
    .sq_length = (lenfunc)NodeHeap_len,
};

static PyTypeObject NodeHeapType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "sidecar.control._nodeheap.NodeHeap",
    .tp_basicsize = sizeof(NodeHeap),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Min-heap of radix nodes keyed by (k0, k1, k2), removal by heap_token.",
    .tp_new = PyType_GenericNew,
    .tp_dealloc = (destructor)NodeHeap_dealloc,
    .tp_traverse = (traverseproc)NodeHeap_traverse,
    .tp_clear = (inquiry)NodeHeap_clear,
    .tp_methods = NodeHeap_methods,
    .tp_getset = NodeHeap_getset,
    .tp_as_sequence = &NodeHeap_as_sequence,
};

static PyObject *next_token(PyObject *module, PyObject *unused) {
    return PyLong_FromLongLong(++last_token);
}

static PyMethodDef nodeheap_functions[] = {
    {"next_token", next_token, METH_NOARGS,
     "next_token() -> a heap token no heap in this process has handed out."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef nodeheap_module = {
    PyModuleDef_HEAD_INIT, "_nodeheap", "C candidate heap for the eviction policies.", -1,
    nodeheap_functions,
};

PyMODINIT_FUNC PyInit__nodeheap(void) {
    str_heap_token = PyUnicode_InternFromString("heap_token");
    if (str_heap_token == NULL) return NULL;
    if (PyType_Ready(&NodeHeapType) < 0) return NULL;
    PyObject *m = PyModule_Create(&nodeheap_module);
    if (m == NULL) return NULL;
    Py_INCREF(&NodeHeapType);
    if (PyModule_AddObject(m, "NodeHeap", (PyObject *)&NodeHeapType) < 0) {
        Py_DECREF(&NodeHeapType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
