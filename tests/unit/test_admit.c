/* Admission of ingest connections (daemon/admit.c): the policy's verdict
 * for each situation, and the per-address table it counts with
 * (including deletion in probe chains, checked against a plain array). */
#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <errno.h>
#include <netinet/in.h>
#include <string.h>

#include "admit.h"
#include "fstest.h"

/* max_connections 100, max_unauthenticated 20, per address 8. */
static const struct admit_limits LIMITS = {100, 20, 8};

static const struct {
    const char *what;
    struct admit_counts n; /* connections, unauthenticated, address, heaviest */
    enum admit_verdict want;
} decide_cases[] = {
    {"empty daemon", {0, 0, 0, 0}, ADMIT_ACCEPT},
    {"room everywhere", {50, 10, 3, 5}, ADMIT_ACCEPT},
    {"address at its share", {50, 10, 8, 8}, ADMIT_REFUSE_ADDRESS},
    {"address at its share, daemon full", {100, 20, 8, 8}, ADMIT_REFUSE_ADDRESS},
    {"last unauthenticated slot", {50, 19, 7, 7}, ADMIT_ACCEPT},
    {"last connection slot", {99, 5, 0, 2}, ADMIT_ACCEPT},
    /* the lock-out: a flood from one address holds the budget */
    {"flood holds the budget, trainer from elsewhere", {30, 20, 0, 8}, ADMIT_EVICT},
    {"flood holds the budget, flood again", {30, 20, 7, 7}, ADMIT_REFUSE_UNAUTHENTICATED},
    {"second address lighter than the heaviest", {30, 20, 3, 7}, ADMIT_EVICT},
    {"equal shares refuse (no ping-pong)", {30, 20, 4, 4}, ADMIT_REFUSE_UNAUTHENTICATED},
    {"one each from many addresses, a new one", {30, 20, 0, 1}, ADMIT_EVICT},
    /* every slot taken */
    {"all slots authenticated", {100, 0, 0, 0}, ADMIT_REFUSE_FULL},
    {"full, some strangers, trainer", {100, 5, 0, 5}, ADMIT_EVICT},
    {"full, the strangers are its own address", {100, 5, 5, 5}, ADMIT_REFUSE_UNAUTHENTICATED},
    {"over the limit after a reload", {120, 0, 0, 0}, ADMIT_REFUSE_FULL},
};

Test(admit, decide_table)
{
    for (size_t i = 0; i < sizeof(decide_cases) / sizeof(decide_cases[0]); i++)
        cr_expect_eq(admit_decide(&LIMITS, &decide_cases[i].n), decide_cases[i].want,
                     "case %zu (%s): verdict %d, want %d", i, decide_cases[i].what,
                     admit_decide(&LIMITS, &decide_cases[i].n), decide_cases[i].want);
}

Test(admit, reasons_name_the_limit)
{
    cr_expect_str_eq(admit_reason(ADMIT_REFUSE_FULL), "max_connections");
    cr_expect_str_eq(admit_reason(ADMIT_REFUSE_ADDRESS), "per_address");
    cr_expect_str_eq(admit_reason(ADMIT_REFUSE_UNAUTHENTICATED), "unauthenticated");
    cr_expect_str_eq(admit_reason(ADMIT_ACCEPT), "");
}

static struct admit_addr v4(const char *s)
{
    struct sockaddr_in sa = {.sin_family = AF_INET};
    cr_assert_eq(inet_pton(AF_INET, s, &sa.sin_addr), 1);
    struct admit_addr a;
    cr_assert_eq(admit_addr_from((struct sockaddr *)&sa, &a), 0);
    return a;
}

Test(admit, ipv4_is_counted_as_its_mapped_ipv6_form)
{
    struct sockaddr_in6 sa6 = {.sin6_family = AF_INET6};
    cr_assert_eq(inet_pton(AF_INET6, "::ffff:10.1.2.3", &sa6.sin6_addr), 1);
    struct admit_addr a6, a4 = v4("10.1.2.3");
    cr_assert_eq(admit_addr_from((struct sockaddr *)&sa6, &a6), 0);
    cr_expect_eq(memcmp(&a4, &a6, sizeof(a4)), 0);
    struct sockaddr other = {.sa_family = AF_UNIX};
    cr_expect_eq(admit_addr_from(&other, &a4), -EAFNOSUPPORT);
}

