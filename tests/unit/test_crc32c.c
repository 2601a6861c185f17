/* crc32c.c: known answers (the check value of the CRC catalogue and the
 * iSCSI vectors of RFC 3720 B.4), a CRC continued over pieces equal to the
 * CRC of the whole, and the table and instruction paths agreeing on every
 * length and alignment up to 300 bytes. */
#include <criterion/criterion.h>
#include <string.h>

#include "crc32c.h"

struct kat {
    const char *name;
    uint8_t data[48];
    size_t len;
    uint32_t want;
};

static struct kat kats[] = {
    {"check value \"123456789\"", "123456789", 9, 0xE3069283u},
    {"empty", "", 0, 0x00000000u},
    {"32 zero bytes", {0}, 32, 0x8A9136AAu},
    {"32 bytes of 0xff", {0}, 32, 0x62A8AB43u},
    {"32 ascending bytes 0..31", {0}, 32, 0x46DD794Eu},
    {"32 descending bytes 31..0", {0}, 32, 0x113FDB5Cu},
};

Test(crc32c, known_answers)
{
    memset(kats[3].data, 0xff, 32);
    for (int i = 0; i < 32; i++) {
        kats[4].data[i] = (uint8_t)i;
        kats[5].data[i] = (uint8_t)(31 - i);
    }
    for (size_t k = 0; k < sizeof(kats) / sizeof(kats[0]); k++) {
        cr_expect_eq(crc32c(kats[k].data, kats[k].len), kats[k].want, "%s: %08x", kats[k].name,
                     crc32c(kats[k].data, kats[k].len));
        cr_expect_eq(crc32c_extend_sw(0, kats[k].data, kats[k].len), kats[k].want, "%s (tables)",
                     kats[k].name);
    }
}

Test(crc32c, pieces_and_paths_agree)
{
    uint8_t buf[320];
    uint32_t x = 12345;
    for (size_t i = 0; i < sizeof(buf); i++) {
        x = x * 1103515245u + 12345u;
        buf[i] = (uint8_t)(x >> 16);
    }
    for (size_t off = 0; off < 8; off++) {
        for (size_t n = 0; n + off <= 300; n++) {
            uint32_t whole = crc32c(buf + off, n);
            cr_assert_eq(crc32c_extend_sw(0, buf + off, n), whole, "off %zu len %zu", off, n);
            size_t cut = n / 3;
            cr_assert_eq(crc32c_extend(crc32c(buf + off, cut), buf + off + cut, n - cut), whole,
                         "off %zu len %zu cut %zu", off, n, cut);
        }
    }
    cr_log_info("crc32c: %s", crc32c_hw() ? "SSE4.2 instruction" : "tables");
}
