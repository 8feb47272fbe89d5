/* Weight-only bf16 linear layer for decode-sized batches on AVX2 + FMA CPUs (libs/kernels/cpu_gemv.py).
 *
 *   y[m, n] = x[m, k] @ W[n, k]^T (+ bias[n])
 *
 * x, bias, y are fp32; W holds bf16 bit patterns, widened to fp32 in registers (a bf16 is the top half of
 * an fp32); all products and sums are fp32. With 1-8 rows a linear layer is bound by memory bandwidth:
 * each weight loaded feeds only m multiply-adds, so reading 2 bytes per weight instead of 4 halves the time.
 *
 * Blocking: rows of x go in groups of up to 4; a group walks the weight rows two at a time, so each weight
 * vector loaded feeds up to 4 FMAs and each x vector (x stays in L1) feeds 2. Every (x row, weight row)
 * pair has its own accumulator, plus a second set along k for 1-2 row groups: 4-8 independent FMA chains
 * (hides the FMA latency), at most 8 live accumulators (AVX2 has 16 ymm registers).
 * With more than 4 rows the weight rows are taken in chunks of ~128 KB (fits L2) and every group runs over
 * a chunk before the next, so the weights still come from memory once per call.
 * A software prefetch runs PF_BYTES ahead in the weight stream: the hardware prefetchers alone left this
 * kernel at about half the bandwidth on AMD Zen 3 (the two weight rows read side by side look like two
 * streams to them).
 * Threads: linear_bf16w_mt splits the weight rows into parts that the calling thread and a pool of helper
 * threads claim one at a time (an atomic counter), so each output column is computed by exactly the code the
 * single-threaded call runs: the result's bits do not depend on the thread count. Helpers spin for
 * spin_ns after a job (the next layer's job usually comes within ~0.1 ms of a decode step) and then sleep
 * on a futex, so an idle engine costs no CPU; the caller never waits for a sleeping helper to wake up,
 * because it claims whatever parts are left itself.
 */
#include <immintrin.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define INLINE static inline __attribute__((always_inline))
#define PF_BYTES 4096        /* prefetch distance in the weight stream (~1 µs of memory traffic) */
#define CHUNK_BYTES 131072   /* weight rows per chunk when m > 4: this many bytes of W */

/* 8 bf16 -> 8 fp32: broadcast the 16 bytes to both 128-bit lanes, then one byte shuffle moves elements
 * 0-3 (low lane) and 4-7 (high lane) into the high halves of 32-bit slots and zeroes the low halves.
 * (1 shuffle uop; zero-extend + shift would be 2, and they compete with the FMAs for the same ports.) */
INLINE __m256 load_bf16x8(const uint16_t *p) {
    const __m256i to_hi = _mm256_setr_epi8(-1, -1, 0, 1, -1, -1, 2, 3, -1, -1, 4, 5, -1, -1, 6, 7,
                                           -1, -1, 8, 9, -1, -1, 10, 11, -1, -1, 12, 13, -1, -1, 14, 15);
    __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_shuffle_epi8(v, to_hi));
}

INLINE float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v = { (uint32_t)h << 16 };
    return v.f;
}

INLINE float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* R rows of x (stride k) against 8 columns of NB weight rows at column i, into accumulator set u. */
#define STEP(i, u)                                                                                      \
    do {                                                                                                \
        __m256 wv[2];                                                                                   \
        for (int c = 0; c < NB; c++) wv[c] = load_bf16x8(wr[c] + (i));                                  \
        for (int r = 0; r < R; r++) {                                                                   \
            __m256 xv = _mm256_loadu_ps(x + (size_t)r * k + (i));                                       \
            __asm__("" : "+x"(xv)); /* keep x in a register: else gcc reloads it inside each FMA */     \
            for (int c = 0; c < NB; c++) acc[r][c][u] = _mm256_fmadd_ps(xv, wv[c], acc[r][c][u]);      \
        }                                                                                               \
    } while (0)

/* y[r, j0 + c] for r < R rows of x, c < NB weight rows from j0; KU accumulator sets along k (1 or 2).
 * R, NB, KU are constants at every call site (always_inline): the loops over them unroll and acc[][][]
 * lives in registers. */
