/*
 * falcon's errors through the C ABI: every failure is a negative code, with a message from
 * falcon_last_error() (the calling thread's), and the worker stays usable after one.
 *
 *     errors job           joins the job its environment describes (one worker), then makes
 *                          each mistake: an unknown tensor, a wrong length, a bad clock, null
 *                          pointers, a push after finishing; trains one clock in between
 *     errors unreachable HOST:PORT [SILENT_HOST:PORT]
 *                          joins a scheduler that is not there (falcon_join_with), and one
 *                          that accepts connections but never answers; with short
 *                          FALCON_RENDEZVOUS_TIMEOUT_MS and FALCON_HANDSHAKE_TIMEOUT_MS each
 *                          fails promptly; also a join from an environment that names no
 *                          role, and bad join arguments
 *
 * Prints one line per error seen ("CODE_NAME: message"); exits 1 at the first result that
 * is not the expected one.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "falcon.h"

#define LEN 8

static int failures = 0;

/* Checks that `code` is `want`, and that the thread's last error says so. */
static void expect(const char *what, int code, int want) {
    const char *msg = falcon_last_error();
    if (code != want || falcon_last_error_code() != want || msg == NULL || msg[0] == '\0') {
        fprintf(stderr, "%s: returned %s (%d), last error %s: \"%s\"; expected %s\n", what,
                falcon_code_name(code), code, falcon_code_name(falcon_last_error_code()),
                msg ? msg : "(null)", falcon_code_name(want));
        failures++;
        return;
    }
    printf("%s: %s: %s\n", what, falcon_code_name(code), msg);
}

/* Checks that a call succeeded. */
static void ok(const char *what, int code) {
    if (code != FALCON_OK) {
        fprintf(stderr, "%s: %s (%d): %s\n", what, falcon_code_name(code), code,
                falcon_last_error());
        exit(1);
    }
}

