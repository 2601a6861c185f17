/* libFuzzer target: the configuration file parser on arbitrary text, with
 * the daemon's own extra sections ([detect "RULE"], [target "NAME"],
 * [run "PATTERN"]).
 * Crashes, leaks and sanitizer reports are the failures; a text that parses
 * must also pass or fail config_check without crashing. */
#include <stdint.h>
#include <stdlib.h>

#include "config.h"
#include "detect.h"
#include "detect_config.h"
#include "pager.h"
#include "run_auth.h"
#include "stage.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static struct fs_config cfg;
    static struct detect_rules rules;
    static struct pager_config pc;
    static struct run_auth ra;
    struct config_section sections[3];
    struct fs_err err = {0};

    if (size > FS_CONFIG_MAX_FILE_BYTES)
        return 0;
    config_defaults(&cfg);
    detect_rules_default(&rules);
    pc = (struct pager_config){0};
    detect_config_section(&rules, &sections[0]);
    pager_target_section(&pc, &sections[1]);
    ra = (struct run_auth){0};
    run_auth_section(&ra, &sections[2]);
    if (config_parse((const char *)data, size, "fuzz", &cfg, sections, 3, &err) == 0) {
        (void)config_check(&cfg, "fuzz", &err);
        (void)pager_config_check(&pc, &err);
    }
    return 0;
}
