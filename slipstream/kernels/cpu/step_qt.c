// The step's products over re-blocked ggml types (Q5_0, Q5_1, Q5_K, IQ4_NL, IQ4_XS, Q6_K and the per-16 IQ
// planes): a unit of its own so that it compiles beside step.c (build.py), its kernels being a third of the
// library's code once every row count's variant is inlined.
#include <alloca.h>

#include "step.h"

#if defined(SS_AVX2)
// Rows [n0, n1) of a re-blocked Q6_K matrix (t: QT_R_Q6_K), or of the per-16 IQ planes (t: QT_R_IQ2_XS for those
// without minimums, QT_R_Q2_K), on the fast path, 8 weight rows at a time (qtypes.h qt_rb6_rows8); one function per
// t below (a shared one made the Q6_K kernel's batch-8 rate 0.67-0.85x, kernel_rate.py)
AI void rb6_rows_t(const int t, const SSMat *m, int n0, int n1, int nb, const SSAct *x, float *y, int ystride,
                   int accumulate, int pf_rows, int64_t row_bytes) {
    const int K = m->k, iq = qt_rb16(t);
    const QTValues *kvt = qt_kv(m->qtype);
    const int16_t *xh = x->h;
    if (!xh) {   // a decode task's rows: summed here, once for the task's weight rows
        int16_t *t = alloca(sizeof(int16_t) * (size_t)nb * (K / 16));
        qt_code_sums16(x->q, K, nb, t);
        xh = t;
    }
    int n = n0;
#if defined(SS_TWIN)
    // the per-16 IQ planes: 16 weight rows at a time from iq16_from_rows activation rows on (the same bits as 8 at a
    // time: qt_rb16_rows16)
    if (iq && nb >= iq16_from_rows && twin_usable)
        for (; n + 8 < n1; n += 16) {
            const int live = n1 - n < 16 ? n1 - n : 16;
            const uint8_t *w[16];
            for (int r = 0; r < 16; r++) w[r] = (const uint8_t *)m->q + (int64_t)(n + (r < live ? r : live - 1)) * row_bytes;
            const char *pf = pf_rows && n + pf_rows + 16 <= m->n ? (const char *)m->q + (int64_t)(n + pf_rows) * row_bytes : NULL;
            __m512 out[MAX_ROWS];
#define R16(NB) qt_rb16_rows16(t, kvt, w, K, x->q, x->d, xh, NB, pf, 16 * row_bytes / (K / 32), out);
            SS_BY_ROWS(nb, R16)
#undef R16
            rows16_store(m, out, nb, n, live, y, ystride, accumulate);
        }
#endif
    for (; n < n1; n += 8) {
        const int live = n1 - n < 8 ? n1 - n : 8;
        const uint8_t *w[8];
        for (int r = 0; r < 8; r++) w[r] = (const uint8_t *)m->q + (int64_t)(n + (r < live ? r : live - 1)) * row_bytes;
        const char *pf = pf_rows && n + pf_rows + 8 <= m->n ? (const char *)m->q + (int64_t)(n + pf_rows) * row_bytes : NULL;
        __m256 out[MAX_ROWS];
#define Q6I(NB) qt_rb6_rows8(t, kvt, w, K, x->q, x->d, xh, NB, pf, out);
        SS_BY_ROWS(nb, Q6I)
#undef Q6I
        rows8_store(m, out, nb, n, live, y, ystride, accumulate);
    }
}
#define RB6_ROWS(NAME, T)                                                                                            \
    __attribute__((noinline)) static void NAME(const SSMat *m, int n0, int n1, int nb, const SSAct *x, float *y,     \
                                               int ystride, int accumulate, int pf_rows, int64_t row_bytes) {        \
        rb6_rows_t(T, m, n0, n1, nb, x, y, ystride, accumulate, pf_rows, row_bytes);                                 \
    }
