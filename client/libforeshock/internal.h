#ifndef FSC_INTERNAL_H
#define FSC_INTERNAL_H

/* Shared by libforeshock's own files only; never installed. Functions
 * declared with FSC_HIDDEN stay out of libforeshock.so's exported ABI (they
 * remain linkable from the static library, which the unit tests use). */

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#define FSC_HIDDEN __attribute__((visibility("hidden")))

/* Writes a formatted message into err (errlen bytes, always terminated);
 * err may be NULL. Returns rc so callers can `return fsc_err(...)`. */
FSC_HIDDEN int fsc_err(char *err, size_t errlen, int rc, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* Milliseconds on CLOCK_MONOTONIC. */
FSC_HIDDEN int64_t fsc_now_ms(void);

/* Little-endian float32 bytes from host floats (n values, out has 4n bytes). */
FSC_HIDDEN void fsc_floats_to_le(const float *v, size_t n, uint8_t *out);

#endif
