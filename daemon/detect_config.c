/* foreshockd's [detect "RULE"] configuration section: the rule named in the
 * section header, its keys parsed by detect_rules_set. */
#include "detect_config.h"

#include <errno.h>

#include "fs_err.h"

static void *detect_open(void *ctx, const char *sub, struct fs_err *why)
{
    if (!sub || !sub[0]) {
        fs_err_set(why, -EINVAL, "needs a rule name: [detect \"RULE\"]");
        return NULL;
    }
    struct detect_rule *rule = detect_rules_find(ctx, sub);
    if (!rule)
        fs_err_set(why, -EINVAL, "unknown detector rule '%s'", sub);
    return rule;
}

static int detect_set(void *ctx, void *target, const char *key, const char *value,
                      struct fs_err *why)
{
    const struct detect_rule *rule = target;
    return detect_rules_set(ctx, rule->name, key, value, why) < 0 ? -EINVAL : 0;
}

void detect_config_section(struct detect_rules *rules, struct config_section *out)
{
    *out = (struct config_section){
        .name = "detect", .open = detect_open, .set = detect_set, .ctx = rules};
}
