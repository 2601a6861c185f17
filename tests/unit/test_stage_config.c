/* foreshockd's [detect "RULE"] configuration sections (detect_config_section
 * through config_section.set): overrides reach the rule table, errors name
 * the file, line and key. */
#include <criterion/criterion.h>
#include <errno.h>
#include <string.h>

#include "config.h"
#include "detect.h"
#include "detect_config.h"
#include "stage.h"

struct bad_case {
    const char *text;
    const char *want; /* substring of the message */
};

/* Sections whose keys another module parses (config_section.set): the
 * detector rules, as foreshockd registers them. */
Test(stage_config, detect_rule_sections)
{
    struct detect_rules rules;
    detect_rules_default(&rules);
    struct config_section sec;
    detect_config_section(&rules, &sec);
    const char *text = "detect_from_step = 50\n"
                       "[detect \"qk.d2.erank\"]\n"
                       "z = 4.5\n"
                       "persistence = 2\n"
                       "floor = none\n"
                       "[detect \"loss\"]\n"
                       "enabled = false\n"
                       "severity = critical\n"
                       "[detect \"weight_norm\"]\n"
                       "trend = false\n"
                       "[detect \"router.zloss\"]\n"
                       "trend = yes\n";
    struct fs_config cfg;
    config_defaults(&cfg);
    struct fs_err err = {0};
    cr_assert_eq(config_parse(text, strlen(text), "t", &cfg, &sec, 1, &err), 0, "%s", err.msg);
    cr_expect_eq(cfg.detect_from_step, 50);
    const struct detect_rule *r = detect_rules_find(&rules, "qk.d2.erank");
    cr_expect_eq(r->z, 4.5);
    cr_expect_eq(r->persistence, 2);
    cr_expect(!r->has_floor);
    r = detect_rules_find(&rules, "loss");
    cr_expect(!r->enabled);
    cr_expect_eq(r->severity, DETECT_SEVERITY_CRITICAL);
    r = detect_rules_find(&rules, "grad_norm");
    cr_expect(r->enabled, "an untouched rule changed");
    cr_expect(!detect_rules_find(&rules, "weight_norm")->trend);
    cr_expect(detect_rules_find(&rules, "router.zloss")->trend);
    cr_expect(detect_rules_find(&rules, "router.centered_energy")->trend, "untouched default");

    const struct bad_case bad[] = {
        {"[detect \"nope\"]\nz = 1",
         "config: t:1: section [detect \"nope\"]: unknown detector rule"},
        {"[detect]\nz = 1", "config: t:1: section [detect]: needs a rule name"},
        {"[detect \"loss\"]\n\nbogus = 1", "config: t:3: key 'bogus': "},
        {"[detect \"loss\"]\nz = -2", "config: t:2: key 'z': "},
        {"[detect \"loss\"]\nwindow = 100000", "config: t:2: key 'window': "},
        {"[detect \"loss\"]\nmax_runs = 3", "config: t:2: key 'max_runs': "},
        {"[detect \"loss\"]\ntrend = sometimes", "config: t:2: key 'trend': "},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        detect_rules_default(&rules);
        int rc = config_parse(bad[i].text, strlen(bad[i].text), "t", &cfg, &sec, 1, &err);
        cr_expect_eq(rc, -EINVAL, "'%s'", bad[i].text);
        cr_expect(strstr(err.msg, bad[i].want), "'%s': got '%s'", bad[i].text, err.msg);
    }
}
