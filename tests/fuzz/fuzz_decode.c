/* libFuzzer target: the daemon's frame decoder on arbitrary bytes.
 *
 * Input layout mirrors the wire: a 4-byte length prefix, then the body. The
 * prefix goes through decode_prefix() exactly as ingest does; the body is
 * whatever follows (truncated or longer than the prefix says, on purpose).
 * Any decoded frame is re-encoded, which exercises decode_encode() on
 * validated input. Crashes, leaks and sanitizer reports are the failures. */
#include <stdint.h>
#include <stdlib.h>

#include "decode.h"

#define FUZZ_MAX_FRAME_BYTES (1u << 20)

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct decode_limits lim;
    struct fs_err err;
    struct decode_info info;
    Foreshock__Frame *f = NULL;
    uint32_t len = 0;

    decode_limits_default(&lim, FUZZ_MAX_FRAME_BYTES);
    if (size < DECODE_PREFIX_BYTES)
        return 0;
    if (decode_prefix(data, &lim, &len, &err) != 0)
        return 0;
    size_t body = size - DECODE_PREFIX_BYTES;
    if (body > len)
        body = len;
    if (decode_frame(data + DECODE_PREFIX_BYTES, body, &lim, &f, &info, &err) == 0) {
        uint8_t *out = NULL;
        size_t outlen = 0;
        if (decode_encode(f, &out, &outlen) == 0)
            free(out);
        decode_frame_free(f);
    }
    return 0;
}
