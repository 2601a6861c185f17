/* libFuzzer target: the HTTP API's parsers of client-controlled text, on
 * arbitrary bytes: the Authorization header, durations, times, integers
 * (query parameters) and the silence request body. The first byte picks
 * the parser; the rest is its input (NUL-terminated for the string
 * parsers, as libmicrohttpd hands them over). Crashes, leaks and sanitizer
 * reports are the failures; a successful parse must also round-trip what
 * it promises (a formatted time parses back). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "http_internal.h"
#include "http_parse.h"

#define FUZZ_MAX_INPUT (64u << 10)

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1 || size > FUZZ_MAX_INPUT)
        return 0;
    char *s = malloc(size);
    if (!s)
        return 0;
    memcpy(s, data + 1, size - 1);
    s[size - 1] = '\0';
    switch (data[0] % 5) {
    case 0: {
        const char *tok;
        size_t len;
        if (http_bearer_parse(s, &tok, &len) == 0 && (tok < s || tok + len > s + size - 1))
            abort(); /* the token must point into the header */
        break;
    }
    case 1: {
        double d;
        if (http_duration_parse(s, &d) == 0 && !(d > 0))
            abort();
        break;
    }
    case 2: {
        double t;
        char out[64];
        if (http_time_parse(s, &t) == 0 && http_time_format(t, out, sizeof(out)) == 0) {
            double back;
            if (http_time_parse(out, &back) != 0)
                abort(); /* what we format, we parse */
        }
        break;
    }
    case 3: {
        int64_t v;
        (void)http_parse_int64(s, &v);
        break;
    }
    default: {
        static struct silence_req req;
        struct fs_err why = {0};
        /* Bytes, not a C string: the body may hold NULs. */
        (void)http_silence_req_parse((const char *)data + 1, size - 1, NULL, 1.7e9, &req, &why);
        (void)http_silence_req_parse((const char *)data + 1, size - 1, "run-1", 1.7e9, &req, &why);
        break;
    }
    }
    free(s);
    return 0;
}
