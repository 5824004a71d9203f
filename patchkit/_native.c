/* patchkit's compiled loops (patchkit/native.py builds and calls them). First and
 * largest, pk_copy: a dense copy that saves, counts and measures what it changes while
 * it copies. Further down: pk_merge (the NaN-merge of a sparse write, with its save and
 * statistics), pk_count (its sizing pass), pk_entries (a sparse patch's entries that a
 * merge from its staged tensor writes), pk_sample and pk_scatter (undo a compact save).
 *
 * A report (or transactional=True) needs, for each dense copy_ into runtime storage, the
 * elements whose bits the copy changes and their old values. Done with separate torch
 * ops that is a compare, a count, a nonzero, a gather, a sum of squares and the copy:
 * six passes over the view. This does it in one: each block of the view is read once
 * from the destination and once from the source, and (compact mode) the destination is
 * written only where its bits change.
 *
 * The view is walked in row-major order as rows of L contiguous elements: destination
 * row r starts at element r*drs, source row r at r*srs. One call covers the positions
 * [p, p1) and returns the position it reached:
 *
 * - compact mode (bef_whole == 0): each changed element's storage offset (doff plus its
 *   offset from dst) goes to idx[], its old bits to bef[]. The call stops early, before
 *   a block that could overflow cap entries, and returns where it stopped; nothing at or
 *   after that position has been written or counted.
 * - whole mode (bef_whole == 1): the old bits of every element go to bef[position]; the
 *   call always runs to p1.
 *
 * With stats set it also sums, in double, the squares of the finite old values (b2)
 * and, over changed elements, |new - old| where finite (sum, sum of squares, maximum):
 * old and new are widened to double first, except float16, whose difference is taken
 * in float (as patchkit.inspect does with torch). Non-finite values count as 0. (The
 * bfloat16 compact lane sums b2 in float within each window first: see pk_fast_bf16.)
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    int64_t count;   /* elements whose bits changed */
    int64_t saved;   /* compact mode: entries written to idx/bef so far */
    double b2;       /* sum of squares of the finite old values */
    double sum_abs;  /* sum of finite |new - old| over changed elements */
    double sum_d2;   /* sum of their squares */
    double max_abs;  /* their maximum */
} pk_acc;

/* ---- Parts on several threads --------------------------------------------------------
 * The *_parts entry points below run one call per part of a view, on this thread and up
 * to threads - 1 others (pk_run). Two ways, chosen when the file is compiled:
 *
 * - with OpenMP (-fopenmp, patchkit's first choice): on the OpenMP threads torch runs
 *   its own parallel ops on. torch's Linux wheels bring GNU libgomp (soname
 *   libgomp.so.1), and a library that needs libgomp.so.1 gets the copy already loaded,
 *   so there is one pool of threads in the process. On a machine with few cores that
 *   matters: torch's threads wait for work awake for a while after each op of theirs,
 *   and a second pool's threads then fight them for the cores (measured on 2 vCPUs: two
 *   threads of a second pool did a 16 M-element copy no faster than one). libgomp has
 *   no threads in a child after fork() (a team it starts there never begins), so a
 *   forked child runs its parts on its one thread.
 * - without OpenMP (a compiler without it, PATCHKIT_OPENMP=0): on patchkit's own pool,
 *   described below. */
#ifdef _OPENMP
#include <pthread.h>
#include <stdatomic.h>

static _Atomic int pk_forked; /* this process is a child forked after the library loaded */
static void pk_after_fork(void) { atomic_store(&pk_forked, 1); }
__attribute__((constructor)) static void pk_fork_init(void) {
    pthread_atfork(NULL, NULL, pk_after_fork);
}

typedef void (*pk_task)(void *ctx, int64_t part);

/* fn(ctx, k) for every part k < parts, on this thread and up to threads - 1 OpenMP
 * threads, which take parts in turn from one counter */
static void pk_run(pk_task fn, void *ctx, int64_t parts, int threads) {
    if (parts <= 1 || threads <= 1 || atomic_load(&pk_forked)) {
        for (int64_t k = 0; k < parts; k++) fn(ctx, k);
        return;
    }
    if (threads > parts) threads = (int)parts;
    _Atomic int64_t next = 0;
#pragma omp parallel num_threads(threads)
    {
        int64_t k;
        while ((k = atomic_fetch_add(&next, 1)) < parts) fn(ctx, k);
    }
}

int pk_openmp(void) { return 1; }
#else
/* patchkit's own pool: up to PK_WORKERS C threads (they never touch Python, so they need
 * no GIL); after a job each waits for the next one for PK_SPIN_NS, checking a word in
 * memory, before it sleeps: a load's writes come a few hundred microseconds apart, and
 * waking a sleeping thread costs tens of microseconds on a virtual machine (a Python
 * thread pool costs several hundred per job there). Parts are taken in turn from one
 * counter, the caller taking its share too, so a late worker takes fewer of them and the
 * caller then waits only for parts a worker is doing. A job is a word: generation (32
 * bits), parts (16) and next part (16), changed by compare-and-swap, so a worker still
 * busy with an old job can never take a part of the next one. One job at a time: a
 * caller that finds the pool busy (a second Python thread) runs its parts alone. After
 * fork() the child starts its own workers. */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define PK_RELAX() _mm_pause()
#else
#define PK_RELAX() ((void)0)
#endif

#define PK_WORKERS 7
#define PK_SPIN_NS 200000

typedef void (*pk_task)(void *ctx, int64_t part);

static struct {
    pthread_mutex_t submit; /* held by the caller whose job the workers run */
    pthread_mutex_t mu;     /* with cv: where idle workers sleep */
    pthread_cond_t cv;
    _Atomic uint64_t job;   /* generation << 32 | parts << 16 | next part */
    _Atomic int64_t done;   /* parts finished in this generation */
    _Atomic int sleepers;
    _Atomic int started;    /* workers running */
    pk_task fn;             /* read only by a worker that took a part of this job */
    void *ctx;
    uint32_t generation;
} pk_pool = {.submit = PTHREAD_MUTEX_INITIALIZER, .mu = PTHREAD_MUTEX_INITIALIZER,
             .cv = PTHREAD_COND_INITIALIZER};

static int64_t pk_now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* take and run parts of job generation g until none is left */
static void pk_take(uint32_t g) {
    uint64_t cur = atomic_load(&pk_pool.job);
    for (;;) {
        if ((uint32_t)(cur >> 32) != g || (cur & 0xffff) >= (cur >> 16 & 0xffff)) return;
        if (atomic_compare_exchange_weak(&pk_pool.job, &cur, cur + 1)) {
            pk_pool.fn(pk_pool.ctx, (int64_t)(cur & 0xffff));
            atomic_fetch_add(&pk_pool.done, 1);
            cur = atomic_load(&pk_pool.job);
        }
    }
}

static void *pk_worker(void *arg) {
    (void)arg;
    uint32_t seen = (uint32_t)(atomic_load(&pk_pool.job) >> 32);
    for (;;) {
        uint32_t g = (uint32_t)(atomic_load(&pk_pool.job) >> 32);
        if (g == seen) {
            int64_t until = pk_now_ns() + PK_SPIN_NS;
            int turns = 0;
            while ((g = (uint32_t)(atomic_load(&pk_pool.job) >> 32)) == seen) {
                for (int q = 0; q < 32; q++) PK_RELAX();
                if (++turns % 64 == 0) sched_yield(); /* let a thread that needs the CPU run */
                if (pk_now_ns() < until) continue;
                pthread_mutex_lock(&pk_pool.mu);
                atomic_fetch_add(&pk_pool.sleepers, 1);
                while ((uint32_t)(atomic_load(&pk_pool.job) >> 32) == seen)
                    pthread_cond_wait(&pk_pool.cv, &pk_pool.mu);
                atomic_fetch_sub(&pk_pool.sleepers, 1);
                pthread_mutex_unlock(&pk_pool.mu);
                until = pk_now_ns() + PK_SPIN_NS;
            }
        }
        seen = g;
        pk_take(g);
    }
    return NULL;
}

static void pk_after_fork(void) {
    /* the child has this thread only: no workers, nothing locked */
    pthread_mutex_init(&pk_pool.submit, NULL);
    pthread_mutex_init(&pk_pool.mu, NULL);
    pthread_cond_init(&pk_pool.cv, NULL);
    atomic_store(&pk_pool.sleepers, 0);
    atomic_store(&pk_pool.started, 0);
}

static pthread_once_t pk_fork_once = PTHREAD_ONCE_INIT;
static void pk_fork_init(void) { pthread_atfork(NULL, NULL, pk_after_fork); }