static int job(void) {
    const char *names[] = {"w"};
    const uint64_t lens[] = {LEN};
    falcon_worker *w = NULL;
    /* Mistakes before a worker exists. */
    expect("join without an out-pointer", falcon_join(names, lens, 1, NULL), FALCON_ERR_NULL);
    w = (falcon_worker *)(void *)&failures; /* not a worker: a failed join sets it to NULL */
    expect("join without tensor names", falcon_join(NULL, lens, 1, &w), FALCON_ERR_NULL);
    if (w != NULL) {
        fprintf(stderr, "a failed join left its out-pointer as it was\n");
        failures++;
    }
    expect("push on a null worker", falcon_push(NULL, "w", NULL, LEN, 0), FALCON_ERR_NULL);
    ok("falcon_join", falcon_join(names, lens, 1, &w));

    float grad[LEN], values[LEN], big[LEN + 1];
    for (int i = 0; i < LEN; i++) grad[i] = 1.0f;
    for (int i = 0; i <= LEN; i++) big[i] = 0.0f;
    uint64_t clock = 0;
    uint32_t rank = 0;
    falcon_handle *h = NULL;

    expect("push to an unknown tensor", falcon_push(w, "nope", grad, LEN, 0),
           FALCON_ERR_UNKNOWN_TENSOR);
    expect("pull of an unknown tensor", falcon_pull(w, "nope", values, LEN, 0),
           FALCON_ERR_UNKNOWN_TENSOR);
    expect("clock of an unknown tensor", falcon_clock_of(w, "nope", &clock),
           FALCON_ERR_UNKNOWN_TENSOR);
    expect("push of the wrong length", falcon_push(w, "w", big, LEN + 1, 0),
           FALCON_ERR_WRONG_LENGTH);
    h = (falcon_handle *)(void *)&failures; /* not a handle: a failed start sets it to NULL */
    expect("pull of the wrong length", falcon_pull_async(w, "w", values, LEN - 1, 0, &h),
           FALCON_ERR_WRONG_LENGTH);
    expect("init of the wrong length", falcon_init_tensor(w, "w", grad, 0),
           FALCON_ERR_WRONG_LENGTH);
    expect("push at a clock not the next", falcon_push(w, "w", grad, LEN, 3),
           FALCON_ERR_BAD_CLOCK);
    expect("pull from the future", falcon_pull(w, "w", values, LEN, 1), FALCON_ERR_BAD_CLOCK);
    expect("push of a null array", falcon_push(w, "w", NULL, LEN, 0), FALCON_ERR_NULL);
    expect("pull into a null array", falcon_pull(w, "w", NULL, LEN, 0), FALCON_ERR_NULL);
    expect("push to a null tensor name", falcon_push(w, NULL, grad, LEN, 0), FALCON_ERR_NULL);
    expect("rank into a null pointer", falcon_rank(w, NULL), FALCON_ERR_NULL);
    expect("async push without a handle pointer", falcon_push_async(w, "w", grad, LEN, 0, NULL),
           FALCON_ERR_NULL);
    expect("wait on a null handle", falcon_handle_wait(NULL), FALCON_ERR_NULL);
    expect("poll a null handle", falcon_handle_wait_for(NULL, 0), FALCON_ERR_NULL);
    expect("a tensor name that is not UTF-8", falcon_push(w, "\xff", grad, LEN, 0),
           FALCON_ERR_ARGUMENT);
    if (h != NULL) {
        fprintf(stderr, "a failed pull_async left its handle pointer as it was\n");
        failures++;
    }

    /* The worker is still fine: one clock of training. */
    ok("falcon_pull", falcon_pull(w, "w", values, LEN, 0));
    ok("falcon_push_async", falcon_push_async(w, "w", grad, LEN, 0, &h));
    ok("falcon_handle_wait_for, no limit", falcon_handle_wait_for(h, UINT64_MAX));
    ok("falcon_handle_wait after it", falcon_handle_wait(h));
    if (falcon_handle_ready(h) != 1) {
        fprintf(stderr, "a completed push is not ready\n");
        failures++;
    }
    ok("falcon_handle_free", falcon_handle_free(h));
    ok("falcon_clock", falcon_clock(w, &clock));
    ok("falcon_rank", falcon_rank(w, &rank));
    if (clock != 1) {
        fprintf(stderr, "clock %llu after one push\n", (unsigned long long)clock);
        failures++;
    }
    expect("push of a clock already pushed", falcon_push(w, "w", grad, LEN, 0),
           FALCON_ERR_BAD_CLOCK);
    /* The record is per thread and kept over successes. */
    ok("falcon_clock", falcon_clock(w, &clock));
    if (falcon_last_error_code() != FALCON_ERR_BAD_CLOCK) {
        fprintf(stderr, "a success changed the last error\n");
        failures++;
    }

    /* Rows: the tensor as a table of 4 rows of 2. */
    uint64_t rows[] = {1, 1}, outside[] = {4}, both[] = {0, 1};
    float row_grads[] = {1, 2, 3, 4}, before[4], after[4];
    expect("push of a row outside the table", falcon_push_rows(w, "w", 2, outside, 1, row_grads, 1),
           FALCON_ERR_CONFIG);
    expect("push of rows of a width that does not divide the tensor",
           falcon_push_rows(w, "w", 3, rows, 1, row_grads, 1), FALCON_ERR_CONFIG);
    expect("push of rows from a null array", falcon_push_rows(w, "w", 2, rows, 2, NULL, 1),
           FALCON_ERR_NULL);
    ok("falcon_pull_rows", falcon_pull_rows(w, "w", 2, both, 2, before, 1));
    ok("falcon_push_rows", falcon_push_rows(w, "w", 2, rows, 2, row_grads, 1));
    ok("falcon_pull_rows after the push", falcon_pull_rows(w, "w", 2, both, 2, after, 2));
    /* Row 0 got nothing; row 1 got (1+3, 2+4): moved in the ratio 4 : 6. */
    float d0 = before[2] - after[2], d1 = before[3] - after[3], off = d1 * 4 - d0 * 6;
    if (after[0] != before[0] || after[1] != before[1] || !(d0 > 0) || off > 1e-4f ||
        off < -1e-4f) {
        fprintf(stderr, "rows: before %g %g %g %g, after %g %g %g %g\n", before[0], before[1],
                before[2], before[3], after[0], after[1], after[2], after[3]);
        failures++;
    }

    /* Push-pull: clock 2 pushed, the values for clock 3 back, as a pull of clock 3 sees them. */
    float pushed_back[LEN], pulled[LEN];
    expect("push-pull into a null array", falcon_push_pull(w, "w", grad, NULL, LEN, 2),
           FALCON_ERR_NULL);
    expect("push-pull of the wrong length", falcon_push_pull(w, "w", big, big, LEN + 1, 2),
           FALCON_ERR_WRONG_LENGTH);
    expect("push-pull at a clock not the next",
           falcon_push_pull(w, "w", grad, pushed_back, LEN, 5), FALCON_ERR_BAD_CLOCK);
    ok("falcon_push_pull", falcon_push_pull(w, "w", grad, pushed_back, LEN, 2));
    ok("falcon_pull after it", falcon_pull(w, "w", pulled, LEN, 3));
    for (int i = 0; i < LEN; i++) {
        if (pushed_back[i] != pulled[i]) {
            fprintf(stderr, "push-pull brought %g at %d, a pull %g\n", pushed_back[i], i, pulled[i]);
            failures++;
            break;
        }
    }

    ok("falcon_finish", falcon_finish(w));
    ok("falcon_finish again", falcon_finish(w));
    expect("push after finishing", falcon_push(w, "w", grad, LEN, 3), FALCON_ERR_CONFIG);
    ok("falcon_worker_free", falcon_worker_free(w));
    ok("falcon_worker_free(NULL)", falcon_worker_free(NULL));
    if (failures == 0) printf("errors job: every error as expected (worker %u)\n", rank);
    return failures == 0 ? 0 : 1;
}

