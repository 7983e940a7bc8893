/* The columns of a window of Kineto trace events, decoded natively (kineto._native_columns wraps it).

   columnize(window, fast) reads `window`: whole JSON events separated by commas, possibly followed by the `]`
   that closes traceEvents (json_events.EventReader cuts windows this way), and returns the raw columns
   kineto._columns would build from them: one row per event that is not a metadata ("M") event, the values
   converted by the same rules. It hands the window back (returns None) whenever the Python reader could decide
   anything this code does not: a damaged or unusual event (not JSON, bytes that are not UTF-8, escapes in keys,
   a key given twice, deep nesting, long numbers), or a value the Python columns would count as unrepresentable
   or convert in a way of their own (a float where an integer belongs, a number where a name belongs, ...).
   Then the Python reader reads that window and counts what it finds, so the issues are the same by construction.

   `fast` follows EventReader's fast form (a union tagged by "ph" over the Trace Event Format's phases, metadata
   events decoded to nothing): while it holds, a window whose events do not all fit it turns it off for good,
   and from then on a metadata event whose args are not an object is damage (the Python reader skips it). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Bounds of kineto.py (tests/test_native_columns.py checks they agree). */
#define MAX_MESSAGE_NELEMS (1LL << 48)
#define MAX_MEMORY_BYTES (1LL << 48)
#define MAX_RANK (1LL << 24)
/* Far below any decoder's limit and far above any real event's nesting (3 or 4). */
#define MAX_DEPTH 32
/* A top-level object with more keys than this is handed back (no real event has 20). */
#define MAX_KEYS 64

typedef struct {
    char *data;
    size_t len, cap;
} Buf;

static int buf_grow(Buf *b, size_t extra) {
    if (b->len + extra <= b->cap) return 0;
    size_t cap = b->cap ? b->cap : 4096;
    while (cap < b->len + extra) cap *= 2;
    char *data = realloc(b->data, cap);
    if (!data) return -1;
    b->data = data;
    b->cap = cap;
    return 0;
}

enum Kind { ABSENT = 0, KNULL, KSTRING, KINT, KFLOAT, KTRUE, KFALSE, KOBJECT, KARRAY };

typedef struct {
    int kind;
    const char *start, *end; /* the value's text; a string's without its quotes */
    int escaped;             /* a string holding backslash escapes */
} Tok;

/* Where a value was found, when the caller asked (t is NULL when a value is only skipped). */
static void found(Tok *t, int kind, const char *start, const char *end, int escaped) {
    if (!t) return;
    t->kind = kind;
    t->start = start;
    t->end = end;
    t->escaped = escaped;
}

/* The fields read, in kineto._columns' column order, then the args read only to choose between others. */
enum Field {
    F_PH, F_CAT, F_NAME, F_PID, F_TID, F_TS, F_DUR, F_ID, F_STREAM, F_DEVICE, F_CORRELATION, F_EXTERNAL_ID,
    F_COLLECTIVE, F_IN_NELEMS, F_OUT_NELEMS, F_DTYPE, F_GROUP_SIZE, F_GROUP_NAME, F_GROUP_DESC, F_GROUP_RANKS,
    F_SEQ, F_COMMS_ID, F_SRC_RANK, F_DST_RANK, F_INPUT_DIMS, F_INPUT_TYPES, F_CONCRETE_INPUTS, F_BYTES, F_FLOPS,
    F_TOTAL_ALLOCATED, F_TOTAL_RESERVED, F_TS_NS, F_DUR_NS, N_COLUMNS,
    F_INPUT_DIMS_LEGACY = N_COLUMNS, F_MEMORY_BYTES, F_DEVICE_TYPE, F_ARGS, N_FIELDS
};

enum ColumnType { T_STR, T_RAW, T_I64, T_U64, T_F64 };

static const int COLUMN_TYPES[N_COLUMNS] = {
    T_STR, T_STR, T_STR, T_I64, T_I64, T_RAW, T_RAW, T_I64, T_I64, T_I64, T_I64, T_I64,
    T_STR, T_I64, T_I64, T_STR, T_I64, T_STR, T_STR, T_STR,
    T_I64, T_U64, T_I64, T_I64, T_RAW, T_RAW, T_RAW, T_I64, T_F64,
    T_I64, T_I64, T_I64, T_I64,
};

typedef struct {
    Buf values;   /* int64/uint64/double per row, or the text of strings */
    Buf offsets;  /* int32 per row + 1, strings only */
    Buf validity; /* one bit per row */
    Py_ssize_t nulls;
    int multiline; /* a raw text holding a line break */
} Column;

typedef struct {
    const char *cur, *end;
    Column columns[N_COLUMNS];
    Py_ssize_t rows;
} Parser;

#define HAND_BACK (-1)
#define NO_MEMORY (-2)

static inline void skip_ws(Parser *p) {
    while (p->cur < p->end && (*p->cur == ' ' || *p->cur == '\n' || *p->cur == '\r' || *p->cur == '\t')) p->cur++;
}

