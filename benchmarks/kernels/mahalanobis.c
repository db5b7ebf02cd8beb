/* The Mahalanobis step as a hand-written CPU kernel, for benchmarks/mahalanobis.py --native (not used by padim):
 * out[n, p] = || W_p (x[n, :, p] - mean[p]) ||^2 for every picture n and position p, x channels first (N, D, P)
 * as the embedding gives it, W_p lower triangular with float16 entries (as `train --factor-dtype auto` stores them).
 *
 * Layout of a position's factor (`pack` in the benchmark): for each column k, the R-row blocks b = k / R .. B - 1 of
 * W[:, k] (R = 16 with AVX-512, 8 with AVX2; B = ceil(D / R); entries above the diagonal or past D are zero): only
 * the blocks that reach below the diagonal are read (6,976 of 10,000 entries at D = 100 with R = 16), each once a
 * picture, in float16 (half of float32's bytes). The partial products of a picture stay in registers, y[b] +=
 * W[block b, k] * delta[k], and pictures are taken four at a time (AVX-512) so that a factor read from memory
 * serves four of them; the differences are gathered 4 positions at a time (x read along positions). Positions
 * are split over `threads` POSIX threads.
 *
 * Built by the benchmark with the system C compiler (cc -O3 -shared -fPIC -pthread); each function carries its own
 * instruction set (target attributes), and the benchmark calls the one the CPU has.
 */
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>

#define MAX_DIM 128

typedef struct {
    const float *x, *mean;
    const uint16_t *packed;
    float *out;
    long rows, pixels, dim, entries, first, stop;
} Work;

/* The differences of pictures n .. n + count_n at CHUNK positions from p, gathered position by position: x is read
   along positions (a few floats in a row), not along channels (a stride of P floats). */
enum { CHUNK = 4, G = 4, ROWS = 64 };
typedef float Tile[ROWS][CHUNK][MAX_DIM];
static void differences(const Work *w, long n, long count_n, long p, long count, Tile delta) {
    for (long g = 0; g < count_n; ++g)
        for (long k = 0; k < w->dim; ++k) {
            const float *row = w->x + ((n + g) * w->dim + k) * w->pixels + p;
            for (long j = 0; j < count; ++j) delta[g][j][k] = row[j] - w->mean[(p + j) * w->dim + k];
        }
}

/* Pictures n .. n + count_n at position p (its factor read once for up to G of them). */
__attribute__((target("avx512f"))) static void position_avx512(const Work *w, long p, long j, long n, long count_n,
                                                               Tile delta) {
    enum { R = 16, MAXB = MAX_DIM / 16 };
    const long B = (w->dim + R - 1) / R;
    for (long m = 0; m < count_n;) {
        const long g_count = count_n - m >= G ? G : 1;
        __m512 y[G][MAXB];
        for (int g = 0; g < G; ++g)
            for (int b = 0; b < MAXB; ++b) y[g][b] = _mm512_setzero_ps();
        const uint16_t *column = w->packed + p * w->entries;
        if (g_count == G) {
            float near[G][MAX_DIM]; /* the group's differences side by side */
            for (int g = 0; g < G; ++g)
                for (long k = 0; k < w->dim; ++k) near[g][k] = delta[m + g][j][k];
            for (long k = 0; k < w->dim; ++k) {
                __m512 d[G];
                for (int g = 0; g < G; ++g) d[g] = _mm512_set1_ps(near[g][k]);
                for (int b = 0; b < MAXB; ++b) {
                    if (b < k / R || b >= B) continue;
                    const __m512 entries = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)column));
                    column += R;
                    for (int g = 0; g < G; ++g) y[g][b] = _mm512_fmadd_ps(entries, d[g], y[g][b]);
                }
            }
        } else {
            for (long k = 0; k < w->dim; ++k) {
                const __m512 d = _mm512_set1_ps(delta[m][j][k]);
                for (int b = 0; b < MAXB; ++b) {
                    if (b < k / R || b >= B) continue;
                    const __m512 entries = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)column));
                    column += R;
                    y[0][b] = _mm512_fmadd_ps(entries, d, y[0][b]);
                }
            }
        }
        for (long g = 0; g < g_count; ++g) {
            __m512 sum = _mm512_setzero_ps();
            for (int b = 0; b < MAXB; ++b) sum = _mm512_fmadd_ps(y[g][b], y[g][b], sum);
            w->out[(n + m + g) * w->pixels + p] = _mm512_reduce_add_ps(sum);
        }
        m += g_count;
    }
}

__attribute__((target("avx2,fma,f16c"))) static void position_avx2(const Work *w, long p, long j, long n, long count_n,
                                                                  Tile delta) {
    enum { R = 8, MAXB = MAX_DIM / 8 };
    const long B = (w->dim + R - 1) / R;
    for (long m = 0; m < count_n; ++m) {
        __m256 y[MAXB];
        for (int b = 0; b < MAXB; ++b) y[b] = _mm256_setzero_ps();
        const uint16_t *column = w->packed + p * w->entries;
        for (long k = 0; k < w->dim; ++k) {
            const __m256 d = _mm256_set1_ps(delta[m][j][k]);
            for (int b = 0; b < MAXB; ++b) {
                if (b < k / R || b >= B) continue;
                const __m256 entries = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)column));
                column += R;
                y[b] = _mm256_fmadd_ps(entries, d, y[b]);
            }
        }
        __m256 sum = _mm256_setzero_ps();
        for (int b = 0; b < MAXB; ++b) sum = _mm256_fmadd_ps(y[b], y[b], sum);
        const __m128 half = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
        const __m128 pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
        w->out[(n + m) * w->pixels + p] = _mm_cvtss_f32(_mm_add_ss(pair, _mm_shuffle_ps(pair, pair, 1)));
    }
}

static void step(const Work *w, int isa) {
    Tile delta; /* 128 KB of the thread's stack */
    for (long p = w->first; p < w->stop; p += CHUNK) {
        const long count = w->stop - p < CHUNK ? w->stop - p : CHUNK;
        for (long n = 0; n < w->rows; n += ROWS) {
            const long count_n = w->rows - n < ROWS ? w->rows - n : ROWS;
            differences(w, n, count_n, p, count, delta);
            for (long j = 0; j < count; ++j) {
                if (isa == 512)
                    position_avx512(w, p + j, j, n, count_n, delta);
                else
                    position_avx2(w, p + j, j, n, count_n, delta);
            }
        }
    }
}

static void *run_avx512(void *work) { step((const Work *)work, 512); return 0; }
static void *run_avx2(void *work) { step((const Work *)work, 256); return 0; }
/* isa: 512 (AVX-512F) or 256 (AVX2, FMA, F16C). Returns 0, or -1 for a shape or instruction set it cannot take. */
int mahalanobis_f16(int isa, const float *x, const float *mean, const uint16_t *packed, float *out, long rows,
                    long pixels, long dim, long entries, int threads) {
    if (dim < 1 || dim > MAX_DIM || threads < 1 || threads > 64 || (isa != 512 && isa != 256)) return -1;
    void *(*run)(void *) = isa == 512 ? run_avx512 : run_avx2;
    Work work[64];
    pthread_t id[64];
    for (int t = 0; t < threads; ++t) {
        work[t] = (Work){x, mean, packed, out, rows, pixels, dim, entries, pixels * t / threads,
                         pixels * (t + 1) / threads};
    }
    for (int t = 1; t < threads; ++t) pthread_create(&id[t], 0, run, &work[t]);
    run(&work[0]);
    for (int t = 1; t < threads; ++t) pthread_join(id[t], 0);
    return 0;
}
