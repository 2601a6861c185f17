#ifndef FORESHOCK_CRC32C_H
#define FORESHOCK_CRC32C_H

#include <stddef.h>
#include <stdint.h>

/* CRC-32C (Castagnoli, reflected polynomial 0x82F63B78, initial value and
 * final xor 0xFFFFFFFF): the check of the spool's records (spool.h).
 * crc32c("123456789") == 0xE3069283.
 *
 * crc32c_extend continues a CRC over more bytes: crc32c_extend(crc32c(a),
 * b) == crc32c(a followed by b); crc32c_extend(0, p, n) == crc32c(p, n).
 *
 * Two implementations, the same results: slicing-by-8 tables (any CPU), and
 * on x86-64 the SSE4.2 crc32 instruction, chosen once at the first call when
 * the CPU has it. Why the instruction: the writer thread checksums every
 * spooled frame before it writes it, and a 7B-like Gram report is 59 MB
 * per rank per step; the tables take ~40 ms for that on a 2 GHz core, the
 * instruction a few. Any thread (the choice is made under pthread_once). */
uint32_t crc32c(const void *p, size_t n);
uint32_t crc32c_extend(uint32_t crc, const void *p, size_t n);

/* The table implementation alone, for the test that compares the two. */
uint32_t crc32c_extend_sw(uint32_t crc, const void *p, size_t n);

/* 1 when crc32c uses the CPU's instruction. */
int crc32c_hw(void);

#endif