/* fn(ctx, k) for every part k < parts, on this thread and up to threads - 1 workers */
static void pk_run(pk_task fn, void *ctx, int64_t parts, int threads) {
    if (threads > PK_WORKERS + 1) threads = PK_WORKERS + 1;
    if (parts <= 1 || threads <= 1 || parts > 0xffff ||
        pthread_mutex_trylock(&pk_pool.submit) != 0) {
        for (int64_t k = 0; k < parts; k++) fn(ctx, k);
        return;
    }
    pthread_once(&pk_fork_once, pk_fork_init);
    while (atomic_load(&pk_pool.started) < threads - 1) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int failed = pthread_create(&t, &attr, pk_worker, NULL);
        pthread_attr_destroy(&attr);
        if (failed) break; /* fewer workers: this thread takes more parts */
        atomic_fetch_add(&pk_pool.started, 1);
    }
    pk_pool.fn = fn;
    pk_pool.ctx = ctx;
    uint32_t g = ++pk_pool.generation;
    atomic_store(&pk_pool.done, 0);
    atomic_store(&pk_pool.job, (uint64_t)g << 32 | (uint64_t)parts << 16);
    if (atomic_load(&pk_pool.sleepers)) {
        pthread_mutex_lock(&pk_pool.mu);
        pthread_cond_broadcast(&pk_pool.cv);
        pthread_mutex_unlock(&pk_pool.mu);
    }
    pk_take(g);
    while (atomic_load(&pk_pool.done) < parts) PK_RELAX();
    pthread_mutex_unlock(&pk_pool.submit);
}

int pk_openmp(void) { return 0; }
#endif

#define PK_B 16    /* elements per block: compared together, copied together */

/* Bytes ahead (of each stream) that the compact windows ask the cache for: the loop alone
 * keeps too few loads in flight to stream from memory at full speed. 4 KiB: 2048
 * bfloat16 or 1024 float32 elements. (It was 1024 elements of any dtype, 2 KiB of
 * bfloat16, which kept too few lines in flight: 1.2 % of 16 M bfloat16 elements changed,
 * from memory, one thread, 2.20-2.28 -> 1.90-2.08 ms, and 1024 rows of 1408 bfloat16
 * 2816 apart 353-397 -> 312-324 us; float32 at 8 KiB was 5-10 % slower than at 4.
 * Separate processes, old and new in turn.) Ahead in the walk of the view
 * row by row, not in memory: for rows apart (a column slice of a fused weight, a
 * tensor-parallel shard of a checkpoint tensor) the bytes past a row are another view's,
 * and hints there were wasted while the next row came in cold (1024 rows of 1408
 * bfloat16, 2816 apart, from memory, one thread: 1.7x a torch copy_ -> 1.1-1.3x). The
 * cursor below moves along the walk 32 positions a group; an address past the view is
 * only a hint, which never faults. */
#define PK_AHEAD_BYTES 4096
typedef struct {
    uintptr_t d, s;       /* the element's addresses in dst and src */
    int64_t col, L;       /* its column, the row length */
    uintptr_t dgap, sgap; /* bytes from the end of a row to the start of the next */
} pk_ahead;

/* the cursor PK_AHEAD_BYTES / size positions past position p */
static inline pk_ahead pk_ahead_at(const void *dst, const void *src, int64_t L, int64_t drs,
                                   int64_t srs, int64_t p, size_t size) {
    int64_t q = p + (int64_t)(PK_AHEAD_BYTES / size), row = q / L, col = q % L;
    pk_ahead a = {(uintptr_t)dst + (uintptr_t)(row * drs + col) * size,
                  (uintptr_t)src + (uintptr_t)(row * srs + col) * size, col, L,
                  (uintptr_t)(drs - L) * size, (uintptr_t)(srs - L) * size};
    return a;
}

/* the cursor n positions on */
static inline void pk_ahead_step(pk_ahead *a, int64_t n, size_t size) {
    a->d += (uintptr_t)n * size;
    a->s += (uintptr_t)n * size;
    for (a->col += n; a->col >= a->L; a->col -= a->L) {
        a->d += a->dgap;
        a->s += a->sgap;
    }
}
#define PK_DBL_MAX 1.7976931348623157e308
#define PK_K 4096  /* elements per run: the finite check of b2 works a run at a time */

static inline double pk_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline double pk_f64(uint64_t u) { double f; memcpy(&f, &u, 8); return f; }
static inline double pk_bf16(uint16_t h) { return pk_f32((uint32_t)h << 16); }
static inline float pk_half(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu, u;
    float f;
    if (e == 0) { /* zero or subnormal: m * 2^-24 is exact in float */
        f = (float)m * 5.9604644775390625e-8f;
        return sign ? -f : f;
    }
    u = e == 31 ? (sign | 0x7f800000u | (m << 13)) : (sign | ((e + 112u) << 23) | (m << 13));
    memcpy(&f, &u, 4);
    return f;
}
static inline double pk_f16(uint16_t h) { return pk_half(h); }

#define PK_DIFF_WIDE(TOD, a, b) (TOD(b) - TOD(a))
#define PK_DIFF_F16(TOD, a, b) ((double)(pk_half(b) - pk_half(a)))

static inline void pk_stat(pk_acc *acc, double d) {
    d = fabs(d);
    if (d <= PK_DBL_MAX) { /* finite */
        acc->sum_abs += d;
        acc->sum_d2 += d * d;
        if (d > acc->max_abs) acc->max_abs = d;
    }
}

/* One element of a whole-mode run (pk_whole below): its old bits to w, the count and
 * statistics into lane l, its new bits to d. Branch-free, so a block vectorizes. */
#define PK_WHOLE_STEP(UT, TOD, DIFF)                                                         \
    do {                                                                                     \
        UT x0 = d[j + l], x1 = s[j + l];                                                     \
        w[j + l] = x0;                                                                       \
        ne[l] += x0 != x1;                                                                   \
        if (stats) {                                                                         \
            double a = TOD(x0), df = fabs(DIFF(TOD, x0, x1));                                \
            df = df <= PK_DBL_MAX ? df : 0.0;                                                \
            sq[l] += a * a;                                                                  \
            sa[l] += df;                                                                     \
            sd[l] += df * df;                                                                \
            mx[l] = mx[l] > df ? mx[l] : df;                                                 \
        }                                                                                    \
        d[j + l] = x1;                                                                       \
    } while (0)

/* Compact mode's fast lane (x86 with AVX2 and FMA, as -march=native builds have there).
 * A window of up to PK_W elements is done in two steps. First, groups of 32 elements are
 * compared with vector instructions into a 32-bit mask of the changed lanes, the squares
 * of the old values summed four doubles at a time, and the changed positions appended
 * to a list without a branch (a table gives the set bits of each byte of the mask).
 * Then the list is walked: save, measure and copy each changed element. (Visiting the
 * mask's bits group by group costs a mispredicted branch or two per group with a change,
 * most of the time on a 2 % change.) pk_fast_NAME does whole windows from the start of a
 * run and returns how many elements it did (a multiple of 32): it stops before the first
 * window whose changes would not fit in cap entries, and leaves the rest of the run (and
 * the finite check of the squares) to the portable loop in pk_compact_NAME. Other
 * machines and dtypes do no elements here.
 *
 * The list of a window is built from its masks' nonzero bytes only: a window of a few
 * changes costs a table look-up for each such byte, not four for every group. What a
 * window costs beyond its elements is about two mispredicted branches (the ends of the
 * loop over those bytes and of the walk), so a window is 1024 elements: at 512, a 1-2 %
 * change spent a third of its time on them (single-thread A/B on 1 M elements in cache:
 * bfloat16 at 2 %, 120 -> 87 us; float32 alike); at 2048, a 10 % change streaming from
 * memory got slower, its walk too long for the prefetches ahead. The bfloat16 lane
 * squares its old values in float (exact: 8-bit significands) and sums them in float
 * over 16 groups (16 terms a lane: at most 1e-6 relative error), then in double;
 * pk_compact_bf16 sums a run again in double when float could not hold its squares
 * (PK_TINY_bf16, and the finite check). */
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#define PK_W 1024          /* elements per window */
#define PK_WG (PK_W / 32) /* its groups (a multiple of 16) */
/* b2 of a run below this is summed again in double (pk_b2), and the statistics of a whole
 * run whose squared differences sum below it measured again in double: the bfloat16 lanes
 * square in float, where squares of values below about 1e-19 lose bits or vanish. (A run
 * whose values are all +-0 is not summed again.) */
