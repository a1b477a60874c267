/* The CPU build of lane rANS (lane_rans.h): loops over lanes where the GPU runs a thread per
 * lane, ILV of them interleaved symbol by symbol. Built at first use by codec/rans.py
 * (cc -O2 -shared) and called through ctypes. */
#include <stdint.h>
#include <string.h>

#define RANS_FN static inline
#include "lane_rans.h"

/* Up to ILV lanes of equal rows decode together, a symbol of each in turn: one lane's symbols
 * form a chain (each needs the state the last left), ~20 cycles apiece on the CPU; the chains
 * of ILV lanes overlap: a 256-token SmolLM2 `high` chunk's entropy decode took 16.3 ms where
 * one lane at a time took 19.7 (4, 8, 12 or 16 lanes alike; -O3 no better). The same
 * rans_decode_symbol as one lane at a time, so the same symbols.
 * Returns RANS_OK, or nonzero where some lane failed (the caller then decodes the group lane
 * by lane, to name the first failing lane as the serial decoder does). */
#define ILV 8

static int decode_group(uint32_t n, const uint16_t *words, const int64_t *word_start,
                        const uint32_t *comp_start, const uint32_t *rows, const uint32_t *comp_model,
                        const int64_t *out_off, const uint32_t *cum, const uint32_t *cum_off,
                        const uint16_t *bucket, int32_t *out)
{
    uint32_t x[ILV], p[ILV], nw[ILV], nc[ILV], maxc = 0;
    const uint16_t *w[ILV];
    const uint32_t *cmod[ILV];
    const int64_t *ooff[ILV];
    const uint32_t *cm[ILV];
    const uint16_t *bk[ILV];
    int32_t *o[ILV];
    uint32_t r = rows[0];
    for (uint32_t j = 0; j < n; j++) {
        int64_t w0 = word_start[j], w1 = word_start[j + 1];
        if (rows[j] != r || w1 < w0 + 2 || w1 - w0 > 0xFFFFFFFFll)
            return RANS_E_WORDS;
        w[j] = words + w0;
        nw[j] = (uint32_t)(w1 - w0);
        x[j] = (uint32_t)w[j][0] | ((uint32_t)w[j][1] << 16);
        p[j] = 2;
        cmod[j] = comp_model + comp_start[j];
        ooff[j] = out_off + comp_start[j];
        nc[j] = comp_start[j + 1] - comp_start[j];
        if (nc[j] > maxc)
            maxc = nc[j];
    }
    int err = RANS_OK;
    for (uint32_t c = 0; c < maxc; c++) {
        uint32_t k = 0;  /* the lanes with a component c, moved to the front */
        uint32_t lane[ILV];
        for (uint32_t j = 0; j < n; j++) {
            if (c >= nc[j])
                continue;
            uint32_t m = cmod[j][c];
            cm[k] = cum + cum_off[m];
            bk[k] = bucket + (uint64_t)m * RANS_BUCKETS;
            o[k] = out + ooff[j][c];
            lane[k++] = j;
        }
        uint32_t xs[ILV], ps[ILV], nws[ILV];
        const uint16_t *ws[ILV];
        for (uint32_t q = 0; q < k; q++) {
            xs[q] = x[lane[q]];
            ps[q] = p[lane[q]];
            nws[q] = nw[lane[q]];
            ws[q] = w[lane[q]];
        }
        for (uint32_t i = 0; i < r; i++) {
            for (uint32_t q = 0; q < k; q++)
                o[q][i] = (int32_t)rans_decode_symbol(&xs[q], cm[q], bk[q], ws[q], &ps[q], nws[q], &err);
            if (err)
                return err;
        }
        for (uint32_t q = 0; q < k; q++) {
            x[lane[q]] = xs[q];
            p[lane[q]] = ps[q];
        }
    }
    for (uint32_t j = 0; j < n; j++)
        if (x[j] != RANS_L || p[j] != nw[j])
            return RANS_E_END;
    return RANS_OK;
}

/* Decode lanes 0..n_lanes-1. Lane l: words[word_start[l] .. word_start[l+1]), components
 * comp_start[l] .. comp_start[l+1] of comp_model/out_off, rows[l] symbols each.
 * Returns RANS_OK, or the error of the first failing lane with its index in *bad_lane. */
int lane_rans_decode(uint32_t n_lanes, const uint16_t *words, const int64_t *word_start,
                     const uint32_t *comp_start, const uint32_t *rows, const uint32_t *comp_model,
                     const int64_t *out_off, const uint32_t *cum, const uint32_t *cum_off,
                     const uint16_t *bucket, const uint32_t *alphabet, int32_t *out, int64_t *bad_lane)
{
    for (uint32_t g = 0; g < n_lanes; g += ILV) {
        uint32_t n = n_lanes - g < ILV ? n_lanes - g : ILV;
        if (decode_group(n, words, word_start + g, comp_start + g, rows + g, comp_model, out_off, cum, cum_off,
                         bucket, out) == RANS_OK)
            continue;
        for (uint32_t l = g; l < g + n; l++) {  /* a group that failed, lane by lane: which lane, and why */
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
