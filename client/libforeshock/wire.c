/* Framing and the report header (see wire.h). Pure. */
#include "wire.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

size_t fsc_wire_varint(uint64_t v, uint8_t *out)
{
    size_t n = 0;

    while (v >= 0x80) {
        out[n++] = (uint8_t)(v | 0x80);
        v >>= 7;
    }
    out[n++] = (uint8_t)v;
    return n;
}

void fsc_wire_put_be32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)(v >> 24);
    p[1] = (uint8_t)(v >> 16);
    p[2] = (uint8_t)(v >> 8);
    p[3] = (uint8_t)v;
}

uint32_t fsc_wire_get_be32(const uint8_t *p)
{
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

/* Tags: (field number << 3) | wire type. */
#define TAG_FRAME_REPORT ((3u << 3) | 2u) /* Frame.report, length-delimited */
#define TAG_REPORT_SEQ ((1u << 3) | 0u)   /* Report.seq, varint */

size_t fsc_wire_report_header(uint64_t seq, size_t body_len, uint8_t hdr[FSC_WIRE_REPORT_HDR_MAX])
{
    uint8_t seqf[11];
    size_t seqf_len, n = 4;
    uint64_t report_len;

    seqf[0] = TAG_REPORT_SEQ;
    seqf_len = 1 + fsc_wire_varint(seq, seqf + 1);
    report_len = (uint64_t)seqf_len + body_len;
    hdr[n++] = TAG_FRAME_REPORT;
    n += fsc_wire_varint(report_len, hdr + n);
    memcpy(hdr + n, seqf, seqf_len);
    n += seqf_len;
    fsc_wire_put_be32(hdr, (uint32_t)(n - 4 + body_len));
    return n;
}

#define TAG_REPORT_STEP ((2u << 3) | 0u) /* Report.step, varint */
#define TAG_REPORT_TIME ((3u << 3) | 1u) /* Report.time_unix, 64-bit */

size_t fsc_wire_report_placeholder(const uint8_t *body, size_t len,
                                   uint8_t out[FSC_WIRE_PLACEHOLDER_MAX])
{
    size_t i = 0, n = 0;
    int step = 0;

    /* Fields in number order (protobuf-c), so step and time come first. */
    while (i < len && (body[i] == TAG_REPORT_STEP || body[i] == TAG_REPORT_TIME)) {
        size_t start = i++;
        if (body[start] == TAG_REPORT_TIME) {
            if (len - i < 8 || n + 9 > FSC_WIRE_PLACEHOLDER_MAX)
                return 0;
            i += 8;
        } else {
            while (i < len && (body[i] & 0x80) && i - start < 10)
                i++;
            if (i >= len || (body[i] & 0x80) || n + (i + 1 - start) > FSC_WIRE_PLACEHOLDER_MAX)
                return 0;
            i++;
            step = 1;
        }
        memcpy(out + n, body + start, i - start);
        n += i - start;
    }
    return step ? n : 0;
}

int fsc_wire_pack(const Foreshock__Frame *f, uint8_t **out, size_t *len)
{
    size_t n = foreshock__frame__get_packed_size(f);
    uint8_t *buf;

    if (n > FSC_WIRE_MAX_FRAME)
        return -EMSGSIZE;
    buf = malloc(4 + n);
    if (!buf)
        return -ENOMEM;
    fsc_wire_put_be32(buf, (uint32_t)n);
    foreshock__frame__pack(f, buf + 4);
    *out = buf;
    *len = 4 + n;
    return 0;
}

int fsc_wire_next(struct fsc_wire_reader *rd, Foreshock__Frame **out)
{
    uint32_t n;
    Foreshock__Frame *f;

    if (rd->len < 4)
        return 0;
    n = fsc_wire_get_be32(rd->buf);
    if (n == 0 || n > FSC_WIRE_MAX_INBOUND)
        return -EPROTO;
    if (rd->len - 4 < n)
        return 0;
    f = foreshock__frame__unpack(NULL, n, rd->buf + 4);
    if (!f)
        return -EPROTO;
    rd->len -= 4 + n;
    memmove(rd->buf, rd->buf + 4 + n, rd->len);
    *out = f;
    return 1;
}
