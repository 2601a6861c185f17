#ifndef FORESHOCK_DETECT_CONFIG_H
#define FORESHOCK_DETECT_CONFIG_H

#include "config.h"
#include "detect.h"

/* The config section `[detect "RULE"]` (keys of detect_rules_set: warmup,
 * window, z, floor, ceiling, spike_ratio, persistence, resolve_after,
 * severity, enabled, trend) over rules, for config_load_file's extra sections.
 * An unknown rule or key is a config error naming file and line. */
void detect_config_section(struct detect_rules *rules, struct config_section *out);

#endif