/* UTF-8 as Python's decoder accepts it: no overlongs, no surrogates, nothing past U+10FFFF. */
static int valid_utf8(const unsigned char *s, const unsigned char *end) {
    while (s < end) {
        if (end - s >= 8) {
            uint64_t word;
            memcpy(&word, s, 8);
            if (!(word & 0x8080808080808080ULL)) {
                s += 8;
                continue;
            }
        }
        unsigned char c = *s;
        if (c < 0x80) {
            s++;
        } else if (c >= 0xC2 && c <= 0xDF) {
            if (end - s < 2 || (s[1] & 0xC0) != 0x80) return 0;
            s += 2;
        } else if (c >= 0xE0 && c <= 0xEF) {
            if (end - s < 3 || (s[1] & 0xC0) != 0x80 || (s[2] & 0xC0) != 0x80) return 0;
            if (c == 0xE0 && s[1] < 0xA0) return 0;
            if (c == 0xED && s[1] >= 0xA0) return 0;
            s += 3;
        } else if (c >= 0xF0 && c <= 0xF4) {
            if (end - s < 4 || (s[1] & 0xC0) != 0x80 || (s[2] & 0xC0) != 0x80 || (s[3] & 0xC0) != 0x80) return 0;
            if (c == 0xF0 && s[1] < 0x90) return 0;
            if (c == 0xF4 && s[1] >= 0x90) return 0;
            s += 4;
        } else {
            return 0;
        }
    }
    return 1;
}

static int hex4(const char *s, unsigned *out) {
    unsigned v = 0;
    for (int i = 0; i < 4; i++) {
        char c = s[i];
        v <<= 4;
        if (c >= '0' && c <= '9') v |= (unsigned)(c - '0');
        else if (c >= 'a' && c <= 'f') v |= (unsigned)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F') v |= (unsigned)(c - 'A' + 10);
        else return -1;
    }
    *out = v;
    return 0;
}

/* A string at p->cur (its opening quote). Lone surrogate escapes are handed back (the Python reader repairs them). */
static int parse_string(Parser *p, Tok *t) {
    const char *s = ++p->cur;
    int escaped = 0;
    for (;;) {
        while (p->cur < p->end && *p->cur != '"' && *p->cur != '\\' && (unsigned char)*p->cur >= 0x20) p->cur++;
        if (p->cur >= p->end || (unsigned char)*p->cur < 0x20) return HAND_BACK;
        if (*p->cur == '"') break;
        escaped = 1;
        if (p->end - p->cur < 2) return HAND_BACK;
        char e = p->cur[1];
        if (e == 'u') {
            unsigned u, low;
            if (p->end - p->cur < 6 || hex4(p->cur + 2, &u)) return HAND_BACK;
            p->cur += 6;
            if (u >= 0xDC00 && u <= 0xDFFF) return HAND_BACK;
            if (u >= 0xD800 && u <= 0xDBFF) {
                if (p->end - p->cur < 6 || p->cur[0] != '\\' || p->cur[1] != 'u' || hex4(p->cur + 2, &low) ||
                    low < 0xDC00 || low > 0xDFFF)
                    return HAND_BACK;
                p->cur += 6;
            }
        } else if (e == '"' || e == '\\' || e == '/' || e == 'b' || e == 'f' || e == 'n' || e == 'r' || e == 't') {
            p->cur += 2;
        } else {
            return HAND_BACK;
        }
    }
    found(t, KSTRING, s, p->cur, escaped);
    p->cur++;
    return 0;
}

static inline int is_digit(char c) { return c >= '0' && c <= '9'; }

/* A JSON number, strictly. Floats msgspec could find out of range (an exponent of 3 digits, an integer part of
   over 20) are handed back; integers of any length are kept as text (a column reading them checks the range). */
static int parse_number(Parser *p, Tok *t) {
    const char *s = p->cur;
    int is_float = 0;
    if (p->cur < p->end && *p->cur == '-') p->cur++;
    const char *digits = p->cur;
    if (p->cur >= p->end || !is_digit(*p->cur)) return HAND_BACK;
    if (*p->cur == '0') p->cur++;
    else while (p->cur < p->end && is_digit(*p->cur)) p->cur++;
    const char *point = p->cur;
    if (p->cur < p->end && *p->cur == '.') {
        is_float = 1;
        p->cur++;
        if (p->cur >= p->end || !is_digit(*p->cur)) return HAND_BACK;
        while (p->cur < p->end && is_digit(*p->cur)) p->cur++;
    }
    if (p->cur < p->end && (*p->cur == 'e' || *p->cur == 'E')) {
        is_float = 1;
        p->cur++;
        if (p->cur < p->end && (*p->cur == '+' || *p->cur == '-')) p->cur++;
        const char *exp = p->cur;
        while (p->cur < p->end && is_digit(*p->cur)) p->cur++;
        if (p->cur == exp || p->cur - exp > 2) return HAND_BACK;
    }
    if (is_float && point - digits > 20) return HAND_BACK;
    found(t, is_float ? KFLOAT : KINT, s, p->cur, 0);
    return 0;
}

static int parse_value(Parser *p, Tok *t, int depth);

static int literal(Parser *p, const char *word, size_t n, int kind, Tok *t) {
    if ((size_t)(p->end - p->cur) < n || memcmp(p->cur, word, n)) return HAND_BACK;
    found(t, kind, p->cur, p->cur + n, 0);
    p->cur += n;
    return 0;
}

