// The on-demand subset construction of automata/byte_nfa.py (`Determinizer`) in native code
// (compiler/native.py builds it into the library beside row_walk.cpp and wraps it as `Subset`; the
// Python construction stays the reference and the fallback, and the tests hold the two equal).
//
// A GmSubset mirrors the part of the byte NFA built so far: per NFA state its kind (a byte state
// with (first class, last class, target) spans in class order, pushed as (first byte, last byte,
// target) ranges and read through the byte classes; a split with epsilon targets, the
// match state, or pending: not built yet) and, where some states cannot reach the match over the
// alphabet, its liveness (gm_subset_live: the NFA is then built whole). Python logs states as it
// builds them (`ByteNFA.log`: records of {state, kind, count, payload...}, a later record of a
// state replacing its earlier one) and pushes the log (gm_subset_push). An epsilon closure that
// meets a pending state calls `expand` (Python builds what that state's closure reaches and stages
// the log's new records in io: address and length), reads the staged records and goes on; or,
// once Python has handed the building over (gm_builder_start: the AST as tables, the NFA's pending
// states and memo), builds it here (`Builder`: ByteNFA.expand's states in its order, recorded
// for Python, which reads them back when it reads its NFA: gm_builder_export, gm_builder_stop).
//
// DFA states are sets of NFA states (sorted), numbered 1, 2, ... in the order they are found (the
// dead state is 0); a row is computed as the Python one is: one byte state's spans, or the segments
// between the members' class boundaries, each segment's targets memoized to the DFA state of their
// closures' union, new states numbered in the order of the first class leading to each. The rows,
// accepting and live flags go straight into the ByteDFA's numpy arrays, whose addresses `io` holds:
// io = {table, accepting, live, capacity (states the arrays hold), max_states, num_states, rows
// computed, error, staged records' address, their count}. When a new state needs more room, `grow`
// has Python replace the arrays (and update io). A row's class 0 (NUL: always the dead state) is
// written last, with release order: lock-free readers take a row as known once that entry is no
// longer UNKNOWN.
//
// Errors: a callback that raised (Python keeps the exception) sets io[7] = 1, a state past
// max_states io[7] = 2, an NFA state past the builder's cap io[7] = 3; the call in progress returns
// -1 (or NULL) and no half-made row is kept (a row is written only once complete), so it can be
// retried (NFA states made before the error are kept, as Python keeps its own).

#include <algorithm>
#include <cstdint>
#include <unordered_map>
#include <vector>

namespace {

enum : int8_t { KIND_BYTE = 0, KIND_SPLIT = 1, KIND_MATCH = 2, KIND_PENDING = 3 };
enum : int64_t { IO_TABLE, IO_ACCEPTING, IO_LIVE, IO_CAPACITY, IO_MAX_STATES, IO_STATES, IO_ROWS, IO_ERROR, IO_LOG,
                 IO_LOG_LENGTH };

typedef int32_t (*gm_expand)(int32_t nfa_state);
typedef int32_t (*gm_grow)(void);

struct SetHash {
    size_t operator()(const std::vector<int32_t>& v) const {
        uint64_t h = 1469598103934665603ull;
        for (int32_t x : v) {
            h ^= static_cast<uint32_t>(x);
            h *= 1099511628211ull;
        }
        return static_cast<size_t>(h);
    }
};

typedef std::unordered_map<std::vector<int32_t>, int32_t, SetHash> SetIds;

// A memo key of the builder: (node, lo, hi, continuation); a node's compile key has lo = hi = COMPILED.
struct Key {
    int32_t node, lo, hi, nxt;
    bool operator==(const Key& o) const { return node == o.node && lo == o.lo && hi == o.hi && nxt == o.nxt; }
};

struct KeyHash {
    size_t operator()(const Key& k) const {
        uint64_t h = static_cast<uint32_t>(k.node);
        h = h * 0x9E3779B97F4A7C15ull ^ static_cast<uint32_t>(k.lo);
        h = h * 0x9E3779B97F4A7C15ull ^ static_cast<uint32_t>(k.hi);
        h = h * 0x9E3779B97F4A7C15ull ^ static_cast<uint32_t>(k.nxt);
        return static_cast<size_t>(h ^ (h >> 29));
    }
};

enum : int32_t { NODE_SEQ = 0, NODE_ALT = 1, NODE_REPEAT = 2, NODE_LITERAL = 3, NODE_CHARS = 4 };
enum : int32_t { COMPILED = -5, NO_NODE = -1, NONE_HI = -1, CHECK_EVERY = 1 << 14 };
const int64_t FAR = 2147483647;  // no way to the match (byte_nfa's _FAR)

// What a pending state stands for: (node, lo, hi, continuation), node NO_NODE where none.
struct Pending {
    int32_t node, lo, hi, nxt;
};

// The byte NFA's construction (automata/byte_nfa.py's ByteNFA: compile, expand, _repeat, _set,
// _chain, _new) over the AST as tables, for the node kinds it handles; the same states in the same
// order. Each state made or expanded is also recorded for Python (`out`, read by gm_builder_export).
struct Builder {
    // Per node: kind, a, b, c (sequence / alternation: first child, count; repeat: item, lo, hi or
    // NONE_HI; literal: first byte, count; class: template) and its fewest bytes.
    std::vector<int32_t> node;  // 5 ints a node
    std::vector<int32_t> children, bytes;
    // Templates: per template its first state (tpl[t] .. tpl[t + 1]); per template state its first
    // range (tstate[2 i], to tstate[2 (i + 1)]) and fewest bytes (tstate[2 i + 1]); ranges as
    // (lo, hi, target), the target relative (template states from 1, -1 the continuation).
    std::vector<int32_t> tpl, tstate, ranges;
    std::vector<int32_t> dist;  // per NFA state
    std::vector<Pending> pending;  // per NFA state
    std::unordered_map<Key, int32_t, KeyHash> memo;
    int64_t max_states = 0;
    int64_t num_pending = 0;
    std::vector<int32_t> out;  // records for Python (gm_builder_export)
};

}  // namespace

