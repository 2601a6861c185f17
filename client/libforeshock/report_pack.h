#ifndef FSC_REPORT_PACK_H
#define FSC_REPORT_PACK_H

/* Serializing a report into a replay-buffer entry (see wire.h for the body
 * format). Pure. */

#include <stddef.h>

#include "foreshock.h"
#include "foreshock.pb-c.h"
#include "internal.h"
#include "replay.h"

/* Serializes r into a new entry (*out, caller frees with free()) whose body
 * is the Report message without its seq field; seq is set to `seq`.
 * Returns 0, -EMSGSIZE when the serialized report exceeds max_bytes (checked
 * before allocating), -ENOMEM, or -EPROTO if protobuf-c did not write the
 * seq field first (never expected). r is not modified. Any thread that owns r. */
FSC_HIDDEN int fsc_report_pack(const fsc_report *r, uint64_t seq, size_t max_bytes,
                               struct fsc_entry **out);

/* The same for a Report message built elsewhere (fsc_submit_packed, a
 * recording): its seq field is ignored; the entry's seq is 0. */
FSC_HIDDEN int fsc_report_pack_msg(const Foreshock__Report *msg, size_t max_bytes,
                                   struct fsc_entry **out);

#endif