static int parse_container(Parser *p, Tok *t, int depth) {
    const char *s = p->cur;
    char close = *p->cur == '{' ? '}' : ']';
    int object = close == '}';
    if (depth > MAX_DEPTH) return HAND_BACK;
    p->cur++;
    skip_ws(p);
    if (p->cur < p->end && *p->cur == close) {
        p->cur++;
    } else {
        for (;;) {
            int rc;
            if (object) {
                if (p->cur >= p->end || *p->cur != '"') return HAND_BACK;
                if ((rc = parse_string(p, NULL))) return rc;
                skip_ws(p);
                if (p->cur >= p->end || *p->cur != ':') return HAND_BACK;
                p->cur++;
                skip_ws(p);
            }
            if ((rc = parse_value(p, NULL, depth + 1))) return rc;
            skip_ws(p);
            if (p->cur >= p->end) return HAND_BACK;
            if (*p->cur == close) {
                p->cur++;
                break;
            }
            if (*p->cur != ',') return HAND_BACK;
            p->cur++;
            skip_ws(p);
        }
    }
    found(t, object ? KOBJECT : KARRAY, s, p->cur, 0);
    return 0;
}

static int parse_value(Parser *p, Tok *t, int depth) {
    if (p->cur >= p->end) return HAND_BACK;
    switch (*p->cur) {
        case '"': return parse_string(p, t);
        case '{': case '[': return parse_container(p, t, depth);
        case 't': return literal(p, "true", 4, KTRUE, t);
        case 'f': return literal(p, "false", 5, KFALSE, t);
        case 'n': return literal(p, "null", 4, KNULL, t);
        default: return parse_number(p, t);
    }
}

#define KEY_IS(s, n, lit) ((n) == sizeof(lit) - 1 && !memcmp((s), (lit), sizeof(lit) - 1))

static int top_field(const char *k, size_t n) {
    switch (n) {
        case 2:
            if (KEY_IS(k, n, "ph")) return F_PH;
            if (KEY_IS(k, n, "ts")) return F_TS;
            if (KEY_IS(k, n, "id")) return F_ID;
            break;
        case 3:
            if (KEY_IS(k, n, "cat")) return F_CAT;
            if (KEY_IS(k, n, "pid")) return F_PID;
            if (KEY_IS(k, n, "tid")) return F_TID;
            if (KEY_IS(k, n, "dur")) return F_DUR;
            break;
        case 4:
            if (KEY_IS(k, n, "name")) return F_NAME;
            if (KEY_IS(k, n, "args")) return F_ARGS;
            break;
    }
    return -1;
}

/* The args keys kineto._Args reads (msgspec matches them exactly). */
static const struct {
    const char *key;
    size_t length;
    int field;
} ARG_KEYS[] = {
#define ARG(text, field) {text, sizeof(text) - 1, field}
    ARG("correlation", F_CORRELATION), ARG("External id", F_EXTERNAL_ID), ARG("stream", F_STREAM),
    ARG("device", F_DEVICE), ARG("Collective name", F_COLLECTIVE), ARG("In msg nelems", F_IN_NELEMS),
    ARG("Out msg nelems", F_OUT_NELEMS), ARG("dtype", F_DTYPE), ARG("Group size", F_GROUP_SIZE),
    ARG("Process Group Name", F_GROUP_NAME), ARG("Process Group Description", F_GROUP_DESC),
    ARG("Process Group Ranks", F_GROUP_RANKS), ARG("Seq", F_SEQ), ARG("Comms Id", F_COMMS_ID),
    ARG("Src Rank", F_SRC_RANK), ARG("Dst Rank", F_DST_RANK), ARG("Input Dims", F_INPUT_DIMS),
    ARG("Input dims", F_INPUT_DIMS_LEGACY), ARG("Input type", F_INPUT_TYPES),
    ARG("Concrete Inputs", F_CONCRETE_INPUTS), ARG("bytes", F_BYTES), ARG("Bytes", F_MEMORY_BYTES),
    ARG("Total Allocated", F_TOTAL_ALLOCATED), ARG("Total Reserved", F_TOTAL_RESERVED),
    ARG("Device Type", F_DEVICE_TYPE), ARG("flops", F_FLOPS),
#undef ARG
};

static int arg_field(const char *k, size_t n) {
    for (size_t i = 0; i < sizeof ARG_KEYS / sizeof ARG_KEYS[0]; i++)
        if (ARG_KEYS[i].length == n && !memcmp(ARG_KEYS[i].key, k, n)) return ARG_KEYS[i].field;
    return -1;
}

/* The object at p->cur as args: each key kineto._Args reads goes to its field, the last one given winning. */
static int parse_args(Parser *p, Tok *fields) {
    p->cur++;
    skip_ws(p);
    if (p->cur < p->end && *p->cur == '}') {
        p->cur++;
        return 0;
    }
    for (;;) {
        Tok key;
        int rc;
        if (p->cur >= p->end || *p->cur != '"') return HAND_BACK;
        if ((rc = parse_string(p, &key))) return rc;
        skip_ws(p);
        if (p->cur >= p->end || *p->cur != ':') return HAND_BACK;
        p->cur++;
        skip_ws(p);
        /* An escaped key may spell a known one: handed back */
        if (key.escaped) return HAND_BACK;
        int field = arg_field(key.start, (size_t)(key.end - key.start));
        if ((rc = parse_value(p, field >= 0 ? &fields[field] : NULL, 3))) return rc;
        skip_ws(p);
        if (p->cur >= p->end) return HAND_BACK;
        if (*p->cur == '}') {
            p->cur++;
            return 0;
        }
        if (*p->cur != ',') return HAND_BACK;
        p->cur++;
        skip_ws(p);
    }
}

