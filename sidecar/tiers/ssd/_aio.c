/* Linux native AIO for the SSD tier: submit an O_DIRECT read or write and
 * go on (hashing the next block) while the device works, then reap it.
 *
 * A Queue is one kernel AIO context of `depth` slots, used by one thread at
 * a time. `submit` holds the buffer (a Py_buffer) until `wait` reaps its
 * completion, so the memory the device reads or writes cannot go away
 * under it. The GIL is released in io_submit (which may block on a full
 * device queue or an extent conversion) and in io_getevents. Closing a
 * queue with I/O in flight waits for that I/O (io_destroy blocks on what it
 * cannot cancel) before the buffers are released.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <linux/aio_abi.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define MAX_DEPTH 64

typedef struct {
    PyObject_HEAD
    aio_context_t ctx;
    int open;
    int depth;
    int pending;
    unsigned char busy[MAX_DEPTH];
    Py_buffer bufs[MAX_DEPTH];
    struct iocb iocbs[MAX_DEPTH];
} Queue;

static void release_all(Queue *q) {
    for (int i = 0; i < q->depth; i++) {
        if (q->busy[i]) {
            PyBuffer_Release(&q->bufs[i]);
            q->busy[i] = 0;
        }
    }
    q->pending = 0;
}

static void destroy(Queue *q) {
    if (!q->open)
        return;
    q->open = 0;
    aio_context_t ctx = q->ctx;
    Py_BEGIN_ALLOW_THREADS
    syscall(SYS_io_destroy, ctx);
    Py_END_ALLOW_THREADS
    release_all(q);
}

static int Queue_init(Queue *q, PyObject *args, PyObject *kwds) {
    static char *names[] = {"depth", NULL};
    int depth;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "i", names, &depth))
        return -1;
    if (depth < 1 || depth > MAX_DEPTH) {
        PyErr_Format(PyExc_ValueError, "depth must be 1..%d, not %d", MAX_DEPTH, depth);
        return -1;
    }
    destroy(q);
    q->ctx = 0;
    if (syscall(SYS_io_setup, (unsigned)depth, &q->ctx) != 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    q->open = 1;
    q->depth = depth;
    q->pending = 0;
    memset(q->busy, 0, sizeof q->busy);
    return 0;
}

static void Queue_dealloc(Queue *q) {
    destroy(q);
    Py_TYPE(q)->tp_free((PyObject *)q);
}

static PyObject *Queue_submit(Queue *q, PyObject *args) {
    int fd, write;
    PyObject *obj;
    long long offset;
    if (!PyArg_ParseTuple(args, "iOLp", &fd, &obj, &offset, &write))
        return NULL;
    if (!q->open) {
        PyErr_SetString(PyExc_ValueError, "the queue is closed");
        return NULL;
    }
    if (offset < 0) {
        PyErr_SetString(PyExc_ValueError, "offset must be >= 0");
        return NULL;
    }
    int slot = -1;
    for (int i = 0; i < q->depth; i++) {
        if (!q->busy[i]) {
            slot = i;
            break;
        }
    }
    if (slot < 0) {
        PyErr_SetString(PyExc_RuntimeError, "the queue is full: wait for a completion first");
        return NULL;
    }
    Py_buffer *buf = &q->bufs[slot];
    if (PyObject_GetBuffer(obj, buf, write ? PyBUF_SIMPLE : PyBUF_WRITABLE) != 0)
        return NULL;
    struct iocb *cb = &q->iocbs[slot];
    memset(cb, 0, sizeof *cb);
    cb->aio_data = (__u64)slot;
    cb->aio_lio_opcode = write ? IOCB_CMD_PWRITE : IOCB_CMD_PREAD;
    cb->aio_fildes = (__u32)fd;
    cb->aio_buf = (__u64)(uintptr_t)buf->buf;
    cb->aio_nbytes = (__u64)buf->len;
    cb->aio_offset = (__s64)offset;
    struct iocb *list[1] = {cb};
    aio_context_t ctx = q->ctx;
    long done;
    do {
        Py_BEGIN_ALLOW_THREADS
        done = syscall(SYS_io_submit, ctx, 1L, list);
        Py_END_ALLOW_THREADS
    } while (done < 0 && errno == EINTR);
    if (done != 1) {
        int err = done < 0 ? errno : EAGAIN;
        PyBuffer_Release(buf);
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    q->busy[slot] = 1;
    q->pending++;
    return PyLong_FromLong(slot);
}

static PyObject *Queue_wait(Queue *q, PyObject *args) {
    int min_nr;
    if (!PyArg_ParseTuple(args, "i", &min_nr))
        return NULL;
    if (!q->open) {
        PyErr_SetString(PyExc_ValueError, "the queue is closed");
        return NULL;
    }
    if (min_nr < 0 || min_nr > q->pending) {
        PyErr_Format(PyExc_ValueError, "%d completions asked, %d in flight", min_nr, q->pending);
        return NULL;
    }
    struct io_event events[MAX_DEPTH];
    aio_context_t ctx = q->ctx;
    long nr = q->pending;
    long got = 0;
    int err = 0;
    /* A signal makes io_getevents return what it has so far (or EINTR):
       wait again until min_nr are in. */
    do {
        long n;
        Py_BEGIN_ALLOW_THREADS
        n = syscall(SYS_io_getevents, ctx, (long)min_nr - got, nr - got, events + got, NULL);
        Py_END_ALLOW_THREADS
        if (n < 0 && errno != EINTR) {
            err = errno;
            break;
        }
        if (n > 0)
            got += n;
    } while (got < min_nr);
    /* Every reaped slot is let go of before anything else can fail: a slot
       left busy would never complete again. */
    for (long i = 0; i < got; i++) {
        int slot = (int)events[i].data;
        if (slot >= 0 && slot < q->depth && q->busy[slot]) {
            PyBuffer_Release(&q->bufs[slot]);
            q->busy[slot] = 0;
            q->pending--;
        }
    }
    if (err != 0) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    PyObject *out = PyList_New(got);
    if (out == NULL)
        return NULL;
    for (long i = 0; i < got; i++) {
        PyObject *item = Py_BuildValue("(iL)", (int)events[i].data, (long long)events[i].res);
        if (item == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, item);
    }
    return out;
}