#define PK_TINY_bf16 0x1p-100

/* add x*x, for the eight floats of x, to the two accumulators */
#define PK_SQ8(x, a, b)                                                                      \
    do {                                                                                     \
        __m256d e_ = _mm256_cvtps_pd(_mm256_castps256_ps128(x));                             \
        a = _mm256_fmadd_pd(e_, e_, a);                                                      \
        e_ = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));                                   \
        b = _mm256_fmadd_pd(e_, e_, b);                                                      \
    } while (0)

/* add the eight floats of x to the two accumulators */
#define PK_ADD8(x, a, b)                                                                     \
    do {                                                                                     \
        a = _mm256_add_pd(a, _mm256_cvtps_pd(_mm256_castps256_ps128(x)));                    \
        b = _mm256_add_pd(b, _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1)));                  \
    } while (0)

static int32_t pk_bit_list[256][8]; /* the set bits of each byte, lowest first */

__attribute__((constructor)) static void pk_bit_list_init(void) {
    for (int byte = 0; byte < 256; byte++) {
        int c = 0;
        for (int l = 0; l < 8; l++)
            if (byte >> l & 1) pk_bit_list[byte][c++] = l;
    }
}

static inline __m256i pk_load(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* append base + l for every set bit l of byte to list[cnt...]; the new count. Writes up
 * to 8 entries past it (the list has room). */
static inline int pk_append8(int32_t *list, int cnt, uint32_t byte, int32_t base) {
    _mm256_storeu_si256((__m256i *)(list + cnt),
                        _mm256_add_epi32(pk_load(pk_bit_list[byte]), _mm256_set1_epi32(base)));
    return cnt + __builtin_popcount(byte);
}

/* The positions of the set bits of a window's masks (mask g covers elements 32g..32g+31;
 * PK_WG masks, those past the window zero) to list[0...]; their number. The masks'
 * nonzero bytes are listed first (two compares of each 64 bytes, in loops of a fixed
 * length), so a window with a few changes spends a table look-up on each of those bytes
 * and on nothing else, in one loop of a varying length. */
static inline int pk_window_list(int32_t *list, const uint32_t masks[PK_WG]) {
    const uint8_t *b = (const uint8_t *)masks;
    const __m256i zero = _mm256_setzero_si256();
    int32_t bytes[4 * PK_WG + 8];
    int nb = 0, cnt = 0;
    for (int h = 0; h < 4 * PK_WG; h += 64) {
        uint64_t nz = ~(uint64_t)(
            (uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(pk_load(b + h), zero)) |
            (uint64_t)(uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(pk_load(b + h + 32), zero))
                << 32);
        for (int q = 0; q < 8; q++) nb = pk_append8(bytes, nb, nz >> (8 * q) & 255, h + 8 * q);
    }
    for (int t = 0; t < nb; t++) cnt = pk_append8(list, cnt, b[bytes[t]], 8 * bytes[t]);
    return cnt;
}

/* bit l set where 32-bit lane l of x equals the l-th element at s */
static inline uint32_t pk_eq8(__m256i x, const uint32_t *s) {
    return (uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(x, pk_load(s))));
}

static inline double pk_hsum(__m256d a, __m256d b, __m256d c, __m256d e) {
    double q[4];
    _mm256_storeu_pd(q, _mm256_add_pd(_mm256_add_pd(a, b), _mm256_add_pd(c, e)));
    return (q[0] + q[1]) + (q[2] + q[3]);
}

/* |new - old| of four pairs of doubles where finite (else 0; unchanged lanes add 0), into
 * the sums and the maximum */
static inline void pk_vdiff(__m256d *sa, __m256d *sd, __m256d *mx, __m256d o, __m256d x) {
    const __m256d mag = _mm256_castsi256_pd(_mm256_set1_epi64x(0x7fffffffffffffffll));
    __m256d e = _mm256_and_pd(_mm256_sub_pd(x, o), mag);
    e = _mm256_and_pd(e, _mm256_cmp_pd(e, _mm256_set1_pd(PK_DBL_MAX), _CMP_LE_OQ));
    *sa = _mm256_add_pd(*sa, e);
    *sd = _mm256_fmadd_pd(e, e, *sd);
    *mx = _mm256_max_pd(*mx, e);
}
/* eight elements as floats (exact for both) */
#define PK_PS8_f32(p) _mm256_loadu_ps((const float *)(p))
#define PK_PS8_bf16(p) _mm256_castsi256_ps(_mm256_slli_epi32(                                 \
    _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))

/* The driver of both dtypes: GROUP(j) sets m (the changed lanes of elements j..j+31) and,
 * with stats, adds their old values' squares to w0..w3. The walk of a window's changes
 * saves and copies them and puts their new values in a row (nw), beside the old ones in
 * bef; their statistics are then taken eight at a time in double, as pk_stat takes them
 * one at a time (which does the last few): no branch per element, and a 10 % change
 * costs a quarter less (float32, 1 M elements: 410 -> 300 us). */
#define PK_FAST_WINDOWS(UT, TOD, GROUP, PS8)                                                 \
    __m256d a0 = _mm256_setzero_pd(), a1 = a0, a2 = a0, a3 = a0;                             \
    pk_acc st = {0}; /* the changed elements' statistics, in registers until the end */      \
    __m256d sa0 = a0, sa1 = a0, sd0 = a0, sd1 = a0, mx0 = a0, mx1 = a0;                      \
    int32_t list[PK_W + 8];                                                                  \
    UT nw[PK_W]; /* a window's new values of its changed elements, in order */               \
    int64_t j = 0, k = *c;                                                                   \
    while (j + 32 <= n) {                                                                    \
        int64_t start = j, end = n - j > PK_W ? j + PK_W : n;                                \
        __m256d w0 = _mm256_setzero_pd(), w1 = w0, w2 = w0, w3 = w0;                         \
        __m256 v0 = _mm256_setzero_ps(), v1 = v0, v2 = v0, v3 = v0; /* float squares (bf16) */ \
        uint32_t masks[PK_WG] = {0};                                                         \
        for (int g = 0; j + 32 <= end; j += 32, g++) {                                       \
            uint32_t m;                                                                      \
            _mm_prefetch((const char *)ahead.d, _MM_HINT_T0);                                \
            _mm_prefetch((const char *)ahead.s, _MM_HINT_T0);                                \
            if (sizeof(UT) > 2) { /* (32 float32: two cache lines of each stream) */         \
                _mm_prefetch((const char *)ahead.d + 64, _MM_HINT_T0);                       \
                _mm_prefetch((const char *)ahead.s + 64, _MM_HINT_T0);                       \
            }                                                                                \
            pk_ahead_step(&ahead, 32, sizeof(UT));                                           \
            GROUP(j);                                                                        \
            masks[g] = m;                                                                    \
            if ((g & 15) == 15) { /* (bfloat16: 16 terms a float lane) */                    \
                PK_ADD8(_mm256_add_ps(v0, v1), w0, w1);                                      \
                PK_ADD8(_mm256_add_ps(v2, v3), w2, w3);                                      \
                v0 = v1 = v2 = v3 = _mm256_setzero_ps();                                     \
            }                                                                                \
        }                                                                                    \
        int cnt = pk_window_list(list, masks);                                               \
        if (k + cnt > cap) { /* the portable loop finds where the room ends */               \
            j = start;                                                                       \
            break;                                                                           \
        }                                                                                    \
        PK_ADD8(_mm256_add_ps(v0, v1), w0, w1);                                              \
        PK_ADD8(_mm256_add_ps(v2, v3), w2, w3);                                              \
        a0 = _mm256_add_pd(a0, w0);                                                          \
        a1 = _mm256_add_pd(a1, w1);                                                          \
        a2 = _mm256_add_pd(a2, w2);                                                          \
        a3 = _mm256_add_pd(a3, w3);                                                          \
        for (int q = 0; q < cnt; q++) {                                                      \
            int64_t at = start + list[q];                                                    \
            UT x0 = d[at], x1 = s[at];                                                       \
            idx[k + q] = o + at;                                                             \
            bef[k + q] = x0;                                                                 \
            nw[q] = x1;                                                                      \
            d[at] = x1;                                                                      \
        }                                                                                    \
        if (stats && cnt) {                                                                  \
            UT *ow = bef + k;                                                                \
            int q = 0;                                                                       \
            for (; q + 8 <= cnt; q += 8) {                                                   \
                __m256 po = PS8(ow + q), px = PS8(nw + q);                                   \
                pk_vdiff(&sa0, &sd0, &mx0, _mm256_cvtps_pd(_mm256_castps256_ps128(po)),      \
                         _mm256_cvtps_pd(_mm256_castps256_ps128(px)));                       \
                pk_vdiff(&sa1, &sd1, &mx1, _mm256_cvtps_pd(_mm256_extractf128_ps(po, 1)),    \
                         _mm256_cvtps_pd(_mm256_extractf128_ps(px, 1)));                     \
            }                                                                                \
            for (; q < cnt; q++) pk_stat(&st, TOD(nw[q]) - TOD(ow[q]));                      \
        }                                                                                    \
        k += cnt;                                                                            \
    }                                                                                        \
    if (stats) {                                                                             \
        double m4[4];                                                                        \
        *b2 += pk_hsum(a0, a1, a2, a3);                                                      \
        _mm256_storeu_pd(m4, _mm256_max_pd(mx0, mx1));                                       \
        for (int l = 0; l < 4; l++)                                                          \
            if (m4[l] > st.max_abs) st.max_abs = m4[l];                                      \
        const __m256d z = _mm256_setzero_pd();                                               \
        diffs->sum_abs += st.sum_abs + pk_hsum(sa0, sa1, z, z);                              \
        diffs->sum_d2 += st.sum_d2 + pk_hsum(sd0, sd1, z, z);                                \
        if (st.max_abs > diffs->max_abs) diffs->max_abs = st.max_abs;                        \
    }                                                                                        \
    *c = k;                                                                                  \
    return j;