struct GmSubset {
    int32_t num_classes;
    int32_t classes[256];
    bool all_live;
    int64_t* io;
    gm_expand expand;
    gm_grow grow;
    // The NFA mirror, per NFA state.
    std::vector<int8_t> kind;
    std::vector<std::vector<int32_t>> spans;
    std::vector<std::vector<int32_t>> eps;
    std::vector<uint8_t> live;
    std::vector<std::vector<int32_t>> closure;
    std::vector<uint8_t> closed;
    std::vector<uint32_t> stamp;  // the closure search's visited marks
    uint32_t epoch = 0;
    // The DFA: ids of NFA sets, each state's set (cleared once its row is computed), the sets by id.
    SetIds ids;
    std::vector<std::vector<int32_t>> members;
    std::vector<uint8_t> done;
    std::vector<const std::vector<int32_t>*> named;
    SetIds by_targets;  // the targets of a row's segment (in member order) -> the state of their closures
    int64_t bytes = 0;  // heap bytes of the sets, closures and spans (roughly: `gm_subset_bytes`)
    Builder* builder = nullptr;  // the NFA builder, while it builds (gm_builder_start .. gm_builder_stop)
};

namespace {

bool fail(GmSubset* d, int64_t code) {
    d->io[IO_ERROR] = code;
    return false;
}

void resize(GmSubset* d, size_t size) {
    d->kind.resize(size, KIND_PENDING);
    d->spans.resize(size);
    d->eps.resize(size);
    d->closure.resize(size);
    d->closed.resize(size, 0);
    d->stamp.resize(size, 0u);
    d->live.resize(size, 0);
}

void push(GmSubset* d, const int32_t* records, int64_t length) {
    int64_t i = 0;
    while (i < length) {
        const int32_t s = records[i], k = records[i + 1], n = records[i + 2];
        const int32_t* payload = records + i + 3;
        i += 3 + n;
        if (static_cast<size_t>(s) >= d->kind.size()) resize(d, static_cast<size_t>(s) + 1);
        d->kind[s] = static_cast<int8_t>(k);
        std::vector<int32_t>& into = k == KIND_BYTE ? d->spans[s] : d->eps[s];
        into.assign(payload, payload + n);
        if (k == KIND_BYTE) {
            for (int32_t j = 0; j < n; j += 3) {
                into[j] = d->classes[into[j]];
                into[j + 1] = d->classes[into[j + 1]];
            }
        }
        d->bytes += static_cast<int64_t>(n) * 4 + 64;
    }
}

// After `expand` returned: the records it staged read.
void take_staged(GmSubset* d) {
    const int64_t n = d->io[IO_LOG_LENGTH];
    if (n > 0) {
        d->io[IO_LOG_LENGTH] = 0;
        push(d, reinterpret_cast<const int32_t*>(d->io[IO_LOG]), n);
    }
}

int32_t clamp(int64_t v) { return static_cast<int32_t>(v < FAR ? v : FAR); }

// A new NFA state: a byte state of `n` (lo, hi, target) ranges, or (n = 0, ranges null) pending;
// -1 (io[7] = 3) past the builder's cap, or where the deadline callback raised (io[7] = 1).
int32_t new_state(GmSubset* d, const int32_t* rs, int32_t n, int64_t dist) {
    Builder* b = d->builder;
    const int32_t q = static_cast<int32_t>(d->kind.size());
    if (q % CHECK_EVERY == 0 && d->expand(-1) != 0) return fail(d, 1), -1;  // the compile deadline
    if (q >= b->max_states) return fail(d, 3), -1;
    resize(d, static_cast<size_t>(q) + 1);
    b->dist.push_back(clamp(dist));
    b->pending.push_back(Pending{NO_NODE, 0, 0, 0});
    if (rs == nullptr) {  // pending: the caller sets what it stands for
        d->bytes += 64;
        return q;
    }
    d->kind[q] = KIND_BYTE;
    std::vector<int32_t>& spans = d->spans[q];
    spans.resize(static_cast<size_t>(3 * n));
    b->out.push_back(0);
    b->out.push_back(q);
    b->out.push_back(b->dist[q]);
    b->out.push_back(3 * n);
    for (int32_t j = 0; j < 3 * n; j += 3) {
        spans[j] = d->classes[rs[j]];
        spans[j + 1] = d->classes[rs[j + 1]];
        spans[j + 2] = rs[j + 2];
        b->out.insert(b->out.end(), rs + j, rs + j + 3);
    }
    d->bytes += static_cast<int64_t>(3 * n) * 4 + 64;
    return q;
}

int32_t new_pending(GmSubset* d, int64_t dist, int32_t node, int32_t lo, int32_t hi, int32_t nxt) {
    const int32_t q = new_state(d, nullptr, 0, dist);
    if (q < 0) return -1;
    Builder* b = d->builder;
    b->pending[q] = Pending{node, lo, hi, nxt};
    b->num_pending += 1;
    const int32_t record[7] = {3, q, b->dist[q], node, lo, hi, nxt};
    b->out.insert(b->out.end(), record, record + 7);
    return q;
}

void remember(Builder* b, const Key& key, int32_t state) {
    b->memo.emplace(key, state);
    const int32_t record[6] = {4, key.node, key.lo, key.hi, key.nxt, state};
    b->out.insert(b->out.end(), record, record + 6);
}

int32_t repeat(GmSubset* d, int32_t node, int32_t lo, int32_t hi, int32_t nxt) {
    if (hi == 0) return nxt;
    Builder* b = d->builder;
    const Key key{node, lo, hi, nxt};
    auto hit = b->memo.find(key);
    if (hit != b->memo.end()) return hit->second;
    const int32_t item = b->node[5 * node + 1];
    const int64_t dist = static_cast<int64_t>(lo) * b->node[5 * item + 4] + b->dist[nxt];
    const int32_t q = new_pending(d, dist, node, lo, hi, nxt);
    if (q < 0) return -1;
    remember(b, key, q);
    return q;
}

int32_t compile_node(GmSubset* d, int32_t node, int32_t nxt) {
    Builder* b = d->builder;
    const int32_t* n = &b->node[5 * node];
    if (n[0] == NODE_REPEAT) return repeat(d, node, n[2], n[3], nxt);
    const Key key{node, COMPILED, COMPILED, nxt};
    auto hit = b->memo.find(key);
    if (hit != b->memo.end()) return hit->second;
    int32_t start;
    if (n[0] == NODE_LITERAL) {  // `_chain`: the bytes backward
        const int64_t after = b->dist[nxt];
        start = nxt;
        for (int32_t i = 1; i <= n[2]; ++i) {
            const int32_t byte = b->bytes[n[1] + n[2] - i];
            const int32_t range[3] = {byte, byte, start};
            start = new_state(d, range, 1, after + i);
            if (start < 0) return -1;
        }
    } else if (n[0] == NODE_CHARS) {  // `_set`: the template's states from the next id on
        const int32_t base = static_cast<int32_t>(d->kind.size()) - 1;
        const int64_t after = b->dist[nxt];
        std::vector<int32_t> rs;
        for (int32_t i = b->tpl[n[1]]; i < b->tpl[n[1] + 1]; ++i) {
            rs.clear();
            for (int32_t j = b->tstate[2 * i]; j < b->tstate[2 * (i + 1)]; ++j) {
                const int32_t t = b->ranges[3 * j + 2];
                rs.push_back(b->ranges[3 * j]);
                rs.push_back(b->ranges[3 * j + 1]);
                rs.push_back(t < 0 ? nxt : base + t);
            }
            const int32_t n_ranges = static_cast<int32_t>(rs.size() / 3);
            if (new_state(d, rs.data(), n_ranges, b->tstate[2 * i + 1] + after) < 0) return -1;
        }
        start = base + 1;
    } else if (n[0] == NODE_SEQ && n[2] == 0) {
        start = nxt;
    } else {
        start = new_pending(d, static_cast<int64_t>(n[4]) + b->dist[nxt], node, 0, NONE_HI, nxt);
        if (start < 0) return -1;
    }
    remember(b, key, start);
    return start;
}

// `ByteNFA.expand`: pending state q becomes a split into what it stands for; false on failure.
bool build(GmSubset* d, int32_t q) {
    Builder* b = d->builder;
    const Pending p = b->pending[q];
    const int32_t* n = &b->node[5 * p.node];
    std::vector<int32_t> targets;
    if (n[0] == NODE_SEQ) {
        int32_t start = p.nxt;
        for (int32_t i = n[2] - 1; i >= 0 && start >= 0; --i) start = compile_node(d, b->children[n[1] + i], start);
        targets.push_back(start);
    } else if (n[0] == NODE_ALT) {
        for (int32_t i = 0; i < n[2] && (targets.empty() || targets.back() >= 0); ++i) {
            targets.push_back(compile_node(d, b->children[n[1] + i], p.nxt));
        }
    } else {  // a repeat
        const int32_t item = n[1];
        if (p.lo > 0) {
            const int32_t rest = repeat(d, p.node, p.lo - 1, p.hi == NONE_HI ? NONE_HI : p.hi - 1, p.nxt);
            targets.push_back(rest < 0 ? -1 : compile_node(d, item, rest));
        } else if (p.hi == NONE_HI) {
            targets.push_back(compile_node(d, item, q));  // q is the loop
            targets.push_back(p.nxt);
        } else {
            const int32_t rest = repeat(d, p.node, 0, p.hi - 1, p.nxt);
            targets.push_back(rest < 0 ? -1 : compile_node(d, item, rest));
            targets.push_back(p.nxt);
        }
    }
    for (int32_t t : targets) {
        if (t < 0) return false;  // (io[7] set; the states made so far are kept, as Python keeps its)
    }
    b->pending[q].node = NO_NODE;
    b->num_pending -= 1;
    d->kind[q] = KIND_SPLIT;
    d->eps[q] = targets;
    d->bytes += static_cast<int64_t>(targets.size()) * 4 + 64;
    b->out.push_back(1);
    b->out.push_back(q);
    b->out.push_back(static_cast<int32_t>(targets.size()));
    b->out.insert(b->out.end(), targets.begin(), targets.end());
    return true;
}

// A pending state met by a closure built: by the builder where it builds, else by Python (`expand`).
bool expand_state(GmSubset* d, int32_t s) {
    if (d->builder != nullptr && d->builder->pending[s].node != NO_NODE) return build(d, s);
    if (d->expand(s) != 0) return fail(d, 1);
    take_staged(d);
    return true;
}

// The closure of NFA state q (byte states and the match state reachable by epsilon moves, sorted)
// into d->closure[q]; false when expanding a pending state failed.
bool close(GmSubset* d, int32_t q) {
    if (d->closed[q]) return true;
    std::vector<int32_t> out;
    if (d->kind[q] == KIND_BYTE) {
        out.push_back(q);
    } else {
        if (++d->epoch == 0) {
            std::fill(d->stamp.begin(), d->stamp.end(), 0u);
            d->epoch = 1;
        }
        std::vector<int32_t> stack(1, q);
        d->stamp[q] = d->epoch;
        while (!stack.empty()) {
            const int32_t s = stack.back();
            stack.pop_back();
            if (d->kind[s] == KIND_PENDING) {
                if (!expand_state(d, s)) return false;  // new states: the vectors may move
                if (d->kind[s] == KIND_PENDING) return fail(d, 1);
            }
            if (d->kind[s] != KIND_SPLIT) {
                out.push_back(s);
                continue;
            }
            for (int32_t t : d->eps[s]) {
                if (d->stamp[t] != d->epoch) {
                    d->stamp[t] = d->epoch;
                    stack.push_back(t);
                }
            }
        }
        std::sort(out.begin(), out.end());
    }
    d->bytes += static_cast<int64_t>(out.size()) * 4 + 24;
    d->closure[q].swap(out);
    d->closed[q] = 1;
    return true;
}

// The DFA state of a sorted set of NFA states, added on first sight; -1 on failure.
int32_t state_of(GmSubset* d, std::vector<int32_t>& set) {
    SetIds::iterator hit = d->ids.find(set);
    if (hit != d->ids.end()) return hit->second;
    const int64_t sid = d->io[IO_STATES] + 1;
    if (sid > d->io[IO_MAX_STATES]) return fail(d, 2), -1;
    if (sid >= d->io[IO_CAPACITY] && (d->grow() != 0 || sid >= d->io[IO_CAPACITY])) return fail(d, 1), -1;
    bool accepting = false, live = d->all_live;
    for (int32_t m : set) {
        accepting = accepting || d->kind[m] == KIND_MATCH;
        live = live || d->live[m];
    }
    reinterpret_cast<uint8_t*>(d->io[IO_ACCEPTING])[sid] = accepting;
    reinterpret_cast<uint8_t*>(d->io[IO_LIVE])[sid] = live;
    d->bytes += 2 * (static_cast<int64_t>(set.size()) * 4 + 24) + 64;
    SetIds::iterator made = d->ids.emplace(set, static_cast<int32_t>(sid)).first;
    d->members.push_back(set);
    d->done.push_back(0);
    d->named.push_back(&made->first);
    d->io[IO_STATES] = sid;
    return static_cast<int32_t>(sid);
}

// The DFA state of the union of the closures of `targets` (memoized by the targets); -1 on failure.
int32_t state_of_targets(GmSubset* d, const std::vector<int32_t>& targets) {
    SetIds::iterator hit = d->by_targets.find(targets);
    if (hit != d->by_targets.end()) return hit->second;
    for (int32_t t : targets) {
        if (!close(d, t)) return -1;
    }
    std::vector<int32_t> set;
    if (targets.size() == 1) {
        set = d->closure[targets[0]];
    } else {
        for (int32_t t : targets) set.insert(set.end(), d->closure[t].begin(), d->closure[t].end());
        std::sort(set.begin(), set.end());
        set.erase(std::unique(set.begin(), set.end()), set.end());
    }
    const int32_t sid = state_of(d, set);
    if (sid < 0) return -1;
    d->by_targets.emplace(targets, sid);
    d->bytes += static_cast<int64_t>(targets.size()) * 4 + 64;
    return sid;
}

// Computes the row of DFA state q into the table; false on failure (nothing written then).
bool compute_row(GmSubset* d, int32_t q) {
    const std::vector<int32_t> set = d->members[q];  // a copy: new states may move the vector
    std::vector<int32_t> moving;
    for (int32_t s : set) {
        if (d->kind[s] == KIND_BYTE) moving.push_back(s);
    }
    std::vector<int32_t> row(d->num_classes, 0);
    std::vector<int32_t> key(1);
    if (moving.size() == 1) {
        const std::vector<int32_t> spans = d->spans[moving[0]];
        for (size_t i = 0; i < spans.size(); i += 3) {
            key[0] = spans[i + 2];
            const int32_t sid = state_of_targets(d, key);
            if (sid < 0) return false;
            std::fill(row.begin() + spans[i], row.begin() + spans[i + 1] + 1, sid);
        }
    } else if (!moving.empty()) {
        // Between two class boundaries of the members' spans every member has one target or none.
        std::vector<int32_t> starts;
        for (int32_t s : moving) {
            const std::vector<int32_t>& spans = d->spans[s];
            for (size_t i = 0; i < spans.size(); i += 3) {
                starts.push_back(spans[i]);
                starts.push_back(spans[i + 1] + 1);
            }
        }
        std::sort(starts.begin(), starts.end());
        starts.erase(std::unique(starts.begin(), starts.end()), starts.end());
        std::vector<std::vector<int32_t>> segments(starts.size());
        for (int32_t s : moving) {
            const std::vector<int32_t>& spans = d->spans[s];
            for (size_t i = 0; i < spans.size(); i += 3) {
                const size_t a = std::lower_bound(starts.begin(), starts.end(), spans[i]) - starts.begin();
                const size_t b = std::lower_bound(starts.begin(), starts.end(), spans[i + 1] + 1) - starts.begin();
                for (size_t k = a; k < b; ++k) segments[k].push_back(spans[i + 2]);
            }
        }
        for (size_t k = 0; k + 1 < starts.size(); ++k) {
            if (segments[k].empty()) continue;
            const int32_t sid = state_of_targets(d, segments[k]);
            if (sid < 0) return false;
            std::fill(row.begin() + starts[k], row.begin() + starts[k + 1], sid);
        }
    }
    int32_t* out = reinterpret_cast<int32_t*>(d->io[IO_TABLE]) + static_cast<int64_t>(q) * d->num_classes;
    std::copy(row.begin() + 1, row.end(), out + 1);
    __atomic_store_n(out, row[0], __ATOMIC_RELEASE);
    d->done[q] = 1;
    d->bytes -= static_cast<int64_t>(d->members[q].size()) * 4;
    std::vector<int32_t>().swap(d->members[q]);
    d->io[IO_ROWS] += 1;
    return true;
}

}  // namespace