/* ---------------------------------------------------------------------------------------------------------- */
/* Values -> column cells, by kineto._columns' rules; HAND_BACK where those rules would count the value. */

static int append_validity(Column *c, Py_ssize_t row, int valid) {
    if ((row & 7) == 0) {
        if (buf_grow(&c->validity, 1)) return NO_MEMORY;
        c->validity.data[c->validity.len++] = 0;
    }
    if (valid) c->validity.data[row >> 3] |= (char)(1 << (row & 7));
    else c->nulls++;
    return 0;
}

static int append_bytes(Column *c, Py_ssize_t row, const char *s, size_t n, int valid) {
    if (row == 0) {
        if (buf_grow(&c->offsets, 4)) return NO_MEMORY;
        memset(c->offsets.data, 0, 4);
        c->offsets.len = 4;
    }
    if (buf_grow(&c->values, n) || buf_grow(&c->offsets, 4)) return NO_MEMORY;
    if (c->values.len + n > INT32_MAX) return HAND_BACK;
    if (n) memcpy(c->values.data + c->values.len, s, n);  /* a null or empty cell: s may be NULL */
    c->values.len += n;
    int32_t end = (int32_t)c->values.len;
    memcpy(c->offsets.data + c->offsets.len, &end, 4);
    c->offsets.len += 4;
    return append_validity(c, row, valid);
}

static void put_utf8(char *out, size_t *n, unsigned u) {
    if (u < 0x80) out[(*n)++] = (char)u;
    else if (u < 0x800) {
        out[(*n)++] = (char)(0xC0 | (u >> 6));
        out[(*n)++] = (char)(0x80 | (u & 0x3F));
    } else if (u < 0x10000) {
        out[(*n)++] = (char)(0xE0 | (u >> 12));
        out[(*n)++] = (char)(0x80 | ((u >> 6) & 0x3F));
        out[(*n)++] = (char)(0x80 | (u & 0x3F));
    } else {
        out[(*n)++] = (char)(0xF0 | (u >> 18));
        out[(*n)++] = (char)(0x80 | ((u >> 12) & 0x3F));
        out[(*n)++] = (char)(0x80 | ((u >> 6) & 0x3F));
        out[(*n)++] = (char)(0x80 | (u & 0x3F));
    }
}

/* A string cell, its escapes decoded (parse_string checked them; a decoded string is never longer). */
static int append_string(Column *c, Py_ssize_t row, const Tok *t) {
    if (!t->escaped) return append_bytes(c, row, t->start, (size_t)(t->end - t->start), 1);
    size_t cap = (size_t)(t->end - t->start), n = 0;
    char *out = malloc(cap ? cap : 1);
    if (!out) return NO_MEMORY;
    for (const char *s = t->start; s < t->end;) {
        if (*s != '\\') {
            out[n++] = *s++;
            continue;
        }
        char e = s[1];
        if (e == 'u') {
            unsigned u, low;
            hex4(s + 2, &u);
            s += 6;
            if (u >= 0xD800 && u <= 0xDBFF) {
                hex4(s + 2, &low);
                s += 6;
                u = 0x10000 + ((u - 0xD800) << 10) + (low - 0xDC00);
            }
            put_utf8(out, &n, u);
            continue;
        }
        out[n++] = e == 'b' ? '\b' : e == 'f' ? '\f' : e == 'n' ? '\n' : e == 'r' ? '\r' : e == 't' ? '\t' : e;
        s += 2;
    }
    int rc = append_bytes(c, row, out, n, 1);
    free(out);
    return rc;
}

static int append_null(Column *c, Py_ssize_t row, int type) {
    if (type == T_STR || type == T_RAW) return append_bytes(c, row, NULL, 0, 0);
    if (buf_grow(&c->values, 8)) return NO_MEMORY;
    memset(c->values.data + c->values.len, 0, 8);
    c->values.len += 8;
    return append_validity(c, row, 0);
}

static int append_word(Column *c, Py_ssize_t row, const void *word) {
    if (buf_grow(&c->values, 8)) return NO_MEMORY;
    memcpy(c->values.data + c->values.len, word, 8);
    c->values.len += 8;
    return append_validity(c, row, 1);
}

/* kineto._str_column: strings as they are, null as null; anything else is handed back (Python writes numbers as
   its own text and counts containers). */
static int str_cell(Column *c, Py_ssize_t row, const Tok *t) {
    if (t->kind == ABSENT || t->kind == KNULL) return append_null(c, row, T_STR);
    if (t->kind != KSTRING) return HAND_BACK;
    return append_string(c, row, t);
}

/* kineto._raw_column: the value's JSON text as written (a column with a multi-line text is made compact after). */
static int raw_cell(Column *c, Py_ssize_t row, const Tok *t) {
    if (t->kind == ABSENT) return append_null(c, row, T_RAW);
    const char *s = t->start, *e = t->end;
    if (t->kind == KSTRING) {  /* the quotes belong to the text */
        s--;
        e++;
    }
    if (memchr(s, '\n', (size_t)(e - s)) || memchr(s, '\r', (size_t)(e - s))) c->multiline = 1;
    return append_bytes(c, row, s, (size_t)(e - s), 1);
}

