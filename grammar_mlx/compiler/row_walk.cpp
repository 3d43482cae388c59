// The token-row walk of compiler/token_index.py in one native loop (compiler/native.py builds and
// loads it; the numpy walk stays the reference and the fallback, and the tests hold the two equal).
//
// gm_walk expands the live nodes of a token trie level by level from a byte-DFA state: a node is
// live when the bytes from the root to it never reach the dead state. Live (node, state) pairs are
// appended to `nodes`/`states`; `cursor` = {lo, hi, count}: the pairs [lo, hi) are the level to
// expand first, `count` the pairs written; {-1, level-0 nodes, start state} starts a walk (the start
// state's row must be known); on return `cursor[2]` is the pairs' count. A DFA built on demand holds
// UNKNOWN (negative) in rows not computed yet: the walk calls `fetch(ctx, state)`, which computes that row
// and returns the table (its memory may have moved as the DFA grew), and goes on in place, so a walk
// is one call however many new states it meets: `fetch` is a Python callback (ctx unused) or, for a
// DFA whose subset construction is native, gm_subset_fetch (subset.cpp) with its GmSubset as ctx.
// Returns 0 when done, -1 when `fetch` failed (NULL: the caller re-raises its error), -2 for an
// unknown row without `fetch` (a complete DFA has none).
// A node's column is read as `classes[node_byte[node]]` (the DFA's 256-entry byte-class map and the
// trie's bytes), so a DFA walked once (a grammar's terminal) needs no per-node class array built for it.
//
// gm_row turns the live pairs into the row: the ids ending at each live node (end_first, plus the
// ids sharing a node's bytes, end_more) with their states, sorted by id (a sort for a few ids, a
// bitmap read in order for more, a pass over `per_token` for most of the vocabulary). `per_token`
// is a scratch of `width` int32 that holds -1 everywhere on entry and on return.
//
// gm_loops is token_index.StringSlice.loops: whether every character of the string slice leads the
// DFA from `state` back to `state` without the dead state on the way, a search over (position in a
// character, DFA state) pairs; `edges` holds per position r the (byte, next position) pairs
// edges[2 * edge_start[r] ..] up to edge_start[r + 1], in byte order, read through the DFA's byte
// classes (`classes`), so the slice's edges serve every DFA as they are (a run of bytes of one class
// with one next position is one test). Not once more than `max_pairs` pairs are met.
// Rows unknown are computed with `fetch(ctx, state)` as gm_walk's are (NULL: a complete DFA). Returns
// 1 or 0, -1 when `fetch` failed, -2 for an unknown row without it.
//
// gm_walk_parts is token_index.walk_parts in one call: with a string slice (`slice`, else NULL), its
// loop test, then the row (gm_walk and gm_row) of the slice's rest trie where `state` loops on the
// slice (`*looped` = 1), else of the whole trie. Tries and the thread's scratch come as descriptors
// of addresses (native.py `_TrieBuffers`, `_Scratch`, `walk_parts`). Returns the row's length, or
// -1 / -2 as gm_walk.
//
// gm_walk_with is gm_walk_parts with its per-walker arguments in a descriptor (native.py `Walker`,
// made once per lazy index): {a complete DFA's table (with no subset), the native subset's `io`
// (0: none; the table is then io's and rows are computed by gm_subset_fetch), width, dead, classes,
// trie descriptor, slice descriptor (0: none), the subset's handle}. Returns 2 * the row's length +
// whether `state` looped on the slice, or -1 / -2 as gm_walk.
//
// gm_set_bits sets the bits (bit t of word t / 32) of `count` ids, each below 32 * num_words (the
// caller's promise, checked or as a walk produced them), in words that are zero: a new mask-table
// row, where a row's own bits are all that is written (the other words stay untouched in memory).
//
// gm_merge merges two sorted, disjoint rows: `base` (every id to `base_state`) and tokens/states.
//
// gm_unset writes the ids below `width` whose bit is clear in a packed mask (`out`: room for
// `width`): a word at a time, so a row allowing nearly everything costs its few clear bits.
//
// gm_pack writes the packed mask (bit t of word t / 32) of ids in any order. Returns -1, or the
// index of the first id outside 0 .. 32 * num_words - 1 (nothing is written past the words then).
//
// gm_row_ids counts the set bits of a packed mask below bit `width` and, where they are at most
// `max_set`, writes their ids (`*form` = 1), else where the clear ones are at most `max_clear` (-1:
// never), theirs (`*form` = 2), else writes nothing (`*form` = 0); returns the ids written, or the
// count when none are (`out`: room for max(max_set, max_clear) ids). The sparse forms of a row the
// CPU kernels cache (kernels/cpu.py `sparse_form`).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

