/* Optional compiled kernels of the corpus stage; train_deploy.corpus.native falls back to numpy without them.
 *
 * strip_pos_tags(bytes) -> bytes   the People's Daily `word/POS` tag removal of people_daily.strip_pos_tag_bytes
 * flatten_ids(list[list[int]], itemsize) -> bytes   token id lists as one uint16/int32 array (native order)
 * nfkc_fold(codes, mapping, lengths) -> (bytearray, bytes)
 *     cleaning's table NFKC (cleaning._expand): the folded uint32 codes, and the int64 indices of the code
 *     points the tables cannot fold alone (their documents take the exact slow path)
 * clean_codes(codes, control, space, strip_control, normalize_whitespace) -> int
 *     cleaning._clean_codes_numpy in place on a writable uint32 array; returns the new length
 *
 * Both must give exactly what their numpy versions give; tests/corpus/test_native.py compares them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static inline int is_letter(unsigned char c) { c |= 0x20; return c >= 'a' && c <= 'z'; }
static inline int is_alnum(unsigned char c) { return is_letter(c) || (c >= '0' && c <= '9'); }
static inline int is_blank(unsigned char c) { return c == ' ' || c == '\t'; }

/* Bytes 2-3 of the UTF-8 of U+FF10-FF19, U+FF21-FF3A (EF BC ..) or U+FF41-FF5A (EF BD ..). */
static inline int full_width(unsigned char b, unsigned char c) {
    return (b == 0xBC && ((c >= 0x90 && c <= 0x99) || (c >= 0xA1 && c <= 0xBA))) ||
           (b == 0xBD && c >= 0x81 && c <= 0x9A);
}

/* The byte at i, or 0 past the end (the numpy version appends a 0 sentinel). */
static inline unsigned char at(const unsigned char *d, Py_ssize_t n, Py_ssize_t i) { return i < n ? d[i] : 0; }