INLINE void block(const float *x, const uint16_t *w, const float *bias, float *y,
                  int n, int k, int j0, const int R, const int NB, const int KU) {
    __m256 acc[4][2][2];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < NB; c++)
            for (int u = 0; u < KU; u++) acc[r][c][u] = _mm256_setzero_ps();
    const uint16_t *wr[2];
    for (int c = 0; c < NB; c++) wr[c] = w + (size_t)(j0 + c) * k;
    const char *pf = (const char *)wr[0] + PF_BYTES;  /* the NB rows are one contiguous run of W */

    int i = 0;
    for (; i + 8 * KU <= k; i += 8 * KU) {
        _mm_prefetch(pf + (size_t)2 * NB * i, _MM_HINT_T0);  /* one line per 64 bytes consumed */
        STEP(i, 0);
        if (KU == 2) STEP(i + 8, KU - 1);
    }
    if (KU == 2 && i + 8 <= k) { STEP(i, 0); i += 8; }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < NB; c++) {
            __m256 a = acc[r][c][0];
            if (KU == 2) a = _mm256_add_ps(a, acc[r][c][KU - 1]);
            float s = hsum(a);
            for (int t = i; t < k; t++)  /* scalar tail: k % 8 columns */
                s += x[(size_t)r * k + t] * bf16_to_f32(wr[c][t]);
            if (bias) s += bias[j0 + c];
            y[(size_t)r * n + j0 + c] = s;
        }
}

/* One group of R rows against weight rows j0 <= j < j1, two at a time. */
INLINE void group(const float *x, const uint16_t *w, const float *bias, float *y,
                  int n, int k, int j0, int j1, const int R, const int KU) {
    int j = j0;
    for (; j + 2 <= j1; j += 2) block(x, w, bias, y, n, k, j, R, 2, KU);
    if (j < j1) block(x, w, bias, y, n, k, j, R, 1, KU);
}

/* Weight rows j0 <= j < j1 of the whole product (all m rows of x). */
static void run_rows(const float *x, const uint16_t *w, const float *bias, float *y, int m, int n, int k,
                     int j0, int j1) {
    int nc = j1 - j0;  /* weight rows per chunk: all of them for a single group */
    if (m > 4) {
        nc = CHUNK_BYTES / (2 * (k > 0 ? k : 1));
        nc = nc < 2 ? 2 : nc & ~1;
    }
    for (int c0 = j0; c0 < j1; c0 += nc) {
        int c1 = j1 - c0 < nc ? j1 : c0 + nc;
        for (int r0 = 0; r0 < m; r0 += 4) {
            const float *xg = x + (size_t)r0 * k;
            float *yg = y + (size_t)r0 * n;
            switch (m - r0 < 4 ? m - r0 : 4) {
            case 1: group(xg, w, bias, yg, n, k, c0, c1, 1, 2); break;
            case 2: group(xg, w, bias, yg, n, k, c0, c1, 2, 2); break;
            case 3: group(xg, w, bias, yg, n, k, c0, c1, 3, 1); break;
            default: group(xg, w, bias, yg, n, k, c0, c1, 4, 1); break;
            }
        }
    }
}

void linear_bf16w(const float *x, const uint16_t *w, const float *bias, float *y, int m, int n, int k) {
    run_rows(x, w, bias, y, m, n, k, 0, n);
}

/* ---- the helper pool ------------------------------------------------------------------------------- */