Test(admit, table_counts_per_address)
{
    struct admit_table t;
    cr_assert_eq(admit_table_init(&t, 4), 0);
    struct admit_addr a = v4("127.0.0.1"), b = v4("127.0.0.2");
    cr_expect_eq(admit_table_heaviest(&t), 0);
    for (int i = 0; i < 3; i++)
        cr_assert_eq(admit_table_add(&t, &a), 0);
    cr_assert_eq(admit_table_add(&t, &b), 0);
    cr_expect_eq(admit_table_count(&t, &a), 3);
    cr_expect_eq(admit_table_count(&t, &b), 1);
    cr_expect_eq(admit_table_heaviest(&t), 3);
    admit_table_remove(&t, &a);
    admit_table_remove(&t, &b);
    admit_table_remove(&t, &b); /* not there any more: ignored */
    cr_expect_eq(admit_table_count(&t, &a), 2);
    cr_expect_eq(admit_table_count(&t, &b), 0);
    cr_expect_eq(t.entries, 1);
    admit_table_free(&t);
}

Test(admit, table_refuses_a_new_address_past_its_capacity)
{
    struct admit_table t;
    cr_assert_eq(admit_table_init(&t, 2), 0);
    struct admit_addr a = v4("10.0.0.1"), b = v4("10.0.0.2"), c = v4("10.0.0.3");
    cr_assert_eq(admit_table_add(&t, &a), 0);
    cr_assert_eq(admit_table_add(&t, &b), 0);
    cr_expect_eq(admit_table_add(&t, &c), -ENOSPC);
    cr_expect_eq(admit_table_add(&t, &a), 0); /* a known address still counts */
    admit_table_remove(&t, &b);
    cr_expect_eq(admit_table_add(&t, &c), 0);
    admit_table_free(&t);
}

/* Random adds and removes over 64 addresses in a 16-entry table (32 slots:
 * long probe chains that wrap), against a plain array of counts. */
Test(admit, table_matches_a_plain_count_under_churn)
{
    enum { ADDRS = 64, ENTRIES = 16 };
    struct admit_table t;
    cr_assert_eq(admit_table_init(&t, ENTRIES), 0);
    uint64_t want[ADDRS] = {0};
    size_t distinct = 0;
    uint64_t seed = 22;
    for (int step = 0; step < 200000; step++) {
        uint64_t rng = rng_next(&seed);
        unsigned k = (unsigned)(rng >> 33) % ADDRS;
        struct admit_addr a;
        memset(&a, 0, sizeof(a));
        a.b[15] = (uint8_t)k;
        a.b[3] = (uint8_t)(k * 37); /* spread the hashes less evenly than the index */
        if ((rng >> 20) & 1) {
            int rc = admit_table_add(&t, &a);
            if (want[k] == 0 && distinct == ENTRIES) {
                cr_assert_eq(rc, -ENOSPC, "step %d", step);
            } else {
                cr_assert_eq(rc, 0, "step %d", step);
                distinct += want[k] == 0;
                want[k]++;
            }
        } else {
            admit_table_remove(&t, &a);
            if (want[k]) {
                want[k]--;
                distinct -= want[k] == 0;
            }
        }
        cr_assert_eq(admit_table_count(&t, &a), want[k], "step %d address %u", step, k);
    }
    uint64_t most = 0;
    for (unsigned k = 0; k < ADDRS; k++) {
        struct admit_addr a;
        memset(&a, 0, sizeof(a));
        a.b[15] = (uint8_t)k;
        a.b[3] = (uint8_t)(k * 37);
        cr_expect_eq(admit_table_count(&t, &a), want[k], "address %u", k);
        most = want[k] > most ? want[k] : most;
    }
    cr_expect_eq(admit_table_heaviest(&t), most);
    cr_expect_eq(t.entries, distinct);
    admit_table_free(&t);
}