#define PK_GROUP_F32(j)                                                                      \
    do {                                                                                     \
        __m256i d0 = pk_load(d + j), d1 = pk_load(d + j + 8), d2 = pk_load(d + j + 16),      \
                d3 = pk_load(d + j + 24);                                                    \
        m = ~(pk_eq8(d0, s + j) | pk_eq8(d1, s + j + 8) << 8 | pk_eq8(d2, s + j + 16) << 16 | \
              pk_eq8(d3, s + j + 24) << 24);                                                 \
        if (stats) {                                                                         \
            PK_SQ8(_mm256_castsi256_ps(d0), w0, w1);                                         \
            PK_SQ8(_mm256_castsi256_ps(d1), w2, w3);                                         \
            PK_SQ8(_mm256_castsi256_ps(d2), w0, w1);                                         \
            PK_SQ8(_mm256_castsi256_ps(d3), w2, w3);                                         \
        }                                                                                    \
    } while (0)

/* two masks of 16-bit lanes, packed to bytes (in 64-bit quarters 0 2 1 3, hence the
 * permute); bf16 bits shifted up 16 are the float of the same value */
#define PK_GROUP_BF16(j)                                                                     \
    do {                                                                                     \
        __m256i d0 = pk_load(d + j), d1 = pk_load(d + j + 16), z = _mm256_setzero_si256();   \
        __m256i eq = _mm256_packs_epi16(_mm256_cmpeq_epi16(d0, pk_load(s + j)),              \
                                        _mm256_cmpeq_epi16(d1, pk_load(s + j + 16)));        \
        m = ~(uint32_t)_mm256_movemask_epi8(_mm256_permute4x64_epi64(eq, 0xD8));             \
        if (stats) {                                                                         \
            __m256 x0 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, d0)),                   \
                   x1 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, d0)),                   \
                   x2 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, d1)),                   \
                   x3 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, d1));                   \
            v0 = _mm256_fmadd_ps(x0, x0, v0);                                                \
            v1 = _mm256_fmadd_ps(x1, x1, v1);                                                \
            v2 = _mm256_fmadd_ps(x2, x2, v2);                                                \
            v3 = _mm256_fmadd_ps(x3, x3, v3);                                                \
        }                                                                                    \
    } while (0)

static inline int64_t pk_fast_f32(uint32_t *restrict d, const uint32_t *restrict s, int64_t n,
                                  int64_t o, int64_t *restrict idx, uint32_t *restrict bef,
                                  int64_t *c, int64_t cap, int stats, double *b2,
                                  pk_acc *diffs, pk_ahead ahead) {
    PK_FAST_WINDOWS(uint32_t, pk_f32, PK_GROUP_F32, PK_PS8_f32)
}

static inline int64_t pk_fast_bf16(uint16_t *restrict d, const uint16_t *restrict s, int64_t n,
                                   int64_t o, int64_t *restrict idx, uint16_t *restrict bef,
                                   int64_t *c, int64_t cap, int stats, double *b2,
                                   pk_acc *diffs, pk_ahead ahead) {
    PK_FAST_WINDOWS(uint16_t, pk_bf16, PK_GROUP_BF16, PK_PS8_bf16)
}

/* Whole mode's fast lane: 32 bytes of elements at a time, the old bits streamed to w
 * (past the cache, when w is 32-byte aligned: nothing reads the save soon), the count of
 * equal lanes kept in vector lanes, and the statistics four doubles at a time. Returns
 * how many elements it did (whole vectors from the start of the run); the portable loop
 * in pk_whole_NAME does the rest, and the finite check of the squares. */
typedef struct {
    __m256d q0, q1, sa0, sa1, sd0, sd1, mx0, mx1;
} pk_vacc;

/* old and new values as doubles (four lanes): the statistics of one pair of vectors */
static inline void pk_vstat(pk_vacc *v, __m256d o0, __m256d o1, __m256d n0, __m256d n1) {
    const __m256d mag = _mm256_castsi256_pd(_mm256_set1_epi64x(0x7fffffffffffffffll));
    const __m256d big = _mm256_set1_pd(PK_DBL_MAX);
    v->q0 = _mm256_fmadd_pd(o0, o0, v->q0);
    v->q1 = _mm256_fmadd_pd(o1, o1, v->q1);
    __m256d e0 = _mm256_and_pd(_mm256_sub_pd(n0, o0), mag);
    __m256d e1 = _mm256_and_pd(_mm256_sub_pd(n1, o1), mag);
    e0 = _mm256_and_pd(e0, _mm256_cmp_pd(e0, big, _CMP_LE_OQ)); /* not finite: 0 */
    e1 = _mm256_and_pd(e1, _mm256_cmp_pd(e1, big, _CMP_LE_OQ));
    v->sa0 = _mm256_add_pd(v->sa0, e0);
    v->sa1 = _mm256_add_pd(v->sa1, e1);
    v->sd0 = _mm256_fmadd_pd(e0, e0, v->sd0);
    v->sd1 = _mm256_fmadd_pd(e1, e1, v->sd1);
    v->mx0 = _mm256_max_pd(v->mx0, e0);
    v->mx1 = _mm256_max_pd(v->mx1, e1);
}

static inline void pk_vstat_ps(pk_vacc *v, __m256 o, __m256 x) {
    pk_vstat(v, _mm256_cvtps_pd(_mm256_castps256_ps128(o)),
             _mm256_cvtps_pd(_mm256_extractf128_ps(o, 1)),
             _mm256_cvtps_pd(_mm256_castps256_ps128(x)),
             _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1)));
}

static inline void pk_vdone(const pk_vacc *v, __m256i eq, int64_t done,
                            int64_t *count, double *b2, pk_acc *diffs) {
    int32_t e[8];
    double m[4];
    _mm256_storeu_si256((__m256i *)e, eq);
    int64_t same = 0;
    for (int l = 0; l < 8; l++) same += e[l];
    *count += done - same;
    *b2 += pk_hsum(v->q0, v->q1, _mm256_setzero_pd(), _mm256_setzero_pd());
    diffs->sum_abs += pk_hsum(v->sa0, v->sa1, _mm256_setzero_pd(), _mm256_setzero_pd());
    diffs->sum_d2 += pk_hsum(v->sd0, v->sd1, _mm256_setzero_pd(), _mm256_setzero_pd());
    _mm256_storeu_pd(m, _mm256_max_pd(v->mx0, v->mx1));
    for (int l = 0; l < 4; l++)
        if (m[l] > diffs->max_abs) diffs->max_abs = m[l];
}

static inline __attribute__((always_inline)) int64_t pk_fastw_f32_(
    uint32_t *restrict d, const uint32_t *restrict s, int64_t n, uint32_t *restrict w,
    const int stats, const int stream, int64_t *count, double *b2, pk_acc *diffs) {
    pk_vacc v = {0};
    __m256i eq = _mm256_setzero_si256(); /* minus the equal lanes, per lane */
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        __m256i x0 = pk_load(d + j), x1 = pk_load(s + j);
        if (stream) _mm256_stream_si256((__m256i *)(w + j), x0);
        else _mm256_storeu_si256((__m256i *)(w + j), x0);
        _mm256_storeu_si256((__m256i *)(d + j), x1);
        eq = _mm256_sub_epi32(eq, _mm256_cmpeq_epi32(x0, x1));
        if (stats) pk_vstat_ps(&v, _mm256_castsi256_ps(x0), _mm256_castsi256_ps(x1));
    }
    pk_vdone(&v, eq, j, count, b2, diffs);
    return j;
}

