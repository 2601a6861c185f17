/* Reconnect backoff (see backoff.h). Pure. */
#include "backoff.h"

uint64_t fsc_rand_next(uint64_t *state)
{
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);

    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

unsigned fsc_backoff_delay(unsigned attempt, unsigned min_ms, unsigned max_ms, uint64_t *rng)
{
    uint64_t base = min_ms;
    uint64_t half;

    if (attempt == 0)
        return 0;
    for (unsigned i = 1; i < attempt && base < max_ms; i++)
        base *= 2;
    if (base > max_ms)
        base = max_ms;
    half = base / 2;
    return (unsigned)(half + fsc_rand_next(rng) % (base - half + 1));
}