static int unreachable(const char *scheduler, const char *silent) {
    const char *names[] = {"w"};
    const uint64_t lens[] = {LEN};
    falcon_worker *w = NULL;
    expect("join from an environment with no role", falcon_join(names, lens, 1, &w),
           FALCON_ERR_CONFIG);
    expect("join with a negative worker count",
           falcon_join_with(scheduler, -2, 1, -1, "j", "t", names, lens, 1, &w),
           FALCON_ERR_ARGUMENT);
    expect("join with a scheduler address without a port",
           falcon_join_with("127.0.0.1", 1, 1, -1, "j", "t", names, lens, 1, &w),
           FALCON_ERR_CONFIG);
    expect("join a scheduler that is not there",
           falcon_join_with(scheduler, 1, 1, 0, "c-errors", "t0ken", names, lens, 1, &w),
           FALCON_ERR_PEER_GONE);
    if (silent != NULL) {
        expect("join a scheduler that never answers",
               falcon_join_with(silent, 1, 1, 0, "c-errors", "t0ken", names, lens, 1, &w),
               FALCON_ERR_PEER_GONE);
    }
    if (w != NULL) {
        fprintf(stderr, "a failed join handed out a worker\n");
        failures++;
    }
    if (failures == 0) printf("errors unreachable: every error as expected\n");
    return failures == 0 ? 0 : 1;
}

int main(int argc, char **argv) {
    if (argc == 2 && strcmp(argv[1], "job") == 0) return job();
    if ((argc == 3 || argc == 4) && strcmp(argv[1], "unreachable") == 0)
        return unreachable(argv[2], argc == 4 ? argv[3] : NULL);
    fprintf(stderr, "usage: %s job | unreachable HOST:PORT [SILENT_HOST:PORT]\n", argv[0]);
    return 2;
}