/* The bfloat16 whole lane measures in float: old and new values widen to float exactly,
 * their squares and differences (exponents at most 16 apart, nearly every pair) are
 * exact or rounded once, and each float lane sums 16 terms (8 steps) before the sums go
 * to double: at most 1e-6 relative error, where double costs twice the instructions and
 * is the lane's bottleneck. Values of 2^60 or more (or not finite), whose squares or
 * sums float could not hold, send the run's numbers to double, read again from the save
 * and the source; so do differences too small for float's squares (PK_TINY_bf16), and
 * pk_whole_bf16 checks the squares of the old values the same way. */
static inline void pk_fstat(__m256 *q, __m256 *sa, __m256 *sd, __m256 *mx, __m256 o, __m256 x) {
    const __m256 mag = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 e = _mm256_and_ps(_mm256_sub_ps(x, o), mag);
    *q = _mm256_fmadd_ps(o, o, *q);
    *sa = _mm256_add_ps(*sa, e);
    *sd = _mm256_fmadd_ps(e, e, *sd);
    *mx = _mm256_max_ps(*mx, e);
}

/* add the float sums to the double ones and clear them */
static inline void pk_fflush(pk_vacc *v, __m256 *q, __m256 *sa, __m256 *sd) {
    PK_ADD8(*q, v->q0, v->q1);
    PK_ADD8(*sa, v->sa0, v->sa1);
    PK_ADD8(*sd, v->sd0, v->sd1);
    *q = *sa = *sd = _mm256_setzero_ps();
}

static inline __attribute__((always_inline)) int64_t pk_fastw_bf16_(
    uint16_t *restrict d, const uint16_t *restrict s, int64_t n, uint16_t *restrict w,
    const int stats, const int stream, int64_t *count, double *b2, pk_acc *diffs) {
    pk_vacc v = {0};
    const __m256i zero = _mm256_setzero_si256(), mag = _mm256_set1_epi16(0x7fff),
                  big = _mm256_set1_epi16(0x5d7f); /* the bits of the bfloat16 below 2^60 */
    __m256i eq = zero;   /* minus the equal lanes, per pair of 16-bit lanes */
    __m256i huge = zero; /* lanes where an old or new value was 2^60 or more */
    __m256 q = _mm256_setzero_ps(), sa = q, sd = q, mx = q;
    int64_t j = 0;
    int steps = 0;
    for (; j + 16 <= n; j += 16) {
        __m256i x0 = pk_load(d + j), x1 = pk_load(s + j);
        if (stream) _mm256_stream_si256((__m256i *)(w + j), x0);
        else _mm256_storeu_si256((__m256i *)(w + j), x0);
        _mm256_storeu_si256((__m256i *)(d + j), x1);
        /* each equal 16-bit lane adds 1 to the 32-bit lane that holds it */
        eq = _mm256_add_epi32(eq, _mm256_madd_epi16(_mm256_cmpeq_epi16(x0, x1),
                                                    _mm256_set1_epi16(-1)));
        if (stats) {
            __m256i m = _mm256_max_epu16(_mm256_and_si256(x0, mag), _mm256_and_si256(x1, mag));
            huge = _mm256_or_si256(huge, _mm256_cmpgt_epi16(m, big));
            pk_fstat(&q, &sa, &sd, &mx, _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, x0)),
                     _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, x1)));
            pk_fstat(&q, &sa, &sd, &mx, _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, x0)),
                     _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, x1)));
            if (++steps == 8) {
                pk_fflush(&v, &q, &sa, &sd);
                steps = 0;
            }
        }
    }
    if (stats) {
        pk_fflush(&v, &q, &sa, &sd);
        v.mx0 = _mm256_cvtps_pd(_mm256_castps256_ps128(mx));
        v.mx1 = _mm256_cvtps_pd(_mm256_extractf128_ps(mx, 1));
        double sd_run = pk_hsum(v.sd0, v.sd1, _mm256_setzero_pd(), _mm256_setzero_pd());
        if (!_mm256_testz_si256(huge, huge) ||
            (sd_run < PK_TINY_bf16 &&
             pk_hsum(v.sa0, v.sa1, _mm256_setzero_pd(), _mm256_setzero_pd()) > 0)) {
            /* again in double, old values from the save, new ones from the source */
            pk_vacc dv = {0};
            for (int64_t k = 0; k + 16 <= j; k += 16) {
                __m256i o = pk_load(w + k), x = pk_load(s + k);
                pk_vstat_ps(&dv, _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, o)),
                            _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, x)));
                pk_vstat_ps(&dv, _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, o)),
                            _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, x)));
            }
            v = dv;
        }
    }
    pk_vdone(&v, eq, j, count, b2, diffs);
    return j;
}

#define PK_FASTW(NAME)                                                                       \
    static inline int64_t pk_fastw_##NAME(void *d, const void *s, int64_t n, void *w,        \
                                          int stats, int64_t *count, double *b2,             \
                                          pk_acc *diffs) {                                   \
        int stream = ((uintptr_t)w & 31) == 0;                                               \
        if (stats)                                                                           \
            return stream ? pk_fastw_##NAME##_(d, s, n, w, 1, 1, count, b2, diffs)           \
                          : pk_fastw_##NAME##_(d, s, n, w, 1, 0, count, b2, diffs);          \
        return stream ? pk_fastw_##NAME##_(d, s, n, w, 0, 1, count, b2, diffs)               \
                      : pk_fastw_##NAME##_(d, s, n, w, 0, 0, count, b2, diffs);              \
    }
PK_FASTW(f32)
PK_FASTW(bf16)
#define PK_FASTW_f32 pk_fastw_f32
#define PK_FASTW_bf16 pk_fastw_bf16
#define PK_SFENCE() _mm_sfence() /* the streamed saves are in memory before the call returns */
#define PK_FAST_f32 pk_fast_f32
#define PK_FAST_bf16 pk_fast_bf16
#endif

#ifndef PK_FAST_f32
#define PK_FAST_f32(...) 0
#endif
#ifndef PK_FAST_bf16
#define PK_FAST_bf16(...) 0
#endif
#define PK_FAST_f64(...) 0
#ifndef PK_TINY_bf16
#define PK_TINY_bf16 0.0 /* the portable loops sum in double */
#endif
#define PK_TINY_f32 0.0
#define PK_TINY_f64 0.0
#define PK_TINY_f16 0.0
#define PK_FAST_f16(...) 0
#ifndef PK_FASTW_f32
#define PK_FASTW_f32(...) 0
#endif
#ifndef PK_FASTW_bf16
#define PK_FASTW_bf16(...) 0
#endif
#define PK_FASTW_f64(...) 0
#ifndef PK_SFENCE
#define PK_SFENCE() ((void)0)
#endif
#define PK_FASTW_f16(...) 0

