/* Page copies between the CPU device pool and the host pool (aiohicache.transfer._pagecopy).
 *
 * Why native: a write-through copies every page of every layer's K and V, one "chunk"
 * (page_size rows) each. On the page-first host layout a page's chunks are 64 pieces of a
 * few hundred bytes on the device side, so numpy copies them as gathers or one slice call
 * per run, holding the GIL, with a plan built in Python per copy. Here one call copies the
 * whole job with plain memcpy, merging runs where both sides are contiguous, and may
 * release the GIL, so a copy thread really runs beside the event loop.
 *
 * A pool is described as `_geometry.Side` does it: the chunk of (page, kv, layer) starts at
 * offset + page * page_stride + kv * kv_stride + layer * layer_stride of the pool's bytes.
 * The copier holds both pools' buffers for its life and checks at construction that every
 * chunk lies inside them and that the pools do not overlap, and at each call that every page
 * id of its own snapshot of the ids is inside its pool, so no id or stride can make it touch
 * memory outside the pools.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

typedef struct {
    char *base;
    Py_ssize_t page, kv, layer, pages;
} side_t;

typedef struct {
    PyObject_HEAD
    int ready; /* set last, once everything below is checked */
    Py_buffer device_buf, host_buf;
    side_t device, host;
    Py_ssize_t chunk, num_kv, num_layers;
} PageCopier;

/* Read (offset, page, kv, layer, pages) of a side and check that every chunk is inside
 * `buf`. Returns -1 with an exception set. */
static int side_from(side_t *side, Py_buffer *buf, PyObject *strides, Py_ssize_t chunk,
                     Py_ssize_t num_kv, Py_ssize_t num_layers, const char *name) {
    Py_ssize_t offset;
    if (!PyArg_ParseTuple(strides, "nnnnn", &offset, &side->page, &side->kv, &side->layer,
                          &side->pages))
        return -1;
    if (offset < 0 || side->page < 0 || side->kv < 0 || side->layer < 0 || side->pages < 0) {
        PyErr_Format(PyExc_ValueError, "%s: offset, strides and pages must be >= 0", name);
        return -1;
    }
    side->base = (char *)buf->buf;
    if (side->pages == 0)
        return 0; /* no id is inside an empty pool: every copy is refused */
    /* the last byte of the last chunk, computed without overflow */
    Py_ssize_t end = offset, term;
    Py_ssize_t counts[3] = {side->pages - 1, num_kv - 1, num_layers - 1};
    Py_ssize_t steps[3] = {side->page, side->kv, side->layer};
    for (int i = 0; i < 3; i++) {
        if (__builtin_mul_overflow(counts[i], steps[i], &term) ||
            __builtin_add_overflow(end, term, &end))
            goto outside;
    }
    if (__builtin_add_overflow(end, chunk, &end) || end > buf->len)
        goto outside;
    side->base = (char *)buf->buf + offset;
    return 0;
outside:
    PyErr_Format(PyExc_ValueError, "%s: chunks reach past the pool's %zd bytes", name,
                 buf->len);
    return -1;
}

/* Whether the two buffers share a byte (memcpy between them would be undefined). */
static int overlap(const Py_buffer *a, const Py_buffer *b) {
    uintptr_t a0 = (uintptr_t)a->buf, b0 = (uintptr_t)b->buf;
    return a->len > 0 && b->len > 0 && a0 < b0 + (uintptr_t)b->len &&
           b0 < a0 + (uintptr_t)a->len;
}

/* Everything is read and checked into locals; the object takes it only when all is well,
 * so a failed __init__ leaves a copier that refuses to copy. */
static int copier_init(PageCopier *self, PyObject *args, PyObject *kwargs) {
    PyObject *device_obj, *device_strides, *host_obj, *host_strides;
    Py_ssize_t chunk, num_kv, num_layers;
    static char *keywords[] = {"device", "device_side", "host", "host_side", "chunk",
                               "num_kv", "num_layers", NULL};
    if (self->ready || self->device_buf.obj != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "PageCopier: already initialised");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO!OO!nnn", keywords, &device_obj,
                                     &PyTuple_Type, &device_strides, &host_obj, &PyTuple_Type,
                                     &host_strides, &chunk, &num_kv, &num_layers))
        return -1;
    if (chunk < 1 || num_kv < 1 || num_layers < 1) {
        PyErr_SetString(PyExc_ValueError, "chunk, num_kv and num_layers must be >= 1");
        return -1;
    }
    Py_buffer device_buf, host_buf;
    side_t device, host;
    if (PyObject_GetBuffer(device_obj, &device_buf, PyBUF_CONTIG) < 0)
        return -1;
    if (PyObject_GetBuffer(host_obj, &host_buf, PyBUF_CONTIG) < 0) {
        PyBuffer_Release(&device_buf);
        return -1;
    }
    if (side_from(&device, &device_buf, device_strides, chunk, num_kv, num_layers,
                  "device") < 0 ||
        side_from(&host, &host_buf, host_strides, chunk, num_kv, num_layers, "host") < 0)
        goto fail;
    if (overlap(&device_buf, &host_buf)) {
        PyErr_SetString(PyExc_ValueError, "device and host: the pools' bytes overlap");
        goto fail;
    }
    self->device_buf = device_buf;
    self->host_buf = host_buf;
    self->device = device;
    self->host = host;
    self->chunk = chunk;
    self->num_kv = num_kv;
    self->num_layers = num_layers;
    self->ready = 1;
    return 0;