static PyObject *Queue_close(Queue *q, PyObject *Py_UNUSED(ignored)) {
    destroy(q);
    Py_RETURN_NONE;
}

static PyObject *Queue_pending(Queue *q, void *Py_UNUSED(closure)) {
    return PyLong_FromLong(q->pending);
}

static PyMethodDef Queue_methods[] = {
    {"submit", (PyCFunction)Queue_submit, METH_VARARGS,
     "submit(fd, buffer, offset, write) -> slot: start one read or write"},
    {"wait", (PyCFunction)Queue_wait, METH_VARARGS,
     "wait(min_nr) -> [(slot, result)]: at least min_nr completions (bytes, or -errno)"},
    {"close", (PyCFunction)Queue_close, METH_NOARGS, "wait for what is in flight; free the context"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Queue_getset[] = {
    {"pending", (getter)Queue_pending, NULL, "submitted, not yet reaped", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject QueueType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "sidecar.tiers.ssd._aio.Queue",
    .tp_basicsize = sizeof(Queue),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One Linux AIO context of `depth` slots, for one thread at a time.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Queue_init,
    .tp_dealloc = (destructor)Queue_dealloc,
    .tp_methods = Queue_methods,
    .tp_getset = Queue_getset,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_aio", "Linux native AIO for the SSD tier.", -1, NULL,
};

PyMODINIT_FUNC PyInit__aio(void) {
    if (PyType_Ready(&QueueType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&QueueType);
    if (PyModule_AddObject(m, "Queue", (PyObject *)&QueueType) < 0) {
        Py_DECREF(&QueueType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