#define PK_DEFINE(NAME, UT, TOD, DIFF)                                                       \
    /* b2 of [0, n) of one run, each old value taken from bef where the element changed */   \
    static double pk_b2_##NAME(const UT *d, int64_t o, int64_t n, const int64_t *idx,        \
                               const UT *bef, int64_t k, int64_t k1, const UT *whole) {      \
        double t = 0;                                                                        \
        for (int64_t q = 0; q < n; q++) {                                                    \
            UT v;                                                                            \
            if (whole) v = whole[q];                                                         \
            else if (k < k1 && idx[k] == o + q) v = bef[k++];                                \
            else v = d[q];                                                                   \
            double x = TOD(v);                                                               \
            if (fabs(x) <= PK_DBL_MAX) t += x * x;                                           \
        }                                                                                    \
        return t;                                                                            \
    }                                                                                        \
    /* true when a value at d[0, n) or bef[0, m) is not +-0 */                               \
    static int pk_any_##NAME(const UT *d, int64_t n, const UT *bef, int64_t m) {             \
        const UT mag = (UT)~((UT)1 << (8 * sizeof(UT) - 1));                                 \
        UT any = 0;                                                                          \
        for (int64_t q = 0; q < n; q++) any |= d[q] & mag;                                   \
        for (int64_t q = 0; q < m; q++) any |= bef[q] & mag;                                 \
        return any != 0;                                                                     \
    }                                                                                        \
    /* Compact mode, the m elements at d: save and copy the changed ones. */                 \
    static __attribute__((noinline)) int64_t pk_changed_##NAME(                              \
        UT *restrict d, const UT *restrict s, int m, int64_t o, int64_t *restrict idx,       \
        UT *restrict bef, int64_t c, int stats, pk_acc *diffs) {                             \
        uint32_t mask = 0;                                                                   \
        for (int l = 0; l < m; l++) mask |= (uint32_t)(d[l] != s[l]) << l;                   \
        while (mask) {                                                                       \
            int l = __builtin_ctz(mask);                                                     \
            mask &= mask - 1;                                                                \
            UT x0 = d[l], x1 = s[l];                                                         \
            idx[c] = o + l;                                                                  \
            bef[c] = x0;                                                                     \
            c++;                                                                             \
            if (stats) pk_stat(diffs, DIFF(TOD, x0, x1));                                    \
            d[l] = x1;                                                                       \
        }                                                                                    \
        return c;                                                                            \
    }                                                                                        \
    /* Compact mode, one run of n elements: returns how many it did (n unless full). */      \
    static inline __attribute__((always_inline)) int64_t pk_compact_##NAME(                  \
        UT *restrict d, const UT *restrict s, int64_t n, int64_t o, int64_t *restrict idx,   \
        UT *restrict bef, int64_t *c, int64_t cap, const int stats, double *b2,              \
        pk_acc *diffs, pk_ahead ahead) {                                         \
        (void)ahead; /* (only the fast lanes prefetch) */                                    \
        double sq[PK_B] = {0}, fast = 0;                                                     \
        int64_t k = *c;                                                                      \
        int64_t j = PK_FAST_##NAME(d, s, n, o, idx, bef, &k, cap, stats, &fast, diffs, ahead); \
        for (; j < n; j += PK_B) {                                                           \
            int m = n - j < PK_B ? (int)(n - j) : PK_B;                                      \
            UT any = 0;                                                                      \
            if (m == PK_B) {                                                                 \
                for (int l = 0; l < PK_B; l++) any |= d[j + l] ^ s[j + l];                   \
            } else {                                                                         \
                for (int l = 0; l < m; l++) any |= d[j + l] ^ s[j + l];                      \
            }                                                                                \
            if (any && k + m > cap) { /* room for this block's changes? */                   \
                int ch = 0;                                                                  \
                for (int l = 0; l < m; l++) ch += d[j + l] != s[j + l];                      \
                if (k + ch > cap) break;                                                     \
            }                                                                                \
            if (stats) {                                                                     \
                if (m == PK_B) {                                                             \
                    for (int l = 0; l < PK_B; l++) {                                         \
                        double x = TOD(d[j + l]);                                            \
                        sq[l] += x * x;                                                      \
                    }                                                                        \
                } else {                                                                     \
                    for (int l = 0; l < m; l++) {                                            \
                        double x = TOD(d[j + l]);                                            \
                        sq[l] += x * x;                                                      \
                    }                                                                        \
                }                                                                            \
            }                                                                                \
            if (any) k = pk_changed_##NAME(d + j, s + j, m, o + j, idx, bef, k, stats, diffs); \
        }                                                                                    \
        if (j > n) j = n; /* the last block was short */                                     \
        if (stats) {                                                                         \
            double t = fast;                                                                 \
            for (int l = 0; l < PK_B; l++) t += sq[l];                                       \
            if (!isfinite(t) || (t < PK_TINY_##NAME && pk_any_##NAME(d, j, bef + *c, k - *c)))   \
                t = pk_b2_##NAME(d, o, j, idx, bef, *c, k, 0);                               \
            *b2 += t;                                                                        \
        }                                                                                    \
        *c = k;                                                                              \
        return j;                                                                            \
    }                                                                                        \
    /* Whole mode, one run of n elements: no branches, unchanged elements add 0. */          \
    static inline __attribute__((always_inline)) void pk_whole_##NAME(                       \
        UT *restrict d, const UT *restrict s, int64_t n, UT *restrict w, const int stats,    \
        int64_t *count, double *b2, pk_acc *diffs) {                                         \
        double sq[PK_B] = {0}, sa[PK_B] = {0}, sd[PK_B] = {0}, mx[PK_B] = {0};               \
        UT ne[PK_B] = {0}; /* at most PK_K / PK_B per lane: fits UT */                        \
        double fast = 0;                                                                     \
        int64_t j = PK_FASTW_##NAME(d, s, n, w, stats, count, &fast, diffs);                 \
        for (; j + PK_B <= n; j += PK_B)                                                     \
            for (int l = 0; l < PK_B; l++) {                                                 \
                PK_WHOLE_STEP(UT, TOD, DIFF);                                                \
            }                                                                                \
        for (int l = 0; j + l < n; l++) {                                                    \
            PK_WHOLE_STEP(UT, TOD, DIFF);                                                    \
        }                                                                                    \
        double t = fast;                                                                     \
        for (int l = 0; l < PK_B; l++) {                                                     \
            *count += ne[l];                                                                 \
            t += sq[l];                                                                      \
            diffs->sum_abs += sa[l];                                                         \
            diffs->sum_d2 += sd[l];                                                          \
            if (mx[l] > diffs->max_abs) diffs->max_abs = mx[l];                              \
        }                                                                                    \
        if (stats) {                                                                         \
            if (!isfinite(t) || (t < PK_TINY_##NAME && pk_any_##NAME(w, n, 0, 0)))          \
                t = pk_b2_##NAME(d, 0, n, 0, 0, 0, 0, w);                                    \
            *b2 += t;                                                                        \
        }                                                                                    \
    }                                                                                        \
    static inline __attribute__((always_inline)) int64_t pk_body_##NAME(                     \
        UT *dst, const UT *src, int64_t L, int64_t drs, int64_t srs, int64_t doff, int64_t p, \
        int64_t p1, int64_t *idx, UT *bef, int64_t cap, const int bef_whole, const int stats, \
        pk_acc *acc) {                                                                       \
        pk_acc diffs = *acc;                                                                 \
        int64_t c = acc->saved, count = acc->count;                                          \
        double b2 = acc->b2;                                                                 \
        while (p < p1) {                                                                     \
            int64_t row = p / L, col = p % L;                                                \
            int64_t run = L - col;                                                           \
            if (run > p1 - p) run = p1 - p;                                                  \
            if (run > PK_K) run = PK_K;                                                      \
            UT *d = dst + row * drs + col;                                                   \
            const UT *s = src + row * srs + col;                                             \
            if (bef_whole) {                                                                 \
                pk_whole_##NAME(d, s, run, bef + p, stats, &count, &b2, &diffs);             \
                p += run;                                                                    \
                continue;                                                                    \
            }                                                                                \
            int64_t c0 = c;                                                                  \
            pk_ahead ahead = pk_ahead_at(dst, src, L, drs, srs, p, sizeof(UT));              \
            int64_t done = pk_compact_##NAME(d, s, run, doff + row * drs + col, idx, bef, &c, \
                                             cap, stats, &b2, &diffs, ahead);                \
            count += c - c0;                                                                 \
            p += done;                                                                       \
            if (done < run) break;                                                           \
        }                                                                                    \
        diffs.saved = c;                                                                     \
        diffs.count = count;                                                                 \
        diffs.b2 = b2;                                                                       \
        *acc = diffs;                                                                        \
        return p;                                                                            \
    }                                                                                        \
    /* One body per mode, so that neither flag is tested inside the loop. */                 \
    int64_t pk_copy_##NAME(UT *dst, const UT *src, int64_t L, int64_t drs, int64_t srs,      \
                           int64_t doff, int64_t p, int64_t p1, int64_t *idx, UT *bef,       \
                           int64_t cap, int bef_whole, int stats, pk_acc *acc) {             \
        if (bef_whole) {                                                                     \
            p = stats ? pk_body_##NAME(dst, src, L, drs, srs, doff, p, p1, idx, bef, cap, 1, \
                                       1, acc)                                               \
                      : pk_body_##NAME(dst, src, L, drs, srs, doff, p, p1, idx, bef, cap, 1, \
                                       0, acc);                                              \
            PK_SFENCE();                                                                     \
            return p;                                                                        \
        }                                                                                    \
        return stats ? pk_body_##NAME(dst, src, L, drs, srs, doff, p, p1, idx, bef, cap, 0, 1, \
                                      acc)                                                   \
                     : pk_body_##NAME(dst, src, L, drs, srs, doff, p, p1, idx, bef, cap, 0, 0, \
                                      acc);                                                  \
    }