/* kineto.microseconds_text_to_ns for the plain decimals it converts (a JSON number without an exponent): exact
   integer ns, digits past the third decimal dropped, toward zero. Null for everything else (a string, an exponent,
   null, a value beyond +-MAX_WHOLE_US): the raw text beside it goes to the Python conversion, which decides those
   (and counts what it cannot convert). */
#define MAX_WHOLE_US ((1LL << 62) / 1000 - 1)
static int ns_cell(Column *c, Py_ssize_t row, const Tok *t) {
    if (t->kind != KINT && t->kind != KFLOAT) return append_null(c, row, T_I64);
    const char *s = t->start, *e = t->end;
    int negative = *s == '-';
    if (negative) s++;
    int64_t whole = 0, fraction = 0;
    int digits = 0;
    for (; s < e && is_digit(*s); s++) {
        if (++digits > 18) return append_null(c, row, T_I64);
        whole = whole * 10 + (*s - '0');
    }
    if (s < e && *s == '.') {
        s++;
        for (int place = 0; place < 3; place++) fraction = fraction * 10 + (s < e && is_digit(*s) ? *s++ - '0' : 0);
        while (s < e && is_digit(*s)) s++;
    }
    if (s != e || whole > MAX_WHOLE_US) return append_null(c, row, T_I64); /* an exponent, or beyond the bound */
    int64_t ns = whole * 1000 + fraction;
    if (negative) ns = -ns;
    return append_word(c, row, &ns);
}

/* Decimal digits (at most 20, optional '-') -> value, 0 when beyond 64 bits. */
static int digits_value(const char *s, const char *e, int *negative, uint64_t *magnitude) {
    *negative = s < e && *s == '-';
    if (*negative) s++;
    if (s >= e) return 0;
    uint64_t v = 0;
    for (; s < e; s++) {
        unsigned d = (unsigned)(*s - '0');
        if (v > (UINT64_MAX - d) / 10) return 0;
        v = v * 10 + d;
    }
    *magnitude = v;
    return 1;
}

/* Within the column's type (int64, or uint64 for comms ids), as kineto._coerce_int requires. */
static int in_type(int negative, uint64_t magnitude, int unsigned64, int64_t *out) {
    if (unsigned64) {
        if (negative && magnitude) return 0;
        memcpy(out, &magnitude, 8);
        return 1;
    }
    if (magnitude > (uint64_t)INT64_MAX + negative) return 0;
    *out = negative ? (int64_t)(0 - magnitude) : (int64_t)magnitude;
    return 1;
}

static inline int py_space(char c) { return c == ' ' || (c >= '\t' && c <= '\r') || (c >= 0x1C && c <= 0x1F); }

/* kineto._int_column (with _coerce_int): integers in range, numeric strings ("7", " -3 ", "stream 7") parsed,
   other labels ("PyTorch Profiler") null. A value it would count (beyond the type or the column's bounds, a
   float, a bool, a container, "99999999999999999999") is handed back, as is text that is not ASCII (str.isdigit
   knows other digits). `bounded`: lo..hi hold (the type's range otherwise). */
static int int_cell(Column *c, Py_ssize_t row, const Tok *t, int unsigned64, int bounded, long long lo, long long hi) {
    int negative;
    uint64_t magnitude;
    int64_t value;
    if (t->kind == ABSENT || t->kind == KNULL) return append_null(c, row, T_I64);
    if (t->kind == KINT) {
        if (!digits_value(t->start, t->end, &negative, &magnitude) || !in_type(negative, magnitude, unsigned64, &value))
            return HAND_BACK;
    } else {
        if (t->kind != KSTRING || t->escaped) return HAND_BACK;
        const char *s = t->start, *e = t->end;
        for (const char *q = s; q < e; q++)
            if ((unsigned char)*q >= 0x80) return HAND_BACK;
        /* Python counts a null from text that is '-'s then digits; other labels are names, not damage. */
        const char *q = s;
        while (q < e && *q == '-') q++;
        int counted_if_null = q < e;
        for (const char *r = q; r < e; r++)
            if (!is_digit(*r)) counted_if_null = 0;
        if ((size_t)(e - s) >= 7 && !memcmp(s, "stream ", 7)) s += 7;
        while (s < e && py_space(*s)) s++;
        while (e > s && py_space(e[-1])) e--;
        const char *d = s < e && *s == '-' ? s + 1 : s;
        int numeric = d < e && e - s <= 20;
        for (const char *r = d; r < e && numeric; r++)
            if (!is_digit(*r)) numeric = 0;
        if (!(numeric && digits_value(s, e, &negative, &magnitude) && in_type(negative, magnitude, unsigned64, &value)))
            return counted_if_null ? HAND_BACK : append_null(c, row, T_I64);
    }
    if (bounded && (value < lo || value > hi)) return HAND_BACK;
    return append_word(c, row, &value);
}

/* kineto._float_column: finite numbers >= 0; integers past 2**53 and everything else handed back. */
static int float_cell(Column *c, Py_ssize_t row, const Tok *t) {
    if (t->kind == ABSENT || t->kind == KNULL) return append_null(c, row, T_F64);
    if (t->kind != KINT && t->kind != KFLOAT) return HAND_BACK;
    char text[64];
    size_t n = (size_t)(t->end - t->start);
    if (n >= sizeof text) return HAND_BACK;
    memcpy(text, t->start, n);
    text[n] = 0;
    double v;
    if (t->kind == KINT) {  /* Python's int has no -0 */
        int negative;
        uint64_t magnitude;
        if (!digits_value(t->start, t->end, &negative, &magnitude) || magnitude > (1ULL << 53) || (negative && magnitude))
            return HAND_BACK;
        v = (double)magnitude;
    } else {
        v = strtod(text, NULL);  /* correctly rounded, as msgspec's */
    }
    if (!isfinite(v) || v < 0) return HAND_BACK;
    return append_word(c, row, &v);
}