fail:
    PyBuffer_Release(&device_buf);
    PyBuffer_Release(&host_buf);
    return -1;
}

static void copier_dealloc(PageCopier *self) {
    if (self->device_buf.obj != NULL)
        PyBuffer_Release(&self->device_buf);
    if (self->host_buf.obj != NULL)
        PyBuffer_Release(&self->host_buf);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

typedef struct {
    const int64_t *src, *dst;
    Py_ssize_t n;
    const side_t *from, *to;
    Py_ssize_t chunk, kv_lo, kv_hi, layer_lo, layer_hi;
} job_t;

/* Per (kv, layer), the pairs in order; where both sides' pages are one chunk apart, a run
 * of pages advancing by one on both sides is one memcpy. */
static void copy_layer_major(const job_t *j) {
    if (j->from->pages == 0 || j->to->pages == 0)
        return; /* every pair was a skip: an id in an empty pool is refused before */
    int runs = j->from->page == j->chunk && j->to->page == j->chunk;
    for (Py_ssize_t kv = j->kv_lo; kv < j->kv_hi; kv++) {
        for (Py_ssize_t layer = j->layer_lo; layer < j->layer_hi; layer++) {
            const char *from = j->from->base + kv * j->from->kv + layer * j->from->layer;
            char *to = j->to->base + kv * j->to->kv + layer * j->to->layer;
            Py_ssize_t i = 0;
            while (i < j->n) {
                int64_t s = j->src[i], d = j->dst[i];
                Py_ssize_t len = 1;
                if (s < 0 || d < 0) {
                    i++;
                    continue;
                }
                while (runs && i + len < j->n && j->src[i + len] == s + len &&
                       j->dst[i + len] == d + len)
                    len++;
                memcpy(to + d * j->to->page, from + s * j->from->page, len * j->chunk);
                i += len;
            }
        }
    }
}

/* Per pair, every (kv, layer) chunk: the destination page is written front to back, which
 * is what a page-first destination wants (its chunks are adjacent). */
static void copy_page_major(const job_t *j) {
    for (Py_ssize_t i = 0; i < j->n; i++) {
        int64_t s = j->src[i], d = j->dst[i];
        if (s < 0 || d < 0)
            continue;
        const char *from = j->from->base + s * j->from->page;
        char *to = j->to->base + d * j->to->page;
        for (Py_ssize_t kv = j->kv_lo; kv < j->kv_hi; kv++)
            for (Py_ssize_t layer = j->layer_lo; layer < j->layer_hi; layer++)
                memcpy(to + kv * j->to->kv + layer * j->to->layer,
                       from + kv * j->from->kv + layer * j->from->layer, j->chunk);
    }
}

/* An int64 id array: 1-D, contiguous. Returns -1 with an exception set. */
static int id_buffer(PyObject *obj, Py_buffer *view, const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    const char *f = view->format;
#if PY_LITTLE_ENDIAN
    const char order = '<';
#else
    const char order = '>';
#endif
    if (f != NULL && (f[0] == '=' || f[0] == '@' || f[0] == order))
        f++; /* native byte order */
    if (view->ndim != 1 || view->itemsize != 8 || f == NULL ||
        !(strcmp(f, "q") == 0 || strcmp(f, "l") == 0)) {
        PyErr_Format(PyExc_TypeError, "%s: must be a 1-D contiguous int64 array", name);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* The first pair with an id past its pool (a negative id skips its pair), or -1. */
static Py_ssize_t first_outside(const job_t *j) {
    for (Py_ssize_t i = 0; i < j->n; i++) {
        int64_t s = j->src[i], d = j->dst[i];
        if (s >= 0 && d >= 0 && (s >= j->from->pages || d >= j->to->pages))
            return i;
    }
    return -1;
}

/* Copy the job; the GIL is let go of for the copy if `release`. */
static void run_job(const job_t *job, Py_ssize_t chunk, int release) {
    /* page-major where the destination's chunks of a page are adjacent and the job covers
     * more than one of them */
    int page_major = job->to->page != chunk &&
                     (job->layer_hi - job->layer_lo > 1 || job->kv_hi - job->kv_lo > 1);
    /* NOTE: a small copy on the event loop keeps the GIL: letting go of it can cost the loop
     * a switch interval before it comes back */
    PyThreadState *saved = release ? PyEval_SaveThread() : NULL;
    if (page_major)
        copy_page_major(job);
    else
        copy_layer_major(job);
    if (saved != NULL)
        PyEval_RestoreThread(saved);
}

static PyObject *copier_copy(PageCopier *self, PyObject *args) {
    PyObject *src_obj, *dst_obj, *result = NULL;
    int to_device, release;
    Py_ssize_t layer_lo, layer_hi, bad;
    if (!PyArg_ParseTuple(args, "OOpnnp", &src_obj, &dst_obj, &to_device, &layer_lo,
                          &layer_hi, &release))
        return NULL;
    if (!self->ready) {
        PyErr_SetString(PyExc_RuntimeError, "PageCopier: not initialised");
        return NULL;
    }
    if (layer_lo < 0 || layer_lo > layer_hi || layer_hi > self->num_layers) {
        PyErr_Format(PyExc_ValueError, "layers: [%zd, %zd) is not inside [0, %zd)", layer_lo,
                     layer_hi, self->num_layers);
        return NULL;
    }
    Py_buffer src, dst;
    if (id_buffer(src_obj, &src, "src") < 0)
        return NULL;
    if (id_buffer(dst_obj, &dst, "dst") < 0) {
        PyBuffer_Release(&src);
        return NULL;
    }
    int64_t *ids = NULL;
    Py_ssize_t n = src.len / 8;
    if (src.len != dst.len) {
        PyErr_SetString(PyExc_ValueError, "src and dst: must have the same length");
        goto done;
    }
    /* The ids are checked and copied from a private snapshot: with the GIL released,
     * another thread could change the caller's arrays between the check and the copy. */
    if ((ids = PyMem_Malloc(2 * (size_t)n * sizeof(int64_t) + 1)) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    memcpy(ids, src.buf, (size_t)n * sizeof(int64_t));
    memcpy(ids + n, dst.buf, (size_t)n * sizeof(int64_t));
    job_t job = {ids, ids + n, n, to_device ? &self->host : &self->device,
                 to_device ? &self->device : &self->host, self->chunk, 0, self->num_kv,
                 layer_lo, layer_hi};
    if ((bad = first_outside(&job)) >= 0) {
        PyErr_Format(PyExc_IndexError, "pair %zd: page %lld -> %lld is outside the pools "
                     "(%zd -> %zd pages)", bad, (long long)job.src[bad],
                     (long long)job.dst[bad], job.from->pages, job.to->pages);
        goto done;
    }
    run_job(&job, self->chunk, release);
    result = Py_NewRef(Py_None);
done:
    PyMem_Free(ids);
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return result;
}
static PyMethodDef copier_methods[] = {
    {"copy", (PyCFunction)copier_copy, METH_VARARGS,
     "copy(src, dst, to_device, layer_lo, layer_hi, release_gil, /)\n--\n\n"
     "Copy pages src[i] -> dst[i] (int64 arrays; a negative id skips its pair) of layers\n"
     "[layer_lo, layer_hi), K and V, host -> device if to_device else device -> host.\n"
     "Nothing is copied if an id is past its pool (IndexError)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject PageCopierType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "aiohicache.transfer._pagecopy.PageCopier",
    .tp_basicsize = sizeof(PageCopier),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "PageCopier(device, device_side, host, host_side, chunk, num_kv, num_layers)\n"
              "--\n\nCopies pages between two pools given as byte buffers and\n"
              "(offset, page, kv, layer, pages) strides; holds both buffers.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)copier_init,
    .tp_dealloc = (destructor)copier_dealloc,
    .tp_methods = copier_methods,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_pagecopy",
    .m_doc = "Page copies between the CPU device pool and the host pool (see _pagecopy.c).",
    .m_size = -1,
};

PyMODINIT_FUNC PyInit__pagecopy(void) {
    if (PyType_Ready(&PageCopierType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "PageCopier", (PyObject *)&PageCopierType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