#define MAX_HELPERS 63
#define PARTS_PER_THREAD 2         /* parts per thread of a job: a late helper's share is small */
#define MIN_PART_BYTES 131072      /* below this much weight per part the split costs more than it saves
                                      (576 x 192 bf16 weights, 221 KB: two threads 0.94x one's time) */

static struct {
    const float *x; const uint16_t *w; const float *bias; float *y;
    int m, n, k;
} job;
/* (generation << 32) | (threads << 24) | (parts << 12) | next unclaimed part: a claim succeeds only on
 * the current job; helper i (1-based) joins only jobs of more than i threads. */
static _Atomic uint64_t claim;
static atomic_int done;            /* parts of the current job finished */
static atomic_int wake_word;       /* the futex word helpers sleep on: the generation's low 32 bits */
static atomic_int sleepers;
static int helpers;                /* helper threads started (never stopped) */
static long spin_ns = 200000;      /* how long a helper spins after a job before it sleeps */
static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;

static long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

static void part_rows(int p, int parts, int n, int *j0, int *j1) {
    /* even boundaries: a part's rows pair up as in the single-threaded walk */
    *j0 = (int)(((long)n * p / parts) & ~1L);
    *j1 = p + 1 == parts ? n : (int)(((long)n * (p + 1) / parts) & ~1L);
}

/* Claim and run parts of job `gen` until none is left. */
static void work(uint32_t gen, int id) {
    uint64_t c = atomic_load(&claim);
    for (;;) {
        int next = (int)(c & 0xfff), parts = (int)((c >> 12) & 0xfff), threads = (int)((c >> 24) & 0xff);
        if ((uint32_t)(c >> 32) != gen || next >= parts || id >= threads) return;
        if (!atomic_compare_exchange_weak(&claim, &c, c + 1)) continue;
        /* the job cannot change before this part is counted done: the caller waits for every part */
        int j0, j1;
        part_rows(next, parts, job.n, &j0, &j1);
        run_rows(job.x, job.w, job.bias, job.y, job.m, job.n, job.k, j0, j1);
        atomic_fetch_add(&done, 1);
        c = atomic_load(&claim);
    }
}

static void *helper_main(void *arg) {
    int id = (int)(intptr_t)arg;
    uint32_t seen = (uint32_t)(atomic_load(&claim) >> 32);
    for (;;) {
        long t0 = now_ns();
        uint32_t gen;
        while ((gen = (uint32_t)(atomic_load(&claim) >> 32)) == seen) {
            for (int i = 0; i < 64; i++) _mm_pause();
            if (now_ns() - t0 > spin_ns) {
                atomic_fetch_add(&sleepers, 1);
                if ((uint32_t)(atomic_load(&claim) >> 32) == seen)
                    syscall(SYS_futex, &wake_word, FUTEX_WAIT_PRIVATE, (int)seen, NULL, NULL, 0);
                atomic_fetch_sub(&sleepers, 1);
                t0 = now_ns();
            }
        }
        seen = gen;
        work(gen, id);
    }
    return NULL;
}

/* Set how long idle helpers spin before they sleep (nanoseconds; 0 = sleep at once). */
void set_spin_ns(long ns) { spin_ns = ns < 0 ? 0 : ns; }

/* Helper threads started so far (for tests and logs). */
int pool_helpers(void) { return helpers; }

/* linear_bf16w on up to `threads` threads (the caller and threads - 1 helpers); same result bits. */
void linear_bf16w_mt(const float *x, const uint16_t *w, const float *bias, float *y, int m, int n, int k,
                     int threads) {
    long bytes = 2L * n * k;
    int parts = threads * PARTS_PER_THREAD;
    if (parts > bytes / MIN_PART_BYTES) parts = (int)(bytes / MIN_PART_BYTES);
    if (parts > n / 2) parts = n / 2;
    if (parts > 0xfff) parts = 0xfff;
    if (threads <= 1 || parts < 2 || pthread_mutex_trylock(&pool_lock) != 0) {
        run_rows(x, w, bias, y, m, n, k, 0, n);  /* (another thread holds the pool: run alone) */
        return;
    }
    if (threads - 1 > MAX_HELPERS) threads = MAX_HELPERS + 1;
    while (helpers < threads - 1) {
        pthread_t t;
        pthread_attr_t a;
        pthread_attr_init(&a);
        pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
        int rc = pthread_create(&t, &a, helper_main, (void *)(intptr_t)(helpers + 1));
        pthread_attr_destroy(&a);
        if (rc != 0) break;  /* fewer helpers: the caller claims the rest */
        helpers++;
    }
    job.x = x; job.w = w; job.bias = bias; job.y = y; job.m = m; job.n = n; job.k = k;
    atomic_store(&done, 0);
    uint32_t gen = (uint32_t)(atomic_load(&claim) >> 32) + 1;
    atomic_store(&claim, ((uint64_t)gen << 32) | ((uint64_t)threads << 24) | ((uint64_t)parts << 12));
    atomic_store(&wake_word, (int)gen);
    if (atomic_load(&sleepers) > 0)
        syscall(SYS_futex, &wake_word, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
    work(gen, 0);
    while (atomic_load(&done) < parts) _mm_pause();
    pthread_mutex_unlock(&pool_lock);
}