/* kineto._raw_column re-encodes every text of a column holding a multi-line one (msgspec's decode, then encode):
   compact JSON. That is the text without blanks outside strings, for texts of lists, strings without escapes and
   integers; a float, -0, an escape or an object (whose keys a decode would merge) is handed back. */
static int compact_column(Column *c, Py_ssize_t rows) {
    Buf out = {0};
    int32_t start = 0, end;  /* the row's text in the old values (offsets are rewritten as it goes) */
    if (buf_grow(&out, c->values.len)) return NO_MEMORY;
    for (Py_ssize_t row = 0; row < rows; row++, start = end) {
        memcpy(&end, c->offsets.data + 4 * (row + 1), 4);
        const char *s = c->values.data + start, *e = c->values.data + end;
        while (s < e) {
            char ch = *s;
            if (ch == ' ' || ch == '\n' || ch == '\r' || ch == '\t') {
                s++;
            } else if (ch == '"') {
                const char *close = s + 1;
                while (*close != '"') {
                    if (*close == '\\') goto hand_back;
                    close++;
                }
                memcpy(out.data + out.len, s, (size_t)(close + 1 - s));
                out.len += (size_t)(close + 1 - s);
                s = close + 1;
            } else if (ch == '-' || is_digit(ch)) {
                const char *q = s + 1;
                while (q < e && (is_digit(*q) || *q == '.' || *q == 'e' || *q == 'E' || *q == '+' || *q == '-')) q++;
                for (const char *r = s; r < q; r++)
                    if (*r == '.' || *r == 'e' || *r == 'E') goto hand_back;
                if (q - s == 2 && s[0] == '-' && s[1] == '0') goto hand_back;
                memcpy(out.data + out.len, s, (size_t)(q - s));
                out.len += (size_t)(q - s);
                s = q;
            } else if (ch == '{') {
                goto hand_back;
            } else {
                out.data[out.len++] = ch;
                s++;
            }
        }
        int32_t compact_end = (int32_t)out.len;
        memcpy(c->offsets.data + 4 * (row + 1), &compact_end, 4);
    }
    free(c->values.data);
    c->values = out;
    return 0;
hand_back:
    free(out.data);
    return HAND_BACK;
}

static inline int present(const Tok *t) { return t->kind != ABSENT && t->kind != KNULL; }