extern "C" {

GmSubset* gm_subset_new(const int32_t* classes, int32_t all_live, int64_t* io, gm_expand expand, gm_grow grow) {
    GmSubset* d = new GmSubset();
    std::copy(classes, classes + 256, d->classes);
    d->num_classes = *std::max_element(classes, classes + 256) + 1;
    d->all_live = all_live != 0;
    d->io = io;
    d->expand = expand;
    d->grow = grow;
    d->members.emplace_back();  // the dead state
    d->done.push_back(1);
    d->named.push_back(nullptr);
    return d;
}

void gm_subset_free(GmSubset* d) {
    delete d->builder;
    delete d;
}

// Records {state, kind, count, payload[count]} (byte: ranges as first byte, last byte, target;
// split: targets), a later record of a state replacing the earlier one.
void gm_subset_push(GmSubset* d, const int32_t* records, int64_t length) { push(d, records, length); }

// Liveness of NFA states 0 .. n - 1 (where not all live: the NFA is built whole by then).
void gm_subset_live(GmSubset* d, const uint8_t* live, int64_t n) {
    if (static_cast<size_t>(n) > d->kind.size()) resize(d, static_cast<size_t>(n));
    std::copy(live, live + n, d->live.begin());
}

// The builder takes over building the NFA (states 0 .. n - 1 made, `dist` theirs): `nodes` (5 ints a
// node: kind, a, b, c, fewest bytes; `num_nodes`), `children`, `bytes` (the literals'), templates
// `tpl` (num_templates + 1), `tstate` (2 a template state, one pair more), `ranges` (3 a range);
// the pending states as (state, node, lo, hi, continuation) and the memo as (node, lo, hi,
// continuation, state), `max_states` the NFA's cap.
void gm_builder_start(GmSubset* d, const int32_t* nodes, int64_t num_nodes, const int32_t* children,
                      int64_t num_children, const int32_t* bytes, int64_t num_bytes, const int32_t* tpl,
                      int64_t num_templates, const int32_t* tstate, const int32_t* ranges, int64_t num_ranges,
                      const int32_t* dist, int64_t n, const int32_t* pending, int64_t num_pending,
                      const int32_t* memo, int64_t num_memo, int64_t max_states) {
    Builder* b = new Builder();
    b->node.assign(nodes, nodes + 5 * num_nodes);
    b->children.assign(children, children + num_children);
    b->bytes.assign(bytes, bytes + num_bytes);
    b->tpl.assign(tpl, tpl + num_templates + 1);
    const int32_t states = tpl[num_templates];
    b->tstate.assign(tstate, tstate + 2 * (states + 1));
    b->ranges.assign(ranges, ranges + 3 * num_ranges);
    b->dist.assign(dist, dist + n);
    b->pending.assign(static_cast<size_t>(n), Pending{NO_NODE, 0, 0, 0});
    for (int64_t i = 0; i < num_pending; ++i) {
        const int32_t* p = pending + 5 * i;
        b->pending[p[0]] = Pending{p[1], p[2], p[3], p[4]};
    }
    b->num_pending = num_pending;
    for (int64_t i = 0; i < num_memo; ++i) {
        const int32_t* m = memo + 5 * i;
        b->memo.emplace(Key{m[0], m[1], m[2], m[3]}, m[4]);
    }
    b->max_states = max_states;
    if (static_cast<size_t>(n) > d->kind.size()) resize(d, static_cast<size_t>(n));
    delete d->builder;
    d->builder = b;
}

// The builder's records since the last call (written to `out` where they fit `cap`, then dropped):
// their count. Records: {0, state, dist, 3 n, (lo, hi, target) n times} a byte state, {3, state,
// dist, node, lo, hi, continuation} a pending one, {1, state, n, targets} a pending state built,
// {4, node, lo, hi, continuation, state} a memo entry; in the order made.
int64_t gm_builder_export(GmSubset* d, int32_t* out, int64_t cap) {
    if (d->builder == nullptr) return 0;
    std::vector<int32_t>& records = d->builder->out;
    const int64_t n = static_cast<int64_t>(records.size());
    if (n <= cap) {
        std::copy(records.begin(), records.end(), out);
        std::vector<int32_t>().swap(records);
    }
    return n;
}

// The builder stops (Python builds from here on, its NFA brought up to date from gm_builder_export).
void gm_builder_stop(GmSubset* d) {
    delete d->builder;
    d->builder = nullptr;
}

// NFA states made (by either side, as far as known here), and those pending in the builder.
int64_t gm_builder_states(GmSubset* d, int32_t pending) {
    if (pending) return d->builder == nullptr ? 0 : d->builder->num_pending;
    return static_cast<int64_t>(d->kind.size());
}

// The fewest bytes from DFA state q's NFA states to the match (the builder's distances), -2 where its
// row is computed (its states are dropped) or no builder builds.
int64_t gm_builder_member_dist(GmSubset* d, int32_t q) {
    if (d->builder == nullptr || q < 0 || static_cast<size_t>(q) >= d->members.size() || d->done[q]) return -2;
    int64_t best = FAR;
    for (int32_t m : d->members[q]) best = std::min<int64_t>(best, d->builder->dist[m]);
    return best;
}

// The DFA state of NFA state q's closure (the initial state); -1 on failure.
int32_t gm_subset_start(GmSubset* d, int32_t q) {
    if (!close(d, q)) return -1;
    std::vector<int32_t> set = d->closure[q];
    return state_of(d, set);
}

// q's row computed (if it was not): the table's address, or NULL on failure. gm_walk's fetch.
const int32_t* gm_subset_fetch(void* ctx, int32_t q) {
    GmSubset* d = static_cast<GmSubset*>(ctx);
    if (!d->done[q] && !compute_row(d, q)) return nullptr;
    return reinterpret_cast<const int32_t*>(d->io[IO_TABLE]);
}

// DFA state q's NFA states while its row is unknown (`all` false), or ever (`all` true): the count
// (written to `out` where it fits `cap`), -1 once its row is computed (`all` false) or for an id
// that is no state.
int64_t gm_subset_members(GmSubset* d, int32_t q, int32_t all, int32_t* out, int64_t cap) {
    if (q < 0 || static_cast<size_t>(q) >= d->members.size()) return -1;  // no such state (yet)
    const std::vector<int32_t>* set = all ? d->named[q] : (d->done[q] ? nullptr : &d->members[q]);
    if (set == nullptr) return -1;
    const int64_t n = static_cast<int64_t>(set->size());
    if (n <= cap) std::copy(set->begin(), set->end(), out);
    return n;
}

int64_t gm_subset_bytes(GmSubset* d) {
    const Builder* b = d->builder;
    const int64_t building = b == nullptr ? 0 : static_cast<int64_t>(b->memo.size()) * 48
        + static_cast<int64_t>(b->dist.size()) * 20 + static_cast<int64_t>(b->out.capacity()) * 4
        + static_cast<int64_t>(b->node.size() + b->children.size() + b->bytes.size() + b->tpl.size()
                               + b->tstate.size() + b->ranges.size()) * 4;
    return building + d->bytes + static_cast<int64_t>(d->kind.size()) * 80 + static_cast<int64_t>(d->ids.size()) * 48
           + static_cast<int64_t>(d->by_targets.size()) * 48;
}

}  // extern "C"
