/* Unit tests for daemon/rewind.c's pure part: what a rewind to step 300
 * does to one alert, given its live state and the state rebuilt at 300. */
#include <criterion/criterion.h>

#include "alert.h"
#include "rewind.h"

#define STEP 300

static struct alert_state st(int state, int64_t first_breach, int64_t fired)
{
    struct alert_state a;
    alert_state_init(&a);
    a.state = (uint8_t)state;
    a.first_breach_step = first_breach;
    a.fired_step = fired;
    a.incidents = fired >= 0;
    return a;
}

static const struct {
    const char *what;
    int old_state;
    int64_t old_first, old_fired;
    int new_state;
    int64_t new_first, new_fired;
    enum rewind_fate fate;
    int row_state;
} cases[] = {
    {"firing, opened after the step", ALERT_FIRING, 310, 320, ALERT_INACTIVE, -1, -1,
     REWIND_SUPERSEDE, ALERT_SUPERSEDED},
    {"pending, opened after the step", ALERT_PENDING, 305, -1, ALERT_INACTIVE, -1, -1,
     REWIND_SUPERSEDE, ALERT_SUPERSEDED},
    {"firing after, an older incident open at the step", ALERT_FIRING, 310, 320, ALERT_FIRING, 200,
     210, REWIND_SUPERSEDE, ALERT_FIRING},
    {"firing since before the step, rebuilt the same", ALERT_FIRING, 290, 295, ALERT_FIRING, 290,
     295, REWIND_ROW, ALERT_FIRING},
    {"firing since before, lost by the replay (stored as absent)", ALERT_FIRING, 290, 290,
     ALERT_INACTIVE, -1, -1, REWIND_CONTINUE, ALERT_FIRING},
    {"resolved after the step: keeps showing resolved", ALERT_RESOLVED, 310, 320, ALERT_INACTIVE,
     -1, -1, REWIND_ROW, ALERT_RESOLVED},
    {"resolved after, open at the step in the replay", ALERT_RESOLVED, 290, 295, ALERT_FIRING, 290,
     295, REWIND_ROW, ALERT_FIRING},
    {"inactive, unchanged", ALERT_INACTIVE, -1, -1, ALERT_INACTIVE, -1, -1, REWIND_KEEP,
     ALERT_INACTIVE},
    {"opened at the step, fired after: pending again, as it was then", ALERT_FIRING, STEP, 305,
     ALERT_PENDING, STEP, -1, REWIND_ROW, ALERT_PENDING},
};

Test(rewind, fates)
{
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        struct alert_state o = st(cases[i].old_state, cases[i].old_first, cases[i].old_fired);
        struct alert_state n = st(cases[i].new_state, cases[i].new_first, cases[i].new_fired);
        enum rewind_fate f = rewind_fate(&o, &n, STEP);
        cr_expect_eq(f, cases[i].fate, "%s: fate %d", cases[i].what, f);
        cr_expect_eq(rewind_row_state(f, &o, &n), cases[i].row_state, "%s: row state %d",
                     cases[i].what, rewind_row_state(f, &o, &n));
    }
}

Test(rewind, time_entered_is_not_a_difference)
{
    struct alert_state o = st(ALERT_RESOLVED, 100, 110), n = o;
    o.since = 1.7e9;
    n.since = 0; /* a replay has no clock */
    cr_expect_eq(rewind_fate(&o, &n, STEP), REWIND_KEEP);
    n.normal_run = 1;
    cr_expect_eq(rewind_fate(&o, &n, STEP), REWIND_ROW);
}
