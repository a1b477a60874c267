/* The CPU build of lane rANS (lane_rans.h): loops over lanes where the GPU runs a thread per
 * lane. Built at first use by codec/rans.py (cc -O2 -shared) and called through ctypes. */
#include <stdint.h>
#include <string.h>

#define RANS_FN static inline
#include "lane_rans.h"

/* Decode lanes 0..n_lanes-1. Lane l: words[word_start[l] .. word_start[l+1]), components
 * comp_start[l] .. comp_start[l+1] of comp_model/out_off, rows[l] symbols each.
 * Returns RANS_OK, or the error of the first failing lane with its index in *bad_lane. */
int lane_rans_decode(uint32_t n_lanes, const uint16_t *words, const int64_t *word_start,
                     const uint32_t *comp_start, const uint32_t *rows, const uint32_t *comp_model,
                     const int64_t *out_off, const uint32_t *cum, const uint32_t *cum_off,
                     const uint16_t *bucket, const uint32_t *alphabet, int32_t *out, int64_t *bad_lane)
{
    for (uint32_t l = 0; l < n_lanes; l++) {
        int64_t w0 = word_start[l], w1 = word_start[l + 1];
        if (w1 < w0 || w1 - w0 > 0xFFFFFFFFll) {
            *bad_lane = l;
            return RANS_E_WORDS;
        }
        uint32_t c0 = comp_start[l];
        int err = rans_decode_lane(words + w0, (uint32_t)(w1 - w0), comp_model + c0, out_off + c0,
                                   comp_start[l + 1] - c0, rows[l], cum, cum_off, bucket, alphabet, out);
        if (err) {
            *bad_lane = l;
            return err;
        }
    }
    return RANS_OK;
}

/* Encode lanes laid out as for decoding; lane l's words go to words + word_start[l], where the
 * caller reserved word_start[l+1] - word_start[l] >= 2 + its symbol count. The words each lane
 * used are written to used[l]; lanes are left where they are (the caller packs them).
 * scratch: room for the largest lane's reservation. */
int lane_rans_encode(uint32_t n_lanes, const int32_t *sym, const int64_t *word_start,
                     const uint32_t *comp_start, const uint32_t *rows, const uint32_t *comp_model,
                     const int64_t *out_off, const uint32_t *cum, const uint32_t *cum_off,
                     const uint32_t *alphabet, uint16_t *words, uint16_t *scratch, int64_t *used)
{
    for (uint32_t l = 0; l < n_lanes; l++) {
        uint32_t c0 = comp_start[l];
        uint32_t cap = (uint32_t)(word_start[l + 1] - word_start[l]);
        int64_t n = rans_encode_lane(sym, comp_model + c0, out_off + c0, comp_start[l + 1] - c0, rows[l],
                                     cum, cum_off, alphabet, scratch, cap);
        if (n < 0)
            return (int)n;
        memcpy(words + word_start[l], scratch + (cap - n), (size_t)n * sizeof(uint16_t));
        used[l] = n;
    }
    return RANS_OK;
}