static PyObject *strip_pos_tags(PyObject *self, PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    const unsigned char *d = view.buf;
    Py_ssize_t n = view.len, written = 0, kept_from = 0, i = 0;
    PyObject *out = PyBytes_FromStringAndSize(NULL, n);
    if (out == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    unsigned char *w = (unsigned char *)PyBytes_AS_STRING(out);
    Py_BEGIN_ALLOW_THREADS
    while (i < n) {
        const unsigned char *slash = memchr(d + i, '/', (size_t)(n - i));
        if (slash == NULL) break;
        Py_ssize_t start = slash - d, end = start + 1;
        i = start + 1;
        while (is_letter(at(d, n, end))) end++;
        if (end == start + 1 || at(d, n, end) > 0x20) continue; /* "/" + letters + a space, a line end or the end */
        Py_ssize_t after = end;
        while (is_blank(at(d, n, after))) after++;
        int keep_space = 0;
        if (after > end) { /* one space stays between two words that would run together as Latin or digits */
            unsigned char next = at(d, n, after);
            int alnum_after = is_alnum(next) || (next == 0xEF && full_width(at(d, n, after + 1), at(d, n, after + 2)));
            int alnum_before = (start >= 1 && is_alnum(d[start - 1])) ||
                               (start >= 3 && d[start - 3] == 0xEF && full_width(d[start - 2], d[start - 1]));
            keep_space = alnum_after && alnum_before;
        }
        memcpy(w + written, d + kept_from, (size_t)(start - kept_from));
        written += start - kept_from;
        kept_from = keep_space ? after - 1 : after;
        i = after;
    }
    memcpy(w + written, d + kept_from, (size_t)(n - kept_from));
    written += n - kept_from;
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    if (_PyBytes_Resize(&out, written) < 0) return NULL;
    return out;
}

static PyObject *flatten_ids(PyObject *self, PyObject *args) {
    PyObject *lists;
    int itemsize;
    if (!PyArg_ParseTuple(args, "Oi", &lists, &itemsize)) return NULL;
    if (itemsize != 2 && itemsize != 4) {
        PyErr_SetString(PyExc_ValueError, "itemsize must be 2 (uint16) or 4 (int32)");
        return NULL;
    }
    PyObject *outer = PySequence_Fast(lists, "expected a list of lists of ids");
    if (outer == NULL) return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(outer), total = 0;
    PyObject **rows = PySequence_Fast_ITEMS(outer);
    for (Py_ssize_t r = 0; r < count; r++) {
        if (!PyList_Check(rows[r])) {
            Py_DECREF(outer);
            PyErr_SetString(PyExc_TypeError, "expected a list of lists of ids");
            return NULL;
        }
        total += PyList_GET_SIZE(rows[r]);
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, total * itemsize);
    if (out == NULL) {
        Py_DECREF(outer);
        return NULL;
    }
    char *w = PyBytes_AS_STRING(out);
    long high = itemsize == 2 ? 0xFFFF : 0x7FFFFFFF, low = itemsize == 2 ? 0 : -0x7FFFFFFF - 1;
    for (Py_ssize_t r = 0; r < count; r++) {
        Py_ssize_t size = PyList_GET_SIZE(rows[r]);
        PyObject **items = ((PyListObject *)rows[r])->ob_item;
        for (Py_ssize_t k = 0; k < size; k++) {
            long id = PyLong_AsLong(items[k]);
            if (id == -1 && PyErr_Occurred()) goto fail;
            if (id < low || id > high) {
                PyErr_Format(PyExc_OverflowError, "token id %ld does not fit %d bytes", id, itemsize);
                goto fail;
            }
            if (itemsize == 2) {
                uint16_t v = (uint16_t)id;
                memcpy(w, &v, 2);
            } else {
                int32_t v = (int32_t)id;
                memcpy(w, &v, 4);
            }
            w += itemsize;
        }
    }
    Py_DECREF(outer);
    return out;
fail:
    Py_DECREF(outer);
    Py_DECREF(out);
    return NULL;
}

/* Keep codes[i] where keep says so, in place; the predicate sees the pass's input (prev, cur, next). */
#define COMPACT(n, KEEP)                                                              \
    do {                                                                              \
        Py_ssize_t out_ = 0;                                                          \
        uint32_t prev2 = 0xFFFFFFFF, prev = 0xFFFFFFFF;                               \
        for (Py_ssize_t i_ = 0; i_ < (n); i_++) {                                     \
            uint32_t cur = c[i_], next = i_ + 1 < (n) ? c[i_ + 1] : 0xFFFFFFFF;       \
            (void)next; (void)prev2;                                                  \
            if (KEEP) c[out_++] = cur;                                                \
            prev2 = prev;                                                             \
            prev = cur;                                                               \
        }                                                                             \
        (n) = out_;                                                                   \
    } while (0)

static PyObject *clean_codes(PyObject *self, PyObject *args) {
    Py_buffer codes, control, space;
    int strip_control, normalize_whitespace;
    if (!PyArg_ParseTuple(args, "w*y*y*pp", &codes, &control, &space, &strip_control, &normalize_whitespace))
        return NULL;
    if (codes.len % 4 != 0 || control.len < 0x10000 || space.len < 0x10000) {
        PyBuffer_Release(&codes);
        PyBuffer_Release(&control);
        PyBuffer_Release(&space);
        PyErr_SetString(PyExc_ValueError, "expected uint32 codes and two 65536-entry tables");
        return NULL;
    }
    uint32_t *c = codes.buf;
    const unsigned char *is_control = control.buf, *is_space = space.buf;
    Py_ssize_t n = codes.len / 4;
    Py_BEGIN_ALLOW_THREADS
    if (strip_control || normalize_whitespace) {
        COMPACT(n, !(cur == 0x0D && next == 0x0A)); /* \r\n -> \n */
        for (Py_ssize_t i = 0; i < n; i++)
            if (c[i] == 0x0D || c[i] == 0x2028 || c[i] == 0x2029 || c[i] == 0x85) c[i] = 0x0A;
    }
    if (strip_control) COMPACT(n, !(cur <= 0xFFFF && is_control[cur]));
    if (normalize_whitespace) {
        for (Py_ssize_t i = 0; i < n; i++)
            if (c[i] <= 0xFFFF && is_space[c[i]]) c[i] = 0x20;
        COMPACT(n, !(cur == 0x20 && prev == 0x20));                        /* runs of spaces -> one space */
        COMPACT(n, !(cur == 0x20 && (prev == 0x0A || next == 0x0A)));      /* no space beside a line break */
        COMPACT(n, !(cur == 0x0A && prev == 0x0A && prev2 == 0x0A));       /* at most one blank line */
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&codes);
    PyBuffer_Release(&control);
    PyBuffer_Release(&space);
    return PyLong_FromSsize_t(n);
}

static PyObject *nfkc_fold(PyObject *self, PyObject *args) {
    Py_buffer codes, mapping, lengths;
    if (!PyArg_ParseTuple(args, "y*y*y*", &codes, &mapping, &lengths)) return NULL;
    PyObject *folded = NULL, *unsafe = NULL, *result = NULL;
    if (codes.len % 4 != 0 || lengths.len < 0x10000 || mapping.len < (Py_ssize_t)4 * 4 * 0x10000) {
        PyErr_SetString(PyExc_ValueError, "expected uint32 codes, a 4 x 65536 uint32 mapping and 65536 lengths");
        goto done;
    }
    const uint32_t *c = codes.buf, *map = mapping.buf;
    const unsigned char *len = lengths.buf;
    Py_ssize_t n = codes.len / 4, total = 0, bad = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned char k = c[i] <= 0xFFFF ? len[c[i]] : 0;
        total += k ? k : 1;
        bad += k == 0;
    }
    folded = PyByteArray_FromStringAndSize(NULL, total * 4);
    unsafe = PyBytes_FromStringAndSize(NULL, bad * 8);
    if (folded == NULL || unsafe == NULL) goto done;
    uint32_t *out = (uint32_t *)PyByteArray_AS_STRING(folded);
    int64_t *where = (int64_t *)PyBytes_AS_STRING(unsafe);
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned char k = c[i] <= 0xFFFF ? len[c[i]] : 0;
        if (k == 0) {
            *out++ = c[i];
            *where++ = (int64_t)i;
        } else {
            for (unsigned char j = 0; j < k; j++) *out++ = map[(Py_ssize_t)j * 0x10000 + c[i]];
        }
    }
    result = PyTuple_Pack(2, folded, unsafe);
done:
    Py_XDECREF(folded);
    Py_XDECREF(unsafe);
    PyBuffer_Release(&codes);
    PyBuffer_Release(&mapping);
    PyBuffer_Release(&lengths);
    return result;
}

static PyMethodDef methods[] = {
    {"strip_pos_tags", strip_pos_tags, METH_O, "People's Daily word/POS tags removed from UTF-8 bytes."},
    {"flatten_ids", flatten_ids, METH_VARARGS, "Token id lists as one array of itemsize-byte ids in native byte order."},
    {"nfkc_fold", nfkc_fold, METH_VARARGS, "Table NFKC of uint32 code points, with the indices it cannot fold."},
    {"clean_codes", clean_codes, METH_VARARGS, "The cleaning rules on a writable uint32 code point array, in place."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fast", "Compiled corpus kernels.", -1, methods};

PyMODINIT_FUNC PyInit__fast(void) { return PyModule_Create(&module); }
