/*
 * A worker of a falcon job, in C: joins the job its environment describes (the launch
 * contract: FALCON_*, DMLC_*, torchrun's, Slurm's), declares one tensor, and trains it for a
 * few clocks, checking every value it pulls against the exact one.
 *
 * Worker r pushes the same gradient at every clock: g[i] = -(r + 1) * (i mod 4 + 1). Rank 0
 * sets the initial values w0[i] = (i mod 8) / 4. Under BSP the servers apply the mean of the
 * W workers' gradients with SGD at rate lr, so after t clocks
 *     w[i] = w0[i] + t * lr * (i mod 4 + 1) * (W + 1) / 2,
 * exact in float with lr a power of two. Clock 2's pull and push are asynchronous (a handle
 * each). Exits 0 when every value was as expected; otherwise prints what differed, or the
 * failing call's error (falcon_last_error()), and exits 1.
 *
 *     gcc -O2 -I capi/include examples/c/train.c -L target/debug -lfalcon \
 *         -Wl,-rpath,target/debug -o train
 *     DMLC_ROLE=scheduler DMLC_PS_ROOT_URI=127.0.0.1 DMLC_PS_ROOT_PORT=9000 DMLC_NUM_WORKER=2 falcon role &
 *     DMLC_ROLE=server    DMLC_PS_ROOT_URI=127.0.0.1 DMLC_PS_ROOT_PORT=9000 DMLC_NUM_WORKER=2 falcon role &
 *     DMLC_ROLE=worker    DMLC_PS_ROOT_URI=127.0.0.1 DMLC_PS_ROOT_PORT=9000 DMLC_NUM_WORKER=2 ./train &
 *     DMLC_ROLE=worker    DMLC_PS_ROOT_URI=127.0.0.1 DMLC_PS_ROOT_PORT=9000 DMLC_NUM_WORKER=2 ./train
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "falcon.h"

#define TENSOR "weights"
#define LEN 1000
#define ITERS 6
/* The clock whose pull and push go through handles. */
#define ASYNC_CLOCK 2

/* Reports a failed call and exits. */
static void fail(const char *what, int code) {
    fprintf(stderr, "c worker: %s failed: %s (%d): %s\n", what, falcon_code_name(code), code,
            falcon_last_error());
    exit(1);
}

#define CHECK(call)                                                                            \
    do {                                                                                       \
        int code_ = (call);                                                                    \
        if (code_ != FALCON_OK) fail(#call, code_);                                            \
    } while (0)

static float factor(size_t i) { return (float)(i % 4 + 1); }

static float initial(size_t i) { return (float)(i % 8) / 4.0f; }

static uint32_t rank, workers;
static float lr;

static float expected(uint64_t t, size_t i) {
    float mean = (float)(workers + 1) / 2.0f;
    return initial(i) + (float)t * lr * factor(i) * mean;
}

/* Exits if any value pulled at clock t differs from the expected one. */
static void check(uint64_t t, const float *w) {
    for (size_t i = 0; i < LEN; i++) {
        if (w[i] != expected(t, i)) {
            fprintf(stderr, "c worker %u: at clock %llu w[%zu] = %.9g, expected %.9g\n", rank,
                    (unsigned long long)t, i, w[i], expected(t, i));
            exit(1);
        }
    }
}

int main(void) {
    const char *names[] = {TENSOR};
    const uint64_t lens[] = {LEN};
    falcon_worker *w = NULL;
    CHECK(falcon_join(names, lens, 1, &w));
    CHECK(falcon_rank(w, &rank));
    CHECK(falcon_workers(w, &workers));
    CHECK(falcon_learning_rate(w, &lr));

    static float values[LEN], grad[LEN];
    if (rank == 0) {
        for (size_t i = 0; i < LEN; i++) values[i] = initial(i);
        CHECK(falcon_init_tensor(w, TENSOR, values, LEN));
    }
    /* No worker pulls before rank 0 has set the initial values. */
    CHECK(falcon_barrier(w));

    for (size_t i = 0; i < LEN; i++) grad[i] = -(float)(rank + 1) * factor(i);
    for (uint64_t t = 0; t < ITERS; t++) {
        if (t == ASYNC_CLOCK) {
            falcon_handle *pull = NULL;
            CHECK(falcon_pull_async(w, TENSOR, values, LEN, t, &pull));
            /* values must stay valid until a wait completes the pull. */
            int code;
            while ((code = falcon_handle_wait_for(pull, 100)) == FALCON_PENDING) {
            }
            if (code != FALCON_OK) fail("falcon_handle_wait_for (pull)", code);
            if (falcon_handle_ready(pull) != 1) fail("falcon_handle_ready (pull)", -1);
            CHECK(falcon_handle_free(pull));
            check(t, values);
            falcon_handle *push = NULL;
            CHECK(falcon_push_async(w, TENSOR, grad, LEN, t, &push));
            CHECK(falcon_handle_wait(push));
            CHECK(falcon_handle_free(push));
        } else {
            CHECK(falcon_pull(w, TENSOR, values, LEN, t));
            check(t, values);
            CHECK(falcon_push(w, TENSOR, grad, LEN, t));
        }
    }
    CHECK(falcon_pull(w, TENSOR, values, LEN, ITERS));
    check(ITERS, values);

    uint64_t clock = 0, clock_of = 0;
    CHECK(falcon_clock(w, &clock));
    CHECK(falcon_clock_of(w, TENSOR, &clock_of));
    if (clock != ITERS || clock_of != ITERS) {
        fprintf(stderr, "c worker %u: clock %llu, clock of %s %llu; expected %d\n", rank,
                (unsigned long long)clock, TENSOR, (unsigned long long)clock_of, ITERS);
        return 1;
    }
    CHECK(falcon_barrier(w));
    printf("c worker %u of %u: %d iterations at lr %g, every pull as expected; "
           "final w[0..4] = %g %g %g %g\n",
           rank, workers, ITERS, lr, values[0], values[1], values[2], values[3]);
    fflush(stdout);
    CHECK(falcon_finish(w));
    CHECK(falcon_worker_free(w));
    return 0;
}