PK_DEFINE(f32, uint32_t, pk_f32, PK_DIFF_WIDE)
PK_DEFINE(f64, uint64_t, pk_f64, PK_DIFF_WIDE)
PK_DEFINE(bf16, uint16_t, pk_bf16, PK_DIFF_WIDE)
PK_DEFINE(f16, uint16_t, pk_f16, PK_DIFF_F16)

/* A job of parts [bounds[k], bounds[k+1]) on several threads (see pk_run): the
 * arguments of pk_copy, pk_count or pk_merge that all parts share, and where each part's
 * results go. pk_copy: accs[k] (its saved set by pk_copy_parts: compact mode saves into
 * idx/bef from there up to ends[k]) and out[k], where the part stopped. pk_count: out[k].
 * pk_merge: out + 3k (set by the caller) and, with statistics, accs[k]. */
typedef struct {
    void *dst;
    const void *src;
    int64_t L, drs, srs, doff;
    const int64_t *bounds;
    int64_t *idx;
    void *bef;
    const int64_t *ends;
    int whole, stats;
    pk_acc *accs;
    int64_t *out;
} pk_job;

/* pk_copy over parts, part k's numbers in accs[k], which this sets first (zero, but a
 * compact save's saved: part k saves from ends[k - 1], the end of part k - 1's room, and
 * part 0 from 0; so the caller's accs need no setting up, and may be reused). With total
 * (not NULL), after the parts: a compact save's entries are moved together to the front
 * of idx and bef, in part order, and *total gets the parts' numbers, summed in part
 * order from zero, and the largest max_abs (as the Python side sums them), its saved the
 * entries kept. Returns 1 when every part reached its end, else 0 (a part ran out of
 * room: the caller goes on from reached, after the packed entries). */
#define PK_COPY_PARTS(NAME, UT)                                                              \
    static void pk_copy_task_##NAME(void *c, int64_t k) {                                    \
        pk_job *j = c;                                                                       \
        j->out[k] = pk_copy_##NAME(j->dst, j->src, j->L, j->drs, j->srs, j->doff,            \
                                   j->bounds[k], j->bounds[k + 1], j->idx, j->bef,           \
                                   j->ends ? j->ends[k] : 0, j->whole, j->stats,             \
                                   &j->accs[k]);                                             \
    }                                                                                        \
    int pk_copy_parts_##NAME(UT *dst, const UT *src, int64_t L, int64_t drs, int64_t srs,    \
                             int64_t doff, int64_t parts, const int64_t *bounds,             \
                             int64_t *idx, UT *bef, const int64_t *ends, int whole,          \
                             int stats, pk_acc *accs, int64_t *reached, int threads,         \
                             pk_acc *total) {                                                \
        pk_job j = {dst, src, L, drs, srs, doff, bounds, idx, bef, ends, whole, stats, accs, \
                    reached};                                                                \
        for (int64_t k = 0; k < parts; k++) {                                                \
            pk_acc zero = {0};                                                               \
            if (ends && k) zero.saved = ends[k - 1];                                         \
            accs[k] = zero;                                                                  \
        }                                                                                    \
        pk_run(pk_copy_task_##NAME, &j, parts, threads);                                     \
        if (!total) return 0;                                                                \
        int done = 1;                                                                        \
        pk_acc t = {0};                                                                      \
        t.max_abs = accs[0].max_abs;                                                         \
        for (int64_t k = 0; k < parts; k++) {                                                \
            const pk_acc *a = &accs[k];                                                      \
            done &= reached[k] >= bounds[k + 1];                                             \
            if (ends) { /* part k's entries are [ends[k - 1], a->saved): move them down */   \
                int64_t base = k ? ends[k - 1] : 0, m = a->saved - base;                     \
                if (m && base != t.saved) {                                                  \
                    memmove(idx + t.saved, idx + base, (size_t)m * sizeof(int64_t));         \
                    memmove(bef + t.saved, bef + base, (size_t)m * sizeof(UT));              \
                }                                                                            \
                t.saved += m;                                                                \
            }                                                                                \
            t.count += a->count;                                                             \
            t.b2 += a->b2;                                                                   \
            t.sum_abs += a->sum_abs;                                                         \
            t.sum_d2 += a->sum_d2;                                                           \
            if (a->max_abs > t.max_abs) t.max_abs = a->max_abs;                              \
        }                                                                                    \
        *total = t;                                                                          \
        return done;                                                                         \
    }
PK_COPY_PARTS(f32, uint32_t)
PK_COPY_PARTS(f64, uint64_t)
PK_COPY_PARTS(bf16, uint16_t)
PK_COPY_PARTS(f16, uint16_t)

/* The NaN-merge of a sparse load (CONTRACT §4): where the source is not NaN the
 * destination takes its bits, elsewhere it keeps them. Walks [p, p1) as pk_copy does.
 * With bef, each written element's old bits go to bef[] (every written element, changed
 * or not), from n[0] on, and with idx also its storage offset to idx[]; the caller sized
 * them with pk_count, so they cannot overflow. With stats, the statistics of pk_copy
 * over the written elements go to *stats (b2 over their old values, the differences
 * over those that changed; count and saved are not used). n[1] counts written
 * elements, n[2] changed ones; n[3] and n[4] add up the written elements' row-major
 * positions in the view and their squares (wrapping, as pk_entries sums a patch's), so
 * that a caller that expected certain positions can tell whether those were written. */
#define PK_MERGE(NAME, UT, ISNAN, TOD, DIFF)                                                 \
    int64_t pk_count_##NAME(const UT *src, int64_t L, int64_t srs, int64_t p, int64_t p1) {  \
        int64_t k = 0;                                                                       \
        while (p < p1) {                                                                     \
            int64_t row = p / L, col = p % L, run = L - col;                                 \
            if (run > p1 - p) run = p1 - p;                                                  \
            const UT *s = src + row * srs + col;                                             \
            for (int64_t j = 0; j < run; j++) k += !ISNAN(s[j]);                             \
            p += run;                                                                        \
        }                                                                                    \
        return k;                                                                            \
    }                                                                                        \
    void pk_merge_##NAME(UT *dst, const UT *src, int64_t L, int64_t drs, int64_t srs,        \
                         int64_t doff, int64_t p, int64_t p1, int64_t *idx, UT *bef,         \
                         int64_t *n, pk_acc *stats) {                                        \
        int64_t c = n[0], written = n[1], changed = n[2];                                    \
        uint64_t s1 = (uint64_t)n[3], s2 = (uint64_t)n[4];                                   \
        pk_acc diffs = {0};                                                                  \
        while (p < p1) {                                                                     \
            int64_t row = p / L, col = p % L, run = L - col;                                 \
            if (run > p1 - p) run = p1 - p;                                                  \
            UT *restrict d = dst + row * drs + col;                                          \
            const UT *restrict s = src + row * srs + col;                                    \
            int64_t o = doff + row * drs + col, j = 0;                                       \
            for (; j < run; j += PK_B) {                                                     \
                int m = run - j < PK_B ? (int)(run - j) : PK_B, any = 0;                     \
                if (m == PK_B) {                                                             \
                    for (int l = 0; l < PK_B; l++) any |= !ISNAN(s[j + l]);                  \
                } else {                                                                     \
                    any = 1;                                                                 \
                }                                                                            \
                if (!any) continue;                                                          \
                for (int l = 0; l < m; l++) {                                                \
                    UT x0 = d[j + l], x1 = s[j + l];                                         \
                    if (ISNAN(x1)) continue;                                                 \
                    if (bef) { if (idx) idx[c] = o + j + l; bef[c] = x0; c++; }            \
                    written++;                                                               \
                    s1 += (uint64_t)(p + j + l);                                             \
                    s2 += (uint64_t)(p + j + l) * (uint64_t)(p + j + l);                     \
                    changed += x0 != x1;                                                     \
                    if (stats) {                                                             \
                        double x = TOD(x0);                                                  \
                        if (fabs(x) <= PK_DBL_MAX) diffs.b2 += x * x;                        \
                        if (x0 != x1) pk_stat(&diffs, DIFF(TOD, x0, x1));                    \
                    }                                                                        \
                    d[j + l] = x1;                                                           \
                }                                                                            \
            }                                                                                \
            p += run;                                                                        \
        }                                                                                    \
        n[0] = c;                                                                            \
        n[1] = written;                                                                      \
        n[2] = changed;                                                                      \
        n[3] = (int64_t)s1;                                                                  \
        n[4] = (int64_t)s2;                                                                  \
        if (stats) *stats = diffs;                                                           \
    }

