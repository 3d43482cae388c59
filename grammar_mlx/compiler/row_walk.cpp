// The token-row walk of compiler/token_index.py in one native loop (compiler/native.py builds and
// loads it; the numpy walk stays the reference and the fallback, and the tests hold the two equal).
//
// gm_walk expands the live nodes of a token trie level by level from a byte-DFA state: a node is
// live when the bytes from the root to it never reach the dead state. Live (node, state) pairs are
// appended to `nodes`/`states`; `cursor` = {lo, hi, count}: the pairs [lo, hi) are the level being
// expanded, `count` the pairs written; {-1, level-0 nodes, start state} starts a walk (the start
// state's row must be known). A DFA built on demand holds UNKNOWN (negative) in rows not
// computed yet: a level that meets one is not kept (count goes back to hi); the distinct source
// states whose row is missing are written to `unknown` and their number returned, so that the caller
// computes those rows and calls again with the same cursor. 0: the walk is done. A node's column is
// read as `classes[node_byte[node]]` (the DFA's 256-entry byte-class map and the trie's bytes), so a
// DFA walked once (a grammar's terminal) needs no per-node class array built for it.
//
// gm_row turns the live pairs into the row: the ids ending at each live node (end_first, plus the
// ids sharing a node's bytes, end_more) with their states, sorted by id. `per_token` is a scratch of
// `width` int32 that holds -1 everywhere on entry and on return.
//
// gm_merge merges two sorted, disjoint rows: `base` (every id to `base_state`) and tokens/states.
//
// gm_pack writes the packed mask (bit t of word t / 32) of sorted ids.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

extern "C" {

int64_t gm_walk(const int32_t* table, int64_t width, int32_t dead, const int32_t* classes, const int32_t* node_byte,
                const int32_t* child_start, const int32_t* child_count, int32_t* nodes, int32_t* states,
                int64_t* cursor, int32_t* unknown, int64_t max_unknown, uint8_t* seen, int64_t seen_len) {
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
        int64_t missing = 0;
        const int64_t start = count;
        for (int64_t i = lo; i < hi; ++i) {
            const int32_t n = nodes[i];
            const int32_t kids = child_count[n];
            if (kids == 0) continue;
            const int32_t* row = table + static_cast<int64_t>(states[i]) * width;
            const int32_t first = child_start[n];
            const int32_t end = first + kids;
            for (int32_t c = first; c < end; ++c) {
                const int32_t t = row[classes[node_byte[c]]];
                if (t == dead) continue;
                if (t < 0) {  // the source row is unknown: every child of this node needs it
                    const int32_t s = states[i];
                    if ((s >= seen_len || !seen[s]) && missing < max_unknown) {
                        if (s < seen_len) seen[s] = 1;
                        unknown[missing++] = s;
                    }
                    break;
                }
                nodes[count] = c;
                states[count] = t;
                ++count;
            }
        }
        if (missing) {
            for (int64_t k = 0; k < missing; ++k) {
                if (unknown[k] < seen_len) seen[unknown[k]] = 0;
            }
            cursor[0] = lo;
            cursor[1] = hi;
            cursor[2] = start;
            return missing;
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
    int64_t i = 0, j = 0, k = 0;
    while (i < base_len || j < count) {
        if (j == count || (i < base_len && base[i] < tokens[j])) {
            out_tokens[k] = base[i++];
            out_states[k++] = base_state;
        } else {
            out_tokens[k] = tokens[j];
            out_states[k++] = states[j++];
        }
    }
    return k;
}

void gm_pack(const int32_t* tokens, int64_t count, uint32_t* words, int64_t num_words) {
    std::memset(words, 0, static_cast<size_t>(num_words) * sizeof(uint32_t));
    for (int64_t i = 0; i < count; ++i) {
        const uint32_t t = static_cast<uint32_t>(tokens[i]);
        words[t >> 5] |= 1u << (t & 31u);
    }
}

}  // extern "C"
