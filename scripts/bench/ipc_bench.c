/*
 * ipc_bench: the C reference for `cudaipc bench ipc`. It measures the same
 * IPC latencies straight against the driver API (cuda.h, -lcuda), so that
 * the Go binding's overhead shows as the difference between the two, and
 * prints JSON with the same keys as `cudaipc bench ipc --json`.
 *
 * The exporter is a fork()ed child that talks to the parent over two pipes.
 * Both fork before any CUDA call: a CUDA context does not survive fork.
 *
 *   gcc -O2 -Wall -I/usr/local/cuda/include ipc_bench.c -o ipc_bench \
 *       -L/usr/local/cuda/lib64/stubs -lcuda
 *   ./ipc_bench [--size BYTES] [--iters N]
 *
 * Each latency is the host clock (CLOCK_MONOTONIC) around one synchronous
 * driver call, after 5 untimed repetitions; p50 and p99 are nearest-rank
 * (index ceil(p*n/100)-1 of the sorted times), as in the Go and Python
 * programs.
 */
#define _GNU_SOURCE
#include <cuda.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define SMALL (1 << 20)
#define WARMUP 5

static const char *who = "importer";

static void check(CUresult r, const char *call, int line) {
    if (r == CUDA_SUCCESS) return;
    const char *name = NULL;
    cuGetErrorName(r, &name);
    fprintf(stderr, "ipc_bench (%s): %s failed at line %d: %s (%d)\n", who, call, line, name ? name : "?", (int)r);
    exit(1);
}
#define CK(call) check((call), #call, __LINE__)

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static int rank_index(int n, int pct) {
    int i = (pct * n + 99) / 100 - 1;
    return i < 0 ? 0 : i;
}

struct summary { double p50, p99; int n; };

static struct summary summarize(double *v, int n) {
    struct summary s = {0, 0, n};
    if (n == 0) return s;
    qsort(v, n, sizeof *v, cmp_double);
    s.p50 = v[rank_index(n, 50)];
    s.p99 = v[rank_index(n, 99)];
    return s;
}

/* Random bytes that both processes can make from one seed. */
static void fill(unsigned char *b, size_t n, uint64_t seed) {
    uint64_t x = seed | 1;
    for (size_t i = 0; i < n; i += 8) {
        x ^= x << 13; x ^= x >> 7; x ^= x << 17;
        size_t k = n - i < 8 ? n - i : 8;
        memcpy(b + i, &x, k);
    }
}

static void read_full(int fd, void *p, size_t n) {
    char *c = p;
    while (n > 0) {
        ssize_t r = read(fd, c, n);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) { fprintf(stderr, "ipc_bench (%s): the other process is gone\n", who); exit(1); }
        c += r; n -= (size_t)r;
    }
}

static void write_full(int fd, const void *p, size_t n) {
    const char *c = p;
    while (n > 0) {
        ssize_t r = write(fd, c, n);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) { perror("ipc_bench: write"); exit(1); }
        c += r; n -= (size_t)r;
    }
}

struct hello {
    CUipcMemHandle small, large;
    CUipcEventHandle event;
    struct summary export_first, export_again;
};

static CUdevice context0(void) {
    CUdevice dev;
    CUcontext ctx;
    CK(cuInit(0));
    CK(cuDeviceGet(&dev, 0));
    CK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CK(cuCtxSetCurrent(ctx));
    return dev;
}

static void exporter(int in, int out, size_t size, int iters, uint64_t seed) {
    who = "exporter";
    context0();
    unsigned char *host;
    CK(cuMemAllocHost((void **)&host, size));
    fill(host, size, seed);

    struct hello h;
    memset(&h, 0, sizeof h);
    CUdeviceptr small, large;
    CK(cuMemAlloc(&small, SMALL));
    CK(cuMemcpyHtoD(small, host, SMALL));
    CK(cuMemAlloc(&large, size));
    CK(cuMemcpyHtoD(large, host, size));
    CK(cuIpcGetMemHandle(&h.small, small));
    CK(cuIpcGetMemHandle(&h.large, large));

    /* Export latency: first on fresh allocations, then again on each. */
    int m = iters + WARMUP;
    CUdeviceptr *fresh = calloc(m, sizeof *fresh);
    double *first = calloc(m, sizeof *first), *again = calloc(m, sizeof *again);
    CUipcMemHandle tmp;
    for (int i = 0; i < m; i++) CK(cuMemAlloc(&fresh[i], SMALL));
    for (int i = 0; i < m; i++) {
        double t0 = now_us();
        CK(cuIpcGetMemHandle(&tmp, fresh[i]));
        first[i] = now_us() - t0;
    }
    for (int i = 0; i < m; i++) {
        double t0 = now_us();
        CK(cuIpcGetMemHandle(&tmp, fresh[i]));
        again[i] = now_us() - t0;
    }
    for (int i = 0; i < m; i++) CK(cuMemFree(fresh[i]));
    h.export_first = summarize(first + WARMUP, iters);
    h.export_again = summarize(again + WARMUP, iters);
    free(fresh); free(first); free(again);

    CUevent ev;
    CK(cuEventCreate(&ev, CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING));
    CK(cuEventRecord(ev, 0));
    CK(cuIpcGetEventHandle(&h.event, ev));
    write_full(out, &h, sizeof h);

    char done;
    read_full(in, &done, 1); /* hold everything until the importer has closed */
    CK(cuEventDestroy(ev));
    CK(cuMemFree(large));
    CK(cuMemFree(small));
    CK(cuMemFreeHost(host));
}

