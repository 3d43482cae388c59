// The token-row walk of compiler/token_index.py in one native loop (compiler/native.py builds and
// loads it; the numpy walk stays the reference and the fallback, and the tests hold the two equal).
//
// gm_walk expands the live nodes of a token trie level by level from a byte-DFA state: a node is
// live when the bytes from the root to it never reach the dead state. Live (node, state) pairs are
// appended to `nodes`/`states`; `cursor` = {lo, hi, count}: the pairs [lo, hi) are the level to
// expand first, `count` the pairs written; {-1, level-0 nodes, start state} starts a walk (the start
// state's row must be known); on return `cursor[2]` is the pairs' count. A DFA built on demand holds
// UNKNOWN (negative) in rows not computed yet: the walk calls `fetch(state)`, which computes that row
// and returns the table (its memory may have moved as the DFA grew), and goes on in place, so a walk
// is one call however many new states it meets. Returns 0 when done, -1 when `fetch` failed (NULL:
// the caller re-raises its error), -2 for an unknown row without `fetch` (a complete DFA has none).
// A node's column is read as `classes[node_byte[node]]` (the DFA's 256-entry byte-class map and the
// trie's bytes), so a DFA walked once (a grammar's terminal) needs no per-node class array built for it.
//
// gm_row turns the live pairs into the row: the ids ending at each live node (end_first, plus the
// ids sharing a node's bytes, end_more) with their states, sorted by id. `per_token` is a scratch of
// `width` int32 that holds -1 everywhere on entry and on return.
//
// gm_merge merges two sorted, disjoint rows: `base` (every id to `base_state`) and tokens/states.
//
// gm_unset writes the ids below `width` whose bit is clear in a packed mask (`out`: room for
// `width`): a word at a time, so a row allowing nearly everything costs its few clear bits.
//
// gm_pack writes the packed mask (bit t of word t / 32) of ids in any order. Returns -1, or the
// index of the first id outside 0 .. 32 * num_words - 1 (nothing is written past the words then).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

extern "C" {

typedef const int32_t* (*gm_fetch)(int32_t state);

int64_t gm_walk(const int32_t* table, int64_t width, int32_t dead, const int32_t* classes, const int32_t* node_byte,
                const int32_t* child_start, const int32_t* child_count, int32_t* nodes, int32_t* states,
                int64_t* cursor, gm_fetch fetch) {
    int64_t lo = cursor[0], hi = cursor[1], count = cursor[2];
    if (lo < 0) {  // a new walk: the root's children (level 0, nodes 0..hi-1) from state `count`
        const int32_t* row = table + count * width;  // the caller computed this row
        count = 0;
        for (int32_t c = 0; c < hi; ++c) {
            const int32_t t = row[classes[node_byte[c]]];
            if (t == dead) continue;
            nodes[count] = c;
            states[count] = t;
            ++count;
        }
        lo = 0;
        hi = count;
    }
    while (lo < hi) {
        for (int64_t i = lo; i < hi; ++i) {
            const int32_t n = nodes[i];
            const int32_t kids = child_count[n];
            if (kids == 0) continue;
            const int32_t s = states[i];
            const int32_t* row = table + static_cast<int64_t>(s) * width;
            const int32_t first = child_start[n];
            const int32_t end = first + kids;
            for (int32_t c = first; c < end; ++c) {
                int32_t t = row[classes[node_byte[c]]];
                if (t < 0) {  // the row is unknown (a DFA built on demand): have it computed, then go on
                    if (fetch == nullptr) return -2;
                    table = fetch(s);
                    if (table == nullptr) return -1;  // the row source raised: the caller re-raises
                    row = table + static_cast<int64_t>(s) * width;
                    t = row[classes[node_byte[c]]];
                    if (t < 0) return -2;
                }
                if (t == dead) continue;
                nodes[count] = c;
                states[count] = t;
                ++count;
            }
        }
        lo = hi;
        hi = count;
    }
    cursor[0] = lo;
    cursor[1] = hi;
    cursor[2] = count;
    return 0;
}

int64_t gm_row(const int32_t* nodes, const int32_t* states, int64_t count, const int32_t* end_first,
               const int32_t* more_node, const int32_t* more_id, int64_t more_len, int32_t* per_token,
               int64_t width, int32_t* out_tokens, int32_t* out_states) {
    int64_t found = 0;
    for (int64_t i = 0; i < count; ++i) {
        const int32_t t = end_first[nodes[i]];
        if (t >= 0) {
            per_token[t] = states[i];
            out_tokens[found++] = t;
        }
    }
    for (int64_t k = 0; k < more_len; ++k) {  // an extra id shares its node with that node's first id
        const int32_t s = per_token[end_first[more_node[k]]];
        if (s >= 0) {
            per_token[more_id[k]] = s;
            out_tokens[found++] = more_id[k];
        }
    }
    if (found * 16 > width) {  // dense: one pass over the ids is cheaper than a sort
        int64_t j = 0;
        for (int64_t t = 0; t < width; ++t) {
            const int32_t s = per_token[t];
            if (s >= 0) {
                out_tokens[j] = static_cast<int32_t>(t);
                out_states[j] = s;
                ++j;
                per_token[t] = -1;
            }
        }
    } else {
        std::sort(out_tokens, out_tokens + found);
        for (int64_t j = 0; j < found; ++j) {
            out_states[j] = per_token[out_tokens[j]];
            per_token[out_tokens[j]] = -1;
        }
    }
    return found;
}

int64_t gm_merge(const int32_t* base, int64_t base_len, int32_t base_state, const int32_t* tokens,
                 const int32_t* states, int64_t count, int32_t* out_tokens, int32_t* out_states) {
    // Few tokens into a long base (a string slice and the rest's row): copy base runs whole.
    int64_t i = 0, k = 0;
    for (int64_t j = 0; j < count; ++j) {
        const int64_t stop = std::lower_bound(base + i, base + base_len, tokens[j]) - base;
        const int64_t run = stop - i;
        std::memcpy(out_tokens + k, base + i, static_cast<size_t>(run) * sizeof(int32_t));
        std::fill(out_states + k, out_states + k + run, base_state);
        k += run;
        i = stop;
        out_tokens[k] = tokens[j];
        out_states[k++] = states[j];
    }
    const int64_t run = base_len - i;
    std::memcpy(out_tokens + k, base + i, static_cast<size_t>(run) * sizeof(int32_t));
    std::fill(out_states + k, out_states + k + run, base_state);
    return k + run;
}

int64_t gm_unset(const uint32_t* words, int64_t num_words, int64_t width, int32_t* out) {
    int64_t k = 0;
    for (int64_t w = 0; w < num_words; ++w) {
        uint32_t clear = ~words[w];
        while (clear) {
            const int64_t t = w * 32 + __builtin_ctz(clear);
            if (t >= width) return k;
            out[k++] = static_cast<int32_t>(t);
            clear &= clear - 1;
        }
    }
    return k;
}

int64_t gm_pack(const int32_t* tokens, int64_t count, uint32_t* words, int64_t num_words) {
    std::memset(words, 0, static_cast<size_t>(num_words) * sizeof(uint32_t));
    const uint64_t limit = static_cast<uint64_t>(num_words) * 32u;
    for (int64_t i = 0; i < count; ++i) {
        const uint32_t t = static_cast<uint32_t>(tokens[i]);  // a negative id wraps past the limit
        if (t >= limit) return i;
        words[t >> 5] |= 1u << (t & 31u);
    }
    return -1;
}

}  // extern "C"