static int emit_row(Parser *p, Tok *f) {
    Column *c = p->columns;
    Py_ssize_t row = p->rows;
    int rc;
#define CELL(expr) if ((rc = (expr))) return rc
    CELL(str_cell(&c[F_PH], row, &f[F_PH]));
    CELL(str_cell(&c[F_CAT], row, &f[F_CAT]));
    CELL(str_cell(&c[F_NAME], row, &f[F_NAME]));
    CELL(int_cell(&c[F_PID], row, &f[F_PID], 0, 0, 0, 0));
    CELL(int_cell(&c[F_TID], row, &f[F_TID], 0, 0, 0, 0));
    CELL(raw_cell(&c[F_TS], row, &f[F_TS]));
    CELL(raw_cell(&c[F_DUR], row, &f[F_DUR]));
    CELL(ns_cell(&c[F_TS_NS], row, &f[F_TS]));
    CELL(ns_cell(&c[F_DUR_NS], row, &f[F_DUR]));
    CELL(int_cell(&c[F_ID], row, &f[F_ID], 0, 0, 0, 0));
    CELL(int_cell(&c[F_STREAM], row, &f[F_STREAM], 0, 0, 0, 0));
    CELL(int_cell(&c[F_DEVICE], row, &f[F_DEVICE], 0, 0, 0, 0));
    CELL(int_cell(&c[F_CORRELATION], row, &f[F_CORRELATION], 0, 0, 0, 0));
    CELL(int_cell(&c[F_EXTERNAL_ID], row, &f[F_EXTERNAL_ID], 0, 0, 0, 0));
    /* Collective args are read only on the events that name a collective, a sequence number or a comms id. */
    static const Tok absent = {ABSENT, NULL, NULL, 0};
    int comm = present(&f[F_COLLECTIVE]) || present(&f[F_SEQ]) || present(&f[F_COMMS_ID]);
#define COMM(field) (comm ? &f[field] : &absent)
    CELL(str_cell(&c[F_COLLECTIVE], row, COMM(F_COLLECTIVE)));
    CELL(int_cell(&c[F_IN_NELEMS], row, COMM(F_IN_NELEMS), 0, 1, 0, MAX_MESSAGE_NELEMS));
    CELL(int_cell(&c[F_OUT_NELEMS], row, COMM(F_OUT_NELEMS), 0, 1, 0, MAX_MESSAGE_NELEMS));
    CELL(str_cell(&c[F_DTYPE], row, COMM(F_DTYPE)));
    CELL(int_cell(&c[F_GROUP_SIZE], row, COMM(F_GROUP_SIZE), 0, 1, 1, MAX_RANK));
    CELL(str_cell(&c[F_GROUP_NAME], row, COMM(F_GROUP_NAME)));
    CELL(str_cell(&c[F_GROUP_DESC], row, COMM(F_GROUP_DESC)));
    CELL(str_cell(&c[F_GROUP_RANKS], row, COMM(F_GROUP_RANKS)));
    CELL(int_cell(&c[F_SEQ], row, COMM(F_SEQ), 0, 0, 0, 0));
    CELL(int_cell(&c[F_COMMS_ID], row, COMM(F_COMMS_ID), 1, 0, 0, 0));
    CELL(int_cell(&c[F_SRC_RANK], row, COMM(F_SRC_RANK), 0, 0, 0, 0));
    CELL(int_cell(&c[F_DST_RANK], row, COMM(F_DST_RANK), 0, 0, 0, 0));
    /* msgspec.Raw() is falsy only when absent: a null "Input Dims" is still chosen over "Input dims" */
    CELL(raw_cell(&c[F_INPUT_DIMS], row, f[F_INPUT_DIMS].kind != ABSENT ? &f[F_INPUT_DIMS] : &f[F_INPUT_DIMS_LEGACY]));
    CELL(raw_cell(&c[F_INPUT_TYPES], row, &f[F_INPUT_TYPES]));
    CELL(raw_cell(&c[F_CONCRETE_INPUTS], row, &f[F_CONCRETE_INPUTS]));
    CELL(int_cell(&c[F_BYTES], row, present(&f[F_BYTES]) ? &f[F_BYTES] : &f[F_MEMORY_BYTES], 0, 1, -MAX_MEMORY_BYTES,
                  MAX_MEMORY_BYTES));
    CELL(float_cell(&c[F_FLOPS], row, &f[F_FLOPS]));
    /* An allocator total counts for device allocators only; Python compares 'Device Type' with 0 (0.0 and false
       included), so only integers and strings are compared here. */
    int memory = present(&f[F_TOTAL_ALLOCATED]) || present(&f[F_TOTAL_RESERVED]);
    const Tok *type = &f[F_DEVICE_TYPE];
    if (memory && type->kind != ABSENT && type->kind != KNULL && type->kind != KINT && type->kind != KSTRING)
        return HAND_BACK;
    int host = 0, negative;
    uint64_t magnitude;
    if (type->kind == KINT) host = digits_value(type->start, type->end, &negative, &magnitude) && magnitude == 0;
    int device_memory = memory && !host;
    CELL(int_cell(&c[F_TOTAL_ALLOCATED], row, device_memory ? &f[F_TOTAL_ALLOCATED] : &absent, 0, 1, 0, MAX_MEMORY_BYTES));
    CELL(int_cell(&c[F_TOTAL_RESERVED], row, device_memory ? &f[F_TOTAL_RESERVED] : &absent, 0, 1, 0, MAX_MEMORY_BYTES));
#undef CELL
#undef COMM
    p->rows++;
    return 0;
}

/* The phases of kineto.TRACE_EVENT_PHASES: the fast form's tags. */
static int is_phase(const Tok *t) {
    if (t->kind != KSTRING || t->escaped || t->end - t->start != 1) return 0;
    return strchr("XiIsftMBECbnePNODVvRc()", t->start[0]) != NULL;
}

typedef struct {
    int fast;            /* every event so far fits the fast form */
    int metadata_damage; /* a metadata event whose args are neither an object nor null */
} WindowState;

/* One event at p->cur; its row appended unless it is a metadata event. */
static int parse_event(Parser *p, WindowState *w) {
    Tok f[N_FIELDS];
    const char *keys[MAX_KEYS];
    size_t key_lengths[MAX_KEYS];
    int n_keys = 0, rc;
    memset(f, 0, sizeof f);
    if (p->cur >= p->end || *p->cur != '{') return HAND_BACK;
    p->cur++;
    skip_ws(p);
    if (p->cur < p->end && *p->cur == '}') {
        p->cur++;
    } else {
        for (;;) {
            Tok key;
            if (p->cur >= p->end || *p->cur != '"') return HAND_BACK;
            if ((rc = parse_string(p, &key))) return rc;
            size_t n = (size_t)(key.end - key.start);
            /* A key given twice is the Python reader's to count (json_events._count_duplicate_keys). */
            if (key.escaped || n_keys == MAX_KEYS) return HAND_BACK;
            for (int i = 0; i < n_keys; i++)
                if (key_lengths[i] == n && !memcmp(keys[i], key.start, n)) return HAND_BACK;
            keys[n_keys] = key.start;
            key_lengths[n_keys++] = n;
            skip_ws(p);
            if (p->cur >= p->end || *p->cur != ':') return HAND_BACK;
            p->cur++;
            skip_ws(p);
            int field = top_field(key.start, n);
            if (field == F_ARGS && p->cur < p->end && *p->cur == '{') {
                f[F_ARGS].kind = KOBJECT;
                if ((rc = parse_args(p, f))) return rc;
            } else if ((rc = parse_value(p, field >= 0 ? &f[field] : NULL, 2))) {
                return rc;
            }
            skip_ws(p);
            if (p->cur >= p->end) return HAND_BACK;
            if (*p->cur == '}') {
                p->cur++;
                break;
            }
            if (*p->cur != ',') return HAND_BACK;
            p->cur++;
            skip_ws(p);
        }
    }
    const Tok *ph = &f[F_PH];
    if (ph->kind == KSTRING && ph->escaped) return HAND_BACK;
    int metadata = ph->kind == KSTRING && ph->end - ph->start == 1 && ph->start[0] == 'M';
    int args_ok = f[F_ARGS].kind == ABSENT || f[F_ARGS].kind == KNULL || f[F_ARGS].kind == KOBJECT;
    if (!is_phase(ph) || (!metadata && !args_ok)) w->fast = 0;
    if (metadata) {
        if (!args_ok) w->metadata_damage = 1;
        return 0;
    }
    if (!args_ok) return HAND_BACK;  /* a damaged event: skipped and counted by the Python reader */
    return emit_row(p, f);
}