RB6_ROWS(q6i_rows, QT_R_Q6_K)
RB6_ROWS(q16i_rows, QT_R_IQ2_XS)
RB6_ROWS(q2i_rows, QT_R_Q2_K)
#undef RB6_ROWS

// Rows [n0, n1) of a re-blocked Q5_0, Q5_1, Q5_K, IQ4_NL or IQ4_XS matrix on the fast path, 8 weight rows at a time
// (qt_rb5_rows8, qt_rbnl_rows8)
__attribute__((noinline)) static void q5i_rows(const SSMat *m, int n0, int n1, int nb, const SSAct *x, float *y,
                                              int ystride, int accumulate, int pf_rows, int64_t row_bytes) {
    const int K = m->k, t = qt_rb_layout(m->qtype);
    const QTValues *kvt = qt_kv(m->qtype);
    int n = n0;
#if defined(SS_TWIN)
    // IQ4 layouts: 16 weight rows at a time from iq16_from_rows activation rows on (the same bits as 8 at a time:
    // qt_rbnl_rows16)
    if (qt_rb_iq4(t) && nb >= iq16_from_rows && twin_usable)
        for (; n + 8 < n1; n += 16) {
            const int live = n1 - n < 16 ? n1 - n : 16;
            const uint8_t *w[16];
            for (int r = 0; r < 16; r++) w[r] = (const uint8_t *)m->q + (int64_t)(n + (r < live ? r : live - 1)) * row_bytes;
            const char *pf = pf_rows && n + pf_rows + 16 <= m->n ? (const char *)m->q + (int64_t)(n + pf_rows) * row_bytes : NULL;
            __m512 out[MAX_ROWS];
#define NL16(NB) qt_rbnl_rows16(t, kvt, w, K, x->q, x->d, x->s, NB, pf, 16 * row_bytes / (K / 32), out);
            SS_BY_ROWS(nb, NL16)
#undef NL16
            rows16_store(m, out, nb, n, live, y, ystride, accumulate);
        }
#endif
    for (; n < n1; n += 8) {
        const int live = n1 - n < 8 ? n1 - n : 8;
        const uint8_t *w[8];
        for (int r = 0; r < 8; r++) w[r] = (const uint8_t *)m->q + (int64_t)(n + (r < live ? r : live - 1)) * row_bytes;
        const char *pf = pf_rows && n + pf_rows + 8 <= m->n ? (const char *)m->q + (int64_t)(n + pf_rows) * row_bytes : NULL;
        const int64_t pf_group = 8 * row_bytes / (K / 32);
        __m256 out[MAX_ROWS];
#define Q5I(NB)                                                                                       \
        if (t == QT_R_Q5_0) qt_rb5_rows8(QT_R_Q5_0, w, K, x->q, x->d, x->s, NB, pf, pf_group, out);  \
        else if (t == QT_R_Q5_1) qt_rb5_rows8(QT_R_Q5_1, w, K, x->q, x->d, x->s, NB, pf, pf_group, out); \
        else if (t == QT_R_Q5_K) qt_rb5_rows8(QT_R_Q5_K, w, K, x->q, x->d, x->s, NB, pf, pf_group, out); \
        else if (t == QT_R_IQ4_NL) qt_rbnl_rows8(QT_R_IQ4_NL, kvt, w, K, x->q, x->d, x->s, NB, pf, pf_group, out); \
        else qt_rbnl_rows8(QT_R_IQ4_XS, kvt, w, K, x->q, x->d, x->s, NB, pf, pf_group, out);
        SS_BY_ROWS(nb, Q5I)
#undef Q5I
        rows8_store(m, out, nb, n, live, y, ystride, accumulate);
    }
}

