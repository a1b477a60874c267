/* Lane rANS: the entropy coder of kvstreamd's levels, one source for two compilers.
 *
 * The CPU library (codec/lane_rans.c, built with cc) and the CUDA kernels (codec/gpu.py,
 * built with NVRTC) both compile this file, so the logic the GPU runs is the logic every CI
 * run tests on the CPU. codec/rans.py holds a third, independent implementation in NumPy,
 * vectorised across lanes (each array element one GPU thread), checked against this one.
 *
 * A lane is a run of whole components (each `rows` symbols, component-major) coded with one
 * rANS state into its own stream of 16-bit words; lanes of a chunk decode independently, one
 * GPU thread each. State: 32 bits, kept in [2^16, 2^32); probabilities: 16-bit integers
 * (cum[A] = 2^16, every symbol >= 1); renormalisation: at most one 16-bit word per symbol.
 * A lane's stream starts with the final encoder state (low word, high word); the encoder
 * starts from RANS_L, so a decoder that does not end in RANS_L with every word used has been
 * fed a damaged stream or the wrong model.
 *
 * Symbol lookup: the 256 top-byte buckets of a model give the symbol at each bucket's start;
 * a short forward scan of the model's cumulative table finishes the search. Any search that
 * finds the s with cum[s] <= slot < cum[s+1] decodes the same symbols.
 *
 * The includer defines RANS_FN (function qualifiers) and, where <stdint.h> is not there,
 * the fixed-width integer types. What the decoder writes is RANS_OUT_T, made from symbol s
 * of a model with alphabet a by RANS_STORE(s, a): by default the int32 symbol index; the GPU
 * build also has a variant that writes the dequantizer's input (the signed value as a float,
 * NaN for the escape symbol, whose raw value the caller fills in).
 */
#ifndef LANE_RANS_H
#define LANE_RANS_H

#define RANS_PROB_BITS 16
#define RANS_L (1u << 16)
#define RANS_SLOT_MASK 0xFFFFu
#define RANS_BUCKET_SHIFT 8
#define RANS_BUCKETS 256

#ifndef RANS_OUT_T
#define RANS_OUT_T int32_t
#define RANS_STORE(s, a) ((void)(a), (int32_t)(s))
#endif

/* Errors, as the decoder returns them. */
#define RANS_OK 0
#define RANS_E_WORDS (-1)   /* the lane needs more words than its stream holds */
#define RANS_E_END (-2)     /* the lane did not end in the encoder's initial state */
#define RANS_E_SYMBOL (-3)  /* (encoder) a symbol outside its model's alphabet */
#define RANS_E_SPACE (-4)   /* (encoder) the output buffer is too small */

/* One symbol of a lane: from state *x, model m (cum + its offset, bucket row), reading a
 * renormalisation word from w[*p] if the state needs one. Returns the symbol. */
RANS_FN uint32_t rans_decode_symbol(uint32_t *x, const uint32_t *cm, const uint16_t *bk,
                                    const uint16_t *w, uint32_t *p, uint32_t nw, int *err)
{
    uint32_t slot = *x & RANS_SLOT_MASK;
    uint32_t s = bk[slot >> RANS_BUCKET_SHIFT];
    while (cm[s + 1] <= slot)
        s++;
    uint32_t lo = cm[s];
    uint32_t y = (cm[s + 1] - lo) * (*x >> RANS_PROB_BITS) + slot - lo;
    if (y < RANS_L) {
        if (*p >= nw) {
            *err = RANS_E_WORDS;
            return s;
        }
        y = (y << 16) | w[(*p)++];
    }
    *x = y;
    return s;
}

/* Decode one lane: its n_comps components, component c with model comp_model[c], written
 * (RANS_STORE) to out[out_off[c] + i], i < rows. w holds the lane's nw words. cum: every
 * model's cumulative table, model m's at cum + cum_off[m] (alphabet[m] + 1 entries); bucket:
 * RANS_BUCKETS entries per model. */
RANS_FN int rans_decode_lane(const uint16_t *w, uint32_t nw, const uint32_t *comp_model,
                             const int64_t *out_off, uint32_t n_comps, uint32_t rows,
                             const uint32_t *cum, const uint32_t *cum_off, const uint16_t *bucket,
                             const uint32_t *alphabet, RANS_OUT_T *out)
{
    if (nw < 2)
        return RANS_E_WORDS;
    uint32_t x = (uint32_t)w[0] | ((uint32_t)w[1] << 16);
    uint32_t p = 2;
    int err = RANS_OK;
    for (uint32_t c = 0; c < n_comps; c++) {
        uint32_t m = comp_model[c];
        const uint32_t *cm = cum + cum_off[m];
        const uint16_t *bk = bucket + (uint64_t)m * RANS_BUCKETS;
        RANS_OUT_T *o = out + out_off[c];
        for (uint32_t i = 0; i < rows; i++) {
            uint32_t s = rans_decode_symbol(&x, cm, bk, w, &p, nw, &err);
            if (err)
                return err;
            o[i] = RANS_STORE(s, alphabet[m]);  /* loop-invariant load: hoisted */
        }
    }
    if (x != RANS_L || p != nw)
        return RANS_E_END;
    return RANS_OK;
}

/* Encode one lane (the decoder's arguments, symbols read from sym + out_off[c]) into the
 * last words of w[0..cap); returns the number of words written (they end at w + cap), or a
 * negative error. Symbols go in reverse so that the decoder reads forwards. */
RANS_FN int64_t rans_encode_lane(const int32_t *sym, const uint32_t *comp_model,
                                 const int64_t *out_off, uint32_t n_comps, uint32_t rows,
                                 const uint32_t *cum, const uint32_t *cum_off,
                                 const uint32_t *alphabet, uint16_t *w, uint32_t cap)
{
    uint32_t x = RANS_L;
    uint32_t p = cap;
    for (uint32_t c = n_comps; c-- > 0;) {
        uint32_t m = comp_model[c];
        const uint32_t *cm = cum + cum_off[m];
        uint32_t a = alphabet[m];
        const int32_t *in = sym + out_off[c];
        for (uint32_t i = rows; i-- > 0;) {
            uint32_t s = (uint32_t)in[i];
            if (s >= a)
                return RANS_E_SYMBOL;
            uint32_t lo = cm[s];
            uint32_t f = cm[s + 1] - lo;
            if (x >= (f << 16)) {
                if (p == 0)
                    return RANS_E_SPACE;
                w[--p] = (uint16_t)(x & 0xFFFFu);
                x >>= 16;
            }
            x = ((x / f) << RANS_PROB_BITS) + (x % f) + lo;
        }
    }
    if (p < 2)
        return RANS_E_SPACE;
    w[--p] = (uint16_t)(x >> 16);
    w[--p] = (uint16_t)(x & 0xFFFFu);
    return (int64_t)(cap - p);
}

#endif
