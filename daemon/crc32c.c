/* CRC-32C: slicing-by-8 tables, and SSE4.2's crc32 on x86-64. See crc32c.h. */
#include "crc32c.h"

#include <pthread.h>
#include <string.h>

#define CRC32C_POLY 0x82F63B78u /* Castagnoli, bit-reflected */
#define CRC32C_SLICES 8

static uint32_t table[CRC32C_SLICES][256];
static pthread_once_t once = PTHREAD_ONCE_INIT;
static int use_hw;

static void init(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = c & 1 ? (c >> 1) ^ CRC32C_POLY : c >> 1;
        table[0][i] = c;
    }
    /* table[s][i]: i followed by s zero bytes. */
    for (int s = 1; s < CRC32C_SLICES; s++)
        for (int i = 0; i < 256; i++)
            table[s][i] = (table[s - 1][i] >> 8) ^ table[0][table[s - 1][i] & 0xff];
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    use_hw = __builtin_cpu_supports("sse4.2");
#endif
}

/* On the pre-inverted register (crc ^ 0xFFFFFFFF), like the instruction. */
static uint32_t sw_raw(uint32_t c, const uint8_t *p, size_t n)
{
    while (n && ((uintptr_t)p & 7)) {
        c = (c >> 8) ^ table[0][(c ^ *p++) & 0xff];
        n--;
    }
    while (n >= 8) {
        uint8_t b[8];
        memcpy(b, p, 8);
        uint32_t lo = c ^ ((uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 |
                           (uint32_t)b[3] << 24);
        c = table[7][lo & 0xff] ^ table[6][(lo >> 8) & 0xff] ^ table[5][(lo >> 16) & 0xff] ^
            table[4][lo >> 24] ^ table[3][b[4]] ^ table[2][b[5]] ^ table[1][b[6]] ^ table[0][b[7]];
        p += 8;
        n -= 8;
    }
    while (n--)
        c = (c >> 8) ^ table[0][(c ^ *p++) & 0xff];
    return c;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
__attribute__((target("sse4.2"))) static uint32_t hw_raw(uint32_t c, const uint8_t *p, size_t n)
{
    uint64_t c64 = c;
    while (n && ((uintptr_t)p & 7)) {
        c64 = __builtin_ia32_crc32qi((uint32_t)c64, *p++);
        n--;
    }
    while (n >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        c64 = __builtin_ia32_crc32di(c64, v);
        p += 8;
        n -= 8;
    }
    uint32_t c32 = (uint32_t)c64;
    while (n--)
        c32 = __builtin_ia32_crc32qi(c32, *p++);
    return c32;
}
#define HAVE_HW 1
#else
#define HAVE_HW 0
#endif

uint32_t crc32c_extend_sw(uint32_t crc, const void *p, size_t n)
{
    pthread_once(&once, init);
    return ~sw_raw(~crc, p, n);
}

uint32_t crc32c_extend(uint32_t crc, const void *p, size_t n)
{
    pthread_once(&once, init);
#if HAVE_HW
    if (use_hw)
        return ~hw_raw(~crc, p, n);
#endif
    return ~sw_raw(~crc, p, n);
}

uint32_t crc32c(const void *p, size_t n)
{
    return crc32c_extend(0, p, n);
}

int crc32c_hw(void)
{
    pthread_once(&once, init);
    return HAVE_HW && use_hw;
}
