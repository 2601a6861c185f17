#ifndef FSC_WIRE_H
#define FSC_WIRE_H

/* Framing: a 4-byte big-endian length, then one serialized Frame. Pure.
 *
 * Reports are stored in the replay buffer as the bytes of their Report
 * message minus the leading seq field (field 1), so that the seq can be
 * chosen when the report is written to the socket (see fsc_open on seq
 * continuation). fsc_wire_report_header() produces the bytes that precede
 * such a body on the wire: length prefix, the Frame.report tag and length,
 * and the seq field. Fields in field-number order, as protobuf-c writes them,
 * so the result is exactly what packing the whole Frame would give. */

#include <stddef.h>
#include <stdint.h>

#include "foreshock.pb-c.h"
#include "internal.h"

/* Daemon-to-client frames are small (Welcome, Ack, Error). */
#define FSC_WIRE_MAX_INBOUND 65536
/* be32 + Frame.report tag + varint length + Report.seq tag + varint seq. */
#define FSC_WIRE_REPORT_HDR_MAX (4 + 1 + 10 + 1 + 10)
/* The largest frame body the length prefix can state. */
#define FSC_WIRE_MAX_FRAME UINT32_MAX

FSC_HIDDEN size_t fsc_wire_varint(uint64_t v, uint8_t *out);
FSC_HIDDEN void fsc_wire_put_be32(uint8_t *p, uint32_t v);
FSC_HIDDEN uint32_t fsc_wire_get_be32(const uint8_t *p);

/* Writes the header for a report body of body_len bytes with this seq into
 * hdr; returns the header length. The whole frame is hdr + body; its length
 * prefix counts everything after the first 4 bytes. body_len must be below
 * FSC_WIRE_MAX_FRAME - FSC_WIRE_REPORT_HDR_MAX. */
FSC_HIDDEN size_t fsc_wire_report_header(uint64_t seq, size_t body_len,
                                         uint8_t hdr[FSC_WIRE_REPORT_HDR_MAX]);

/* The body of a placeholder for a refused report whose body (the Report
 * without its seq field) is body/len: its step and, when set, time_unix,
 * and nothing else, so that its seq still reaches the daemon (seqs must
 * stay dense) while what the daemon refused does not. Writes at most
 * FSC_WIRE_PLACEHOLDER_MAX bytes to out; returns the length, or 0 when body
 * holds no step (not a body this library packed). */
#define FSC_WIRE_PLACEHOLDER_MAX (1 + 10 + 1 + 8)
FSC_HIDDEN size_t fsc_wire_report_placeholder(const uint8_t *body, size_t len,
                                              uint8_t out[FSC_WIRE_PLACEHOLDER_MAX]);

/* Packs f behind a length prefix into a new malloc'd buffer (*out, *len).
 * Returns 0, -ENOMEM or -EMSGSIZE. Caller frees *out. */
FSC_HIDDEN int fsc_wire_pack(const Foreshock__Frame *f, uint8_t **out, size_t *len);

/* Incremental reader of daemon frames. Append received bytes at
 * buf + len (at most sizeof(buf) - len), then call fsc_wire_next until it
 * returns 0. */
struct fsc_wire_reader {
    size_t len;
    uint8_t buf[4 + FSC_WIRE_MAX_INBOUND];
};

/* Returns 1 and *out (free with foreshock__frame__free_unpacked(*out, NULL))
 * when a complete frame was buffered, 0 when more bytes are needed, or
 * -EPROTO when the length is 0 or above FSC_WIRE_MAX_INBOUND or the frame
 * does not decode (the connection is then unusable). */
FSC_HIDDEN int fsc_wire_next(struct fsc_wire_reader *rd, Foreshock__Frame **out);

#endif
