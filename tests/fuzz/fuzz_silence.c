/* libFuzzer target: silence matchers (the JSON array the API and the
 * silences table hold, PCRE2 regexes included) on arbitrary bytes: parse,
 * match against a fixed alert's labels, write back, parse the written form
 * again. Crashes, leaks, sanitizer reports and an unbounded regex are the
 * failures (PCRE2's limits in silence.h bound compile and match). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "silence.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static struct silence s, again;
    static char out[SILENCE_MAX_JSON + 1];
    static const struct silence_label labels[] = {
        {"alertname", "qk.d2.srank"},          {"run", "gpt-7b.r3"}, {"severity", "warning"},
        {"attribution", "attention-numerics"}, {"layer", "12"},      {"window", "25"},
    };
    struct fs_err why = {0};

    if (size > SILENCE_MAX_JSON + 16)
        return 0;
    if (silence_parse((const char *)data, size, &s, &why) != 0)
        return 0;
    s.starts_at = 0;
    s.ends_at = 1e12;
    (void)silence_matches(&s, labels, sizeof(labels) / sizeof(labels[0]), 1.7e9);
    if (silence_matchers_json(&s, out, sizeof(out)) == 0) {
        /* The canonical form of a valid silence is itself valid. */
        if (silence_parse(out, strlen(out), &again, &why) != 0)
            abort();
        silence_free(&again);
    }
    silence_free(&s);
    return 0;
}