// Rows [n0, n1) of a re-blocked matrix (QT_R_Q5_0, _Q5_1, _Q5_K, _IQ4_NL, _IQ4_XS, _Q6_K) on the fast path,
// up to MAX_ROWS activation rows: as q_rows, one loop nest per (type, row count) in a function of
// its own, instead of a call of qt_q8_row per weight row. Returns 0 for the other types.
int qt_rows(const SSMat *m, int n0, int n1, int nb, const SSAct *x, float *y, int ystride, int accumulate,
            int pf_rows, int64_t row_bytes) {
    const int K = m->k;
    const int8_t *xq = x->q;
    const float *xd = x->d, *xs = x->s;
#define QTR_NEST(NB, ROW)                                                                          \
    for (int n = n0; n < n1; n++) {                                                                 \
        float out[MAX_ROWS];                                                                        \
        const uint8_t *w = (const uint8_t *)m->q + (int64_t)n * row_bytes;                          \
        if (pf_rows && n + pf_rows < m->n) {                                                        \
            const char *c = (const char *)m->q + (int64_t)(n + pf_rows) * row_bytes;                \
            for (int64_t o = 0; o < row_bytes; o += 64) __builtin_prefetch(c + o, 0, 2);           \
        }                                                                                           \
        ROW;                                                                                        \
        for (int b = 0; b < (NB); b++) {                                                            \
            float *yo = y + (int64_t)b * ystride + n;                                               \
            const float v = m->bias ? out[b] + m->bias[n] : out[b];                                 \
            *yo = accumulate ? *yo + v : v;                                                         \
        }                                                                                           \
    }
#define QTR_LOOP(NB) QTR_NEST(NB, qt_rb_q8_row(T_, kvt, w, K, xq, xd, xs, NB, out))
#define QTR6_LOOP(NB) QTR_NEST(NB, qt_rb6_q8_row(QT_R_Q6_K, kvt, w, K, xq, xd, NB, out))
#define QTR16_LOOP(NB) QTR_NEST(NB, qt_rb6_q8_row(QT_R_IQ2_XS, kvt, w, K, xq, xd, NB, out))
#define QTR2_LOOP(NB) QTR_NEST(NB, qt_rb6_q8_row(QT_R_Q2_K, kvt, w, K, xq, xd, NB, out))
#define QTR_CASE(T) case T: { enum { T_ = T }; SS_BY_ROWS(nb, QTR_LOOP) } return 1;
    const int layout = qt_rb_layout(m->qtype);
    const QTValues *kvt = qt_kv(m->qtype);
    if ((qt_rb_q5(layout) || qt_rb_iq4(layout)) && rows8_on(m)) {
        q5i_rows(m, n0, n1, nb, x, y, ystride, accumulate, pf_rows, row_bytes);
        return 1;
    }
    switch (layout) {
    QTR_CASE(QT_R_Q5_0) QTR_CASE(QT_R_Q5_1) QTR_CASE(QT_R_IQ4_NL) QTR_CASE(QT_R_IQ4_XS) QTR_CASE(QT_R_Q5_K)
    case QT_R_Q6_K:
        if (rows8_on(m)) {
            q6i_rows(m, n0, n1, nb, x, y, ystride, accumulate, pf_rows, row_bytes);
            return 1;
        }
        SS_BY_ROWS(nb, QTR6_LOOP)
        return 1;
    case QT_R_IQ2_XS: case QT_R_IQ2_S: case QT_R_IQ1_M: case QT_R_Q3_K: case QT_R_Q2_K:
        if (rows8_on(m)) {
            if (m->qtype == QT_R_Q2_K) q2i_rows(m, n0, n1, nb, x, y, ystride, accumulate, pf_rows, row_bytes);
            else q16i_rows(m, n0, n1, nb, x, y, ystride, accumulate, pf_rows, row_bytes);
            return 1;
        }
        if (m->qtype == QT_R_Q2_K) { SS_BY_ROWS(nb, QTR2_LOOP) } else { SS_BY_ROWS(nb, QTR16_LOOP) }
        return 1;
    default: return 0;
    }
#undef QTR_CASE
#undef QTR16_LOOP
#undef QTR2_LOOP
#undef QTR6_LOOP
#undef QTR_LOOP
#undef QTR_NEST
}
#endif