static void free_columns(Parser *p) {
    for (int i = 0; i < N_COLUMNS; i++) {
        free(p->columns[i].values.data);
        free(p->columns[i].offsets.data);
        free(p->columns[i].validity.data);
    }
}

static PyObject *bytes_of(const Buf *b) { return PyBytes_FromStringAndSize(b->data ? b->data : "", (Py_ssize_t)b->len); }

/* (values, offsets or None, validity or None) per column. */
static PyObject *columns_tuple(Parser *p) {
    PyObject *out = PyTuple_New(N_COLUMNS);
    if (!out) return NULL;
    for (int i = 0; i < N_COLUMNS; i++) {
        Column *c = &p->columns[i];
        int text = COLUMN_TYPES[i] == T_STR || COLUMN_TYPES[i] == T_RAW;
        if (text && p->rows == 0) {  /* no row appended: the one offset */
            buf_grow(&c->offsets, 4);
            if (c->offsets.data) {
                memset(c->offsets.data, 0, 4);
                c->offsets.len = 4;
            }
        }
        PyObject *values = bytes_of(&c->values);
        PyObject *offsets = text ? bytes_of(&c->offsets) : (Py_INCREF(Py_None), Py_None);
        PyObject *validity = c->nulls ? bytes_of(&c->validity) : (Py_INCREF(Py_None), Py_None);
        if (!values || !offsets || !validity) {
            Py_XDECREF(values);
            Py_XDECREF(offsets);
            Py_XDECREF(validity);
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SET_ITEM(out, i, Py_BuildValue("(NNNn)", values, offsets, validity, c->nulls));
        if (!PyTuple_GET_ITEM(out, i)) {
            Py_DECREF(out);
            return NULL;
        }
    }
    return out;
}

static PyObject *columnize(PyObject *self, PyObject *args) {
    Py_buffer view;
    int fast;
    if (!PyArg_ParseTuple(args, "y*p", &view, &fast)) return NULL;
    Parser p;
    memset(&p, 0, sizeof p);
    p.cur = view.buf;
    p.end = p.cur + view.len;
    WindowState w = {fast, 0};
    int rc = 0, ended = 0;
    Py_BEGIN_ALLOW_THREADS
    if (!valid_utf8((const unsigned char *)p.cur, (const unsigned char *)p.end)) rc = HAND_BACK;
    while (!rc) {
        if ((rc = parse_event(&p, &w))) break;
        skip_ws(&p);
        if (p.cur >= p.end) break;
        if (*p.cur == ']') {  /* the end of traceEvents */
            p.cur++;
            /* ...unless another ']' follows: damage ("}]]," mid-array) the Python reader reads past */
            const char *after = p.cur;
            while (after < p.end && (*after == ' ' || *after == '\t' || *after == '\n' || *after == '\r')) after++;
            if (after < p.end && *after == ']') rc = HAND_BACK;
            else ended = 1;
            break;
        }
        if (*p.cur != ',') {
            rc = HAND_BACK;
            break;
        }
        p.cur++;
        skip_ws(&p);
    }
    /* Once the fast form is off, a metadata event with damaged args is the Python reader's to skip and count. */
    if (!rc && !w.fast && w.metadata_damage) rc = HAND_BACK;
    for (int i = 0; i < N_COLUMNS && !rc; i++)
        if (p.columns[i].multiline) rc = compact_column(&p.columns[i], p.rows);
    Py_END_ALLOW_THREADS
    PyObject *result = NULL;
    if (rc == NO_MEMORY) {
        PyErr_NoMemory();
    } else if (rc) {
        Py_INCREF(Py_None);
        result = Py_None;
    } else {
        PyObject *columns = columns_tuple(&p);
        if (columns)
            result = Py_BuildValue("(NnnOO)", columns, p.rows, (Py_ssize_t)(p.cur - (const char *)view.buf),
                                   ended ? Py_True : Py_False, w.fast ? Py_True : Py_False);
    }
    free_columns(&p);
    PyBuffer_Release(&view);
    return result;
}

static PyMethodDef METHODS[] = {
    {"columnize", columnize, METH_VARARGS,
     "columnize(window, fast) -> (columns, rows, consumed, ended, fast) or None: the window handed back."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef MODULE = {PyModuleDef_HEAD_INIT, "_columnize", NULL, -1, METHODS};

PyMODINIT_FUNC PyInit__columnize(void) {
    PyObject *m = PyModule_Create(&MODULE);
    if (!m) return NULL;
    if (PyModule_AddObject(m, "BOUNDS", Py_BuildValue("(LLLL)", MAX_MESSAGE_NELEMS, MAX_MEMORY_BYTES, MAX_RANK, MAX_WHOLE_US))) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
