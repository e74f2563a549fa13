/* check.h - the C tests' one assertion: CHECK counts a pass or prints the failure and counts it
 * (thread-safe), OK checks for CMLP_OK, and check_summary prints "N passed, N failed" and gives
 * the exit status. */
#ifndef CMLP_TEST_CHECK_H
#define CMLP_TEST_CHECK_H

#include <stdatomic.h>
#include <stdio.h>

static atomic_int passed, failed;

#define CHECK(cond, ...)                                           \
    do {                                                           \
        if (cond) {                                                \
            atomic_fetch_add(&passed, 1);                          \
        } else {                                                   \
            atomic_fetch_add(&failed, 1);                          \
            printf("FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
            printf(__VA_ARGS__);                                   \
            printf("\n");                                          \
        }                                                          \
    } while (0)

#define OK(expr) CHECK((expr) == CMLP_OK, "%s", cmlp_last_error())

static inline int check_summary(void) {
    printf("%d passed, %d failed\n", atomic_load(&passed), atomic_load(&failed));
    return atomic_load(&failed) ? 1 : 0;
}

#endif /* CMLP_TEST_CHECK_H */