extern "C" {

typedef const int32_t* (*gm_fetch)(void* ctx, int32_t state);

int64_t gm_walk(const int32_t* table, int64_t width, int32_t dead, const int32_t* classes, const int32_t* node_byte,
                const int32_t* child_start, const int32_t* child_count, int32_t* nodes, int32_t* states,
                int64_t* cursor, gm_fetch fetch, void* ctx) {
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
                    table = fetch(ctx, s);
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

int64_t gm_loops(const int32_t* table, int64_t width, int32_t dead, int32_t state, const int32_t* classes,
                 const int32_t* edges, const int32_t* edge_start, int64_t max_pairs, gm_fetch fetch, void* ctx) {
    const int32_t column_a = classes[0x61];
    std::vector<int32_t> pairs(2 * static_cast<size_t>(std::max<int64_t>(max_pairs, 1)));
    int64_t seen = 0, todo = 0;  // pairs[0, 2 * seen): the pairs met; the last `todo` of them to expand
    for (;;) {
        const int32_t q = seen == 0 ? state : pairs[2 * (seen - todo) + 1];
        const int32_t r = seen == 0 ? 0 : pairs[2 * (seen - todo)];
        if (table[static_cast<int64_t>(q) * width] < 0) {  // unknown: have it computed
            if (fetch == nullptr) return -2;
            table = fetch(ctx, q);
            if (table == nullptr) return -1;
        }
        const int32_t* row = table + static_cast<int64_t>(q) * width;
        if (seen == 0) {
            if (row[column_a] != state) return 0;  // "a" first: most states fail here
            pairs[0] = 0;
            pairs[1] = state;
            seen = 1;
            todo = 1;
        }
        --todo;
        int32_t last_column = -1, last_after = -1;
        for (int32_t e = edge_start[r]; e < edge_start[r + 1]; ++e) {
            const int32_t column = classes[edges[2 * e]], after = edges[2 * e + 1];
            if (column == last_column && after == last_after) continue;  // the same test as the last byte's
            last_column = column;
            last_after = after;
            const int32_t next = row[column];
            if (next == dead || (after == 0 && next != state)) return 0;
            if (after == 0) continue;
            bool met = false;
            for (int64_t k = 0; k < seen && !met; ++k) met = pairs[2 * k] == after && pairs[2 * k + 1] == next;
            if (met) continue;
            if (seen >= max_pairs) return 0;
            pairs[2 * seen] = after;
            pairs[2 * seen + 1] = next;
            ++seen;
            ++todo;
        }
        if (todo == 0) return 1;
    }
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
    } else if (found > 64) {  // many: a bitmap of the ids read in order is cheaper than a sort
        std::vector<uint64_t> bits(static_cast<size_t>(width / 64 + 1), 0u);
        for (int64_t j = 0; j < found; ++j) bits[out_tokens[j] >> 6] |= uint64_t(1) << (out_tokens[j] & 63);
        int64_t j = 0;
        for (size_t w = 0; w < bits.size(); ++w) {
            for (uint64_t b = bits[w]; b; b &= b - 1) {
                const int64_t t = static_cast<int64_t>(w) * 64 + __builtin_ctzll(b);
                out_tokens[j] = static_cast<int32_t>(t);
                out_states[j++] = per_token[t];
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

// A trie descriptor: {node_byte, child_start, child_count, end_first, more_node, more_id, more_len,
// level-0 nodes}; a scratch: {nodes, states, per_token, out_tokens, out_states, width}; a slice:
// {edges, edge_start, column_a, max_pairs, the rest trie's descriptor (0: the rest has no nodes)}.
static int64_t walk_row(const int32_t* table, int64_t width, int32_t dead, const int32_t* classes, int32_t state,
                        gm_fetch fetch, void* ctx, const int64_t* trie, const int64_t* scratch) {
    if (table[static_cast<int64_t>(state) * width] < 0) {  // the start's row first (gm_walk needs it)
        if (fetch == nullptr) return -2;
        table = fetch(ctx, state);
        if (table == nullptr) return -1;
    }
    int32_t* nodes = reinterpret_cast<int32_t*>(scratch[0]);
    int32_t* states = reinterpret_cast<int32_t*>(scratch[1]);
    int64_t cursor[3] = {-1, trie[7], state};
    const int64_t done = gm_walk(table, width, dead, classes, reinterpret_cast<const int32_t*>(trie[0]),
                                 reinterpret_cast<const int32_t*>(trie[1]), reinterpret_cast<const int32_t*>(trie[2]),
                                 nodes, states, cursor, fetch, ctx);
    if (done != 0) return done;
    return gm_row(nodes, states, cursor[2], reinterpret_cast<const int32_t*>(trie[3]),
                  reinterpret_cast<const int32_t*>(trie[4]), reinterpret_cast<const int32_t*>(trie[5]), trie[6],
                  reinterpret_cast<int32_t*>(scratch[2]), scratch[5], reinterpret_cast<int32_t*>(scratch[3]),
                  reinterpret_cast<int32_t*>(scratch[4]));
}

int64_t gm_walk_parts(const int32_t* table, int64_t width, int32_t dead, const int32_t* classes, int32_t state,
                      gm_fetch fetch, void* ctx, const int64_t* trie, const int64_t* scratch, const int64_t* slice,
                      int64_t* looped) {
    *looped = 0;
    if (slice != nullptr) {
        const int64_t loops = gm_loops(table, width, dead, state, classes, reinterpret_cast<const int32_t*>(slice[0]),
                                       reinterpret_cast<const int32_t*>(slice[1]), slice[2], fetch, ctx);
        if (loops < 0) return loops;
        if (loops == 1) {
            *looped = 1;
            if (slice[3] == 0) return 0;
            if (fetch != nullptr) table = fetch(ctx, state);  // known now: the current table
            if (table == nullptr) return -1;
            return walk_row(table, width, dead, classes, state, fetch, ctx, reinterpret_cast<const int64_t*>(slice[3]),
                            scratch);
        }
        if (fetch != nullptr) table = fetch(ctx, state);
        if (table == nullptr) return -1;
    }
    return walk_row(table, width, dead, classes, state, fetch, ctx, trie, scratch);
}

const int32_t* gm_subset_fetch(void* ctx, int32_t q);  // subset.cpp

int64_t gm_walk_with(const int64_t* d, const int64_t* scratch, int32_t state) {
    const int64_t* io = reinterpret_cast<const int64_t*>(d[1]);
    const int32_t* table = reinterpret_cast<const int32_t*>(io != nullptr ? io[0] : d[0]);
    int64_t looped = 0;
    const int64_t found = gm_walk_parts(table, d[2], static_cast<int32_t>(d[3]), reinterpret_cast<const int32_t*>(d[4]),
                                        state, io != nullptr ? gm_subset_fetch : nullptr, reinterpret_cast<void*>(d[7]),
                                        reinterpret_cast<const int64_t*>(d[5]), scratch,
                                        reinterpret_cast<const int64_t*>(d[6]), &looped);
    return found < 0 ? found : 2 * found + looped;
}

void gm_set_bits(const int32_t* ids, int64_t count, uint32_t* words) {
    for (int64_t i = 0; i < count; ++i) words[ids[i] >> 5] |= 1u << (ids[i] & 31);
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

// Set bits of words[0..n): the popcnt instruction where the CPU has one (x86-64 checks at run time;
// aarch64 always has one), else a portable bit count.
static int64_t count_portable(const uint32_t* words, int64_t n) {
    int64_t count = 0;
    for (int64_t w = 0; w < n; ++w) {
        uint32_t x = words[w];
        x = x - ((x >> 1) & 0x55555555u);
        x = (x & 0x33333333u) + ((x >> 2) & 0x33333333u);
        count += static_cast<int64_t>((((x + (x >> 4)) & 0x0F0F0F0Fu) * 0x01010101u) >> 24);
    }
    return count;
}

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("popcnt"))) static int64_t count_popcnt(const uint32_t* words, int64_t n) {
    int64_t count = 0;
    for (int64_t w = 0; w < n; ++w) count += __builtin_popcount(words[w]);
    return count;
}

static int64_t count_bits(const uint32_t* words, int64_t n) {
    static const bool popcnt = __builtin_cpu_supports("popcnt");
    return popcnt ? count_popcnt(words, n) : count_portable(words, n);
}
#elif defined(__aarch64__)
static int64_t count_bits(const uint32_t* words, int64_t n) {
    int64_t count = 0;
    for (int64_t w = 0; w < n; ++w) count += __builtin_popcount(words[w]);
    return count;
}
#else
static int64_t count_bits(const uint32_t* words, int64_t n) { return count_portable(words, n); }
#endif

int64_t gm_row_ids(const uint32_t* words, int64_t width, int64_t max_set, int64_t max_clear, int32_t* out,
                   int64_t* form) {
    const int64_t full = width / 32, tail = width % 32;
    const uint32_t tail_mask = tail ? (1u << tail) - 1u : 0u;
    int64_t count = count_bits(words, full);
    if (tail) {
        const uint32_t last = words[full] & tail_mask;
        count += count_portable(&last, 1);
    }
    if (count <= max_set || width - count <= max_clear) {
        const bool set = count <= max_set;
        const uint32_t flip = set ? 0u : ~0u;  // read the clear bits as set ones
        *form = set ? 1 : 2;
        int64_t k = 0;
        for (int64_t w = 0; w < full; ++w) {
            for (uint32_t bits = words[w] ^ flip; bits; bits &= bits - 1)
                out[k++] = static_cast<int32_t>(w * 32 + __builtin_ctz(bits));
        }
        if (tail) {
            for (uint32_t bits = (words[full] ^ flip) & tail_mask; bits; bits &= bits - 1)
                out[k++] = static_cast<int32_t>(full * 32 + __builtin_ctz(bits));
        }
        return k;
    }
    *form = 0;
    return count;
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