static void open_close(CUipcMemHandle h, int iters, double *open, double *close, const unsigned char *want, size_t nwant) {
    CUdeviceptr p;
    unsigned char *got = malloc(nwant);
    CK(cuIpcOpenMemHandle(&p, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS));
    CK(cuMemcpyDtoH(got, p, nwant));
    CK(cuIpcCloseMemHandle(p));
    if (memcmp(got, want, nwant) != 0) {
        fprintf(stderr, "ipc_bench: the mapping does not hold the exporter's bytes\n");
        exit(1);
    }
    free(got);
    for (int i = 0; i < iters + WARMUP; i++) {
        double t0 = now_us();
        CK(cuIpcOpenMemHandle(&p, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS));
        double t1 = now_us();
        CK(cuIpcCloseMemHandle(p));
        double t2 = now_us();
        if (i >= WARMUP) { open[i - WARMUP] = t1 - t0; close[i - WARMUP] = t2 - t1; }
    }
}

static void put(const char *key, struct summary s, int *first) {
    printf("%s\n    \"%s\": {\"unit\": \"us\", \"p50\": %.3f, \"p99\": %.3f, \"n\": %d}",
           *first ? "" : ",", key, s.p50, s.p99, s.n);
    *first = 0;
}

int main(int argc, char **argv) {
    size_t size = (size_t)1 << 30;
    int iters = 200;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (strcmp(argv[i], "--size") == 0) size = strtoull(argv[i + 1], NULL, 0);
        else if (strcmp(argv[i], "--iters") == 0) iters = atoi(argv[i + 1]);
        else { fprintf(stderr, "usage: %s [--size BYTES] [--iters N]\n", argv[0]); return 2; }
    }
    if (size < SMALL || iters < 1) { fprintf(stderr, "ipc_bench: --size >= 1 MiB and --iters >= 1\n"); return 2; }
    uint64_t seed = (uint64_t)time(NULL) * 0x9e3779b97f4a7c15ull ^ (uint64_t)getpid();

    int p2c[2], c2p[2];
    if (pipe(p2c) || pipe(c2p)) { perror("pipe"); return 1; }
    pid_t pid = fork();
    if (pid < 0) { perror("fork"); return 1; }
    if (pid == 0) {
        close(p2c[1]); close(c2p[0]);
        exporter(p2c[0], c2p[1], size, iters, seed);
        _exit(0);
    }
    close(p2c[0]); close(c2p[1]);

    struct hello h;
    read_full(c2p[0], &h, sizeof h);
    CUdevice dev = context0();
    char name[256] = "";
    int ngpu = 0;
    CK(cuDeviceGetName(name, sizeof name, dev));
    CK(cuDeviceGetCount(&ngpu));

    unsigned char *want = malloc(SMALL);
    fill(want, SMALL, seed); /* the first MiB of both allocations */
    double *a = calloc(iters, sizeof *a), *b = calloc(iters, sizeof *b);
    struct summary open1, close1, openL, closeL, openA, closeD, evOpen;

    open_close(h.small, iters, a, b, want, SMALL);
    open1 = summarize(a, iters); close1 = summarize(b, iters);
    open_close(h.large, iters, a, b, want, SMALL);
    openL = summarize(a, iters); closeL = summarize(b, iters);

    CUdeviceptr keep, p;
    CK(cuIpcOpenMemHandle(&keep, h.small, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS));
    for (int i = 0; i < iters + WARMUP; i++) {
        double t0 = now_us();
        CK(cuIpcOpenMemHandle(&p, h.small, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS));
        double t1 = now_us();
        CK(cuIpcCloseMemHandle(p));
        double t2 = now_us();
        if (p != keep) { fprintf(stderr, "ipc_bench: a second open returned another address\n"); return 1; }
        if (i >= WARMUP) { a[i - WARMUP] = t1 - t0; b[i - WARMUP] = t2 - t1; }
    }
    CK(cuIpcCloseMemHandle(keep));
    openA = summarize(a, iters); closeD = summarize(b, iters);

    for (int i = 0; i < iters + WARMUP; i++) {
        CUevent ev;
        double t0 = now_us();
        CK(cuIpcOpenEventHandle(&ev, h.event));
        double t1 = now_us();
        CK(cuEventDestroy(ev));
        if (i >= WARMUP) a[i - WARMUP] = t1 - t0;
    }
    evOpen = summarize(a, iters);

    write_full(p2c[1], "x", 1);
    int status = 0;
    waitpid(pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        fprintf(stderr, "ipc_bench: the exporter failed\n");
        return 1;
    }

    int first = 1;
    printf("{\n  \"tool\": \"c-driver-api\",\n  \"device\": \"%s\",\n  \"gpus\": %d,\n  \"size\": %zu,\n"
           "  \"iters\": %d,\n  \"bw_iters\": 0,\n  \"metrics\": {", name, ngpu, size, iters);
    put("export_first", h.export_first, &first);
    put("export_again", h.export_again, &first);
    put("open_cold_1mib", open1, &first);
    put("close_1mib", close1, &first);
    put("open_cold_large", openL, &first);
    put("close_large", closeL, &first);
    put("open_already_open", openA, &first);
    put("close_decrement", closeD, &first);
    put("event_open", evOpen, &first);
    printf("\n  }\n}\n");
    free(a); free(b); free(want);
    return 0;
}