#define PK_NAN_F32(u) (((u) & 0x7fffffffu) > 0x7f800000u)
#define PK_NAN_F64(u) (((u) & 0x7fffffffffffffffull) > 0x7ff0000000000000ull)
#define PK_NAN_BF16(u) (((u) & 0x7fffu) > 0x7f80u)
#define PK_NAN_F16(u) (((u) & 0x7fffu) > 0x7c00u)
PK_MERGE(f32, uint32_t, PK_NAN_F32, pk_f32, PK_DIFF_WIDE)
PK_MERGE(f64, uint64_t, PK_NAN_F64, pk_f64, PK_DIFF_WIDE)
PK_MERGE(bf16, uint16_t, PK_NAN_BF16, pk_bf16, PK_DIFF_WIDE)
PK_MERGE(f16, uint16_t, PK_NAN_F16, pk_f16, PK_DIFF_F16)

#define PK_MERGE_PARTS(NAME, UT)                                                             \
    static void pk_count_task_##NAME(void *c, int64_t k) {                                   \
        pk_job *j = c;                                                                       \
        j->out[k] = pk_count_##NAME(j->src, j->L, j->srs, j->bounds[k], j->bounds[k + 1]);   \
    }                                                                                        \
    void pk_count_parts_##NAME(const UT *src, int64_t L, int64_t srs, int64_t parts,         \
                               const int64_t *bounds, int64_t *counts, int threads) {        \
        pk_job j = {.src = src, .L = L, .srs = srs, .bounds = bounds, .out = counts};        \
        pk_run(pk_count_task_##NAME, &j, parts, threads);                                    \
    }                                                                                        \
    static void pk_merge_task_##NAME(void *c, int64_t k) {                                   \
        pk_job *j = c;                                                                       \
        pk_merge_##NAME(j->dst, j->src, j->L, j->drs, j->srs, j->doff, j->bounds[k],         \
                        j->bounds[k + 1], j->idx, j->bef, j->out + 5 * k,                    \
                        j->accs ? j->accs + k : NULL);                                       \
    }                                                                                        \
    void pk_merge_parts_##NAME(UT *dst, const UT *src, int64_t L, int64_t drs, int64_t srs,  \
                               int64_t doff, int64_t parts, const int64_t *bounds,           \
                               int64_t *idx, UT *bef, int64_t *n, pk_acc *stats,             \
                               int threads) {                                                \
        pk_job j = {.dst = dst, .src = src, .L = L, .drs = drs, .srs = srs, .doff = doff,    \
                    .bounds = bounds, .idx = idx, .bef = bef, .accs = stats, .out = n};      \
        pk_run(pk_merge_task_##NAME, &j, parts, threads);                                    \
    }
PK_MERGE_PARTS(f32, uint32_t)
PK_MERGE_PARTS(f64, uint64_t)
PK_MERGE_PARTS(bf16, uint16_t)
PK_MERGE_PARTS(f16, uint16_t)

/* Write vals[k] to base[idx[k]]: undoes a compact save (index_copy_ does the same,
 * several times slower on the CPU). */
#define PK_SCATTER(NAME, UT)                                                                 \
    void pk_scatter_##NAME(UT *base, const int64_t *idx, const UT *vals, int64_t n) {       \
        for (int64_t k = 0; k < n; k++) base[idx[k]] = vals[k];                              \
    }
PK_SCATTER(f32, uint32_t)
PK_SCATTER(f64, uint64_t)
PK_SCATTER(bf16, uint16_t)
PK_SCATTER(f16, uint16_t)

/* How many elements of positions [p, p1) of the view (walked as pk_copy walks it) differ
 * between dst and src. pk_sample counts them in k blocks of b consecutive positions,
 * spread evenly over the view's n (k*b <= n): a cheap estimate, before a compact save,
 * of how many elements the copy will change. Blocks touch few cache lines (scattered
 * single positions cost a cache miss each), and see periodic patterns of changes that
 * evenly spaced single positions can alias with. */
#define PK_SAMPLE(NAME, UT)                                                                  \
    int64_t pk_diffs_##NAME(const UT *dst, const UT *src, int64_t L, int64_t drs,            \
                            int64_t srs, int64_t p, int64_t p1) {                            \
        int64_t hits = 0;                                                                    \
        while (p < p1) {                                                                     \
            int64_t row = p / L, col = p % L, run = L - col;                                 \
            if (run > p1 - p) run = p1 - p;                                                  \
            const UT *d = dst + row * drs + col, *s = src + row * srs + col;                 \
            /* counted in blocks into a counter as wide as an element: that vectorizes */    \
            /* in lanes of that width (an int64_t one widens every comparison to 64 bits) */ \
            for (int64_t j = 0; j < run;) {                                                  \
                int64_t m = run - j < 65535 ? run - j : 65535;                               \
                UT h = 0;                                                                    \
                for (int64_t q = 0; q < m; q++) h += d[j + q] != s[j + q];                   \
                hits += h;                                                                   \
                j += m;                                                                      \
            }                                                                                \
            p += run;                                                                        \
        }                                                                                    \
        return hits;                                                                         \
    }                                                                                        \
    int64_t pk_sample_##NAME(const UT *dst, const UT *src, int64_t L, int64_t drs,            \
                             int64_t srs, int64_t n, int64_t k, int64_t b) {                 \
        int64_t hits = 0, step = (n - b) / (k > 1 ? k - 1 : 1);                              \
        /* Every block's lines are asked for first: from memory, blocks counted one after */ \
        /* another wait for their misses nearly one at a time (256 blocks: 60-80 us). */     \
        for (int64_t i = 0; i < k; i++) {                                                    \
            int64_t first = i * step, last = first + b - 1;                                  \
            __builtin_prefetch(dst + first / L * drs + first % L);                           \
            __builtin_prefetch(src + first / L * srs + first % L);                           \
            __builtin_prefetch(dst + last / L * drs + last % L);                             \
            __builtin_prefetch(src + last / L * srs + last % L);                             \
        }                                                                                    \
        for (int64_t i = 0; i < k; i++)                                                      \
            hits += pk_diffs_##NAME(dst, src, L, drs, srs, i * step, i * step + b);          \
        return hits;                                                                         \
    }
PK_SAMPLE(f32, uint32_t)
PK_SAMPLE(f64, uint64_t)
PK_SAMPLE(bf16, uint16_t)
PK_SAMPLE(f16, uint16_t)

/* A sparse patch's entries that a NaN-merge from a view of its staged tensor writes: the
 * entry k (checkpoint index indices[k], 32- or 64-bit, and value values[k]) is written
 * when its value is not NaN and its index lies in the view, rows of L contiguous
 * elements srs apart starting at checkpoint index start (rows rows). out[0] counts them;
 * out[1] and out[2] are two checksums of their indices (patchkit.native.patch_entries
 * says which), so that positions recomputed later from the patch can be checked; out[3]
 * and out[4] the sums of their row-major positions in the view and of their squares
 * (wrapping), as pk_merge adds up the positions it writes. */
#define PK_ENTRIES(NAME, UT, ISNAN)                                                          \
    void pk_entries_##NAME(const void *indices, int isize, const UT *values, int64_t nnz,    \
                           int64_t start, int64_t L, int64_t srs, int64_t rows,              \
                           int64_t *out) {                                                   \
        int64_t count = 0, s1 = 0, s2 = 0;                                                   \
        uint64_t q1 = 0, q2 = 0;                                                             \
        for (int64_t k = 0; k < nnz; k++) {                                                  \
            int64_t i = isize == 4 ? (int64_t)((const int32_t *)indices)[k]                  \
                                   : ((const int64_t *)indices)[k];                          \
            int64_t rel = i - start;                                                         \
            if (ISNAN(values[k]) || rel < 0 || rel / srs >= rows || rel % srs >= L) continue; \
            count++;                                                                         \
            s1 += i & 0x7fffffff;                                                            \
            s2 += (i % 65521) * 40503 % 65521;                                               \
            uint64_t at = (uint64_t)(rel / srs * L + rel % srs);                             \
            q1 += at;                                                                        \
            q2 += at * at;                                                                   \
        }                                                                                    \
        out[0] = count;                                                                      \
        out[1] = s1;                                                                         \
        out[2] = s2;                                                                         \
        out[3] = (int64_t)q1;                                                                \
        out[4] = (int64_t)q2;                                                                \
    }
PK_ENTRIES(f32, uint32_t, PK_NAN_F32)
PK_ENTRIES(f64, uint64_t, PK_NAN_F64)
PK_ENTRIES(bf16, uint16_t, PK_NAN_BF16)
PK_ENTRIES(f16, uint16_t, PK_NAN_F16)
