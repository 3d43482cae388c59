// The cpu-native path: an MLX primitive that masks logits by packed mask rows in one pass.
//
// out[b, t] = logits[b, t] if bit t of row rows[b] of table tables[b] is set, else -inf, bit for
// bit (the logits are copied as integers, never computed with: NaN payloads, -0.0 and infinities
// stay exact). The mask layout is the package docstring's (grammar_mlx/kernels/__init__.py): row
// r allows token t iff bit t % 32 of word t // 32 is set; columns past 32 * W are disallowed and
// padding bits past V are ignored. A batch row whose table index is -1 allows every token.
//
// Built at first use by kernels/cpu_native.py (g++, with nanobind's sources, linked against the
// libmlx the running mlx.core loaded) and imported as a Python module whose functions take and
// return mlx.core arrays: it joins mlx.core's nanobind domain ("mlx"), so the array type caster
// is mlx's own. The row ids and table picks live in the primitive (host ints), so a call makes
// no array but its output, and eval runs on MLX's stream thread without Python.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/stream.h"

namespace mx = mlx::core;
namespace nb = nanobind;

namespace {

// Masks one row of V logits (element stride `step`) into `out` (contiguous) by the packed
// words `words` (word stride `wstep`, `num_words` of them; nullptr: every token allowed).
// U is the logits' integer view; `neg_inf` the bits of -inf in it. Cloned for AVX2 where the CPU
// has it (the per-lane select vectorises with variable shifts there); the default clone is the
// baseline ISA, so the cached library runs on any x86-64.
template <typename U>
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx2", "default")))
#endif
void mask_row(const U* in, int64_t step, U* out, const uint32_t* words, int64_t wstep,
              int64_t num_words, int64_t vocab, U neg_inf) {
  if (words == nullptr) {
    if (step == 1) {
      std::memcpy(out, in, sizeof(U) * vocab);
    } else {
      for (int64_t t = 0; t < vocab; ++t) out[t] = in[t * step];
    }
    return;
  }
  const int64_t covered = std::min<int64_t>(vocab, 32 * num_words);  // bits past V: padding
  const int64_t full = covered / 32;
  if (step == 1) {
    for (int64_t w = 0; w < full; ++w) {
      const uint32_t m = words[w * wstep];
      const U* src = in + 32 * w;
      U* dst = out + 32 * w;
      for (int j = 0; j < 32; ++j) {
        // keep is all ones where the bit is set: ((x ^ -inf) & keep) ^ -inf is x or -inf.
        const U keep = static_cast<U>(U(0) - static_cast<U>((m >> j) & 1u));
        dst[j] = static_cast<U>(((src[j] ^ neg_inf) & keep) ^ neg_inf);
      }
    }
  } else {
    for (int64_t w = 0; w < full; ++w) {
      const uint32_t m = words[w * wstep];
      for (int j = 0; j < 32; ++j) {
        const int64_t t = 32 * w + j;
        out[t] = ((m >> j) & 1u) ? in[t * step] : neg_inf;
      }
    }
  }
  if (covered > 32 * full) {  // the last, partial word: its bits below `covered`
    const uint32_t m = words[full * wstep];
    for (int64_t t = 32 * full; t < covered; ++t) {
      out[t] = ((m >> (t - 32 * full)) & 1u) ? in[t * step] : neg_inf;
    }
  }
  for (int64_t t = covered; t < vocab; ++t) out[t] = neg_inf;  // columns past the table
}

class TokenBitmask : public mx::UnaryPrimitive {
 public:
  // inputs: [logits, table_0, ..., table_{k-1}]; batch row b reads row rows[b] of table
  // tables[b] (an index into the tables; -1: every token allowed).
  TokenBitmask(mx::Stream stream, std::vector<int32_t> tables, std::vector<int32_t> rows)
      : mx::UnaryPrimitive(stream), tables_(std::move(tables)), rows_(std::move(rows)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const mx::array& logits = inputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) encoder.set_input_array(a);
    encoder.set_output_array(out);

    struct Row {
      const uint32_t* words;  // nullptr: every token allowed
      int64_t wstep;
      int64_t num_words;
    };
    std::vector<Row> picked;
    picked.reserve(rows_.size());
    for (size_t b = 0; b < rows_.size(); ++b) {
      if (tables_[b] < 0) {
        picked.push_back({nullptr, 0, 0});
        continue;
      }
      const mx::array& table = inputs[1 + tables_[b]];
      picked.push_back({table.data<uint32_t>() + rows_[b] * table.strides()[0], table.strides()[1], table.shape(1)});
    }
    const int64_t batch = logits.shape(0), vocab = logits.shape(1);
    const int64_t rstep = logits.strides()[0], step = logits.strides()[1];
    const mx::Dtype dtype = logits.dtype();
    if (dtype == mx::float32) {
      encoder.dispatch([in = logits.data<uint32_t>(), o = out.data<uint32_t>(), picked = std::move(picked), batch,
                        vocab, rstep, step]() {
        for (int64_t b = 0; b < batch; ++b) {
          const Row& r = picked[b];
          mask_row<uint32_t>(in + b * rstep, step, o + b * vocab, r.words, r.wstep, r.num_words, vocab,
                             0xFF800000u);
        }
      });
    } else {
      const uint16_t neg_inf = dtype == mx::bfloat16 ? 0xFF80 : 0xFC00;
      encoder.dispatch([in = logits.data<uint16_t>(), o = out.data<uint16_t>(), picked = std::move(picked), batch,
                        vocab, rstep, step, neg_inf]() {
        for (int64_t b = 0; b < batch; ++b) {
          const Row& r = picked[b];
          mask_row<uint16_t>(in + b * rstep, step, o + b * vocab, r.words, r.wstep, r.num_words, vocab, neg_inf);
        }
      });
    }
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("grammar_mlx TokenBitmask has no GPU kernel (the metal/cuda paths mask there)");
  }

  const char* name() const override { return "GrammarMlxTokenBitmask"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const TokenBitmask&>(other);
    return tables_ == o.tables_ && rows_ == o.rows_;
  }

 private:
  std::vector<int32_t> tables_;
  std::vector<int32_t> rows_;
};

mx::Stream cpu_stream() {
  // The current default stream where it is a CPU one (mlx-lm's generation stream, `with
  // mx.stream(...)`), else the CPU device's default stream.
  mx::Stream s = mx::default_stream(mx::default_device());
  return s.device == mx::Device::cpu ? s : mx::default_stream(mx::Device::cpu);
}

void fail(const std::string& message) { throw std::invalid_argument(message); }

mx::array masked(const mx::array& logits, const std::vector<mx::array>& tables, std::vector<int32_t> picks,
                std::vector<int32_t> rows) {
  if (logits.ndim() != 2) fail("logits must be 2-D (batch, vocab)");
  const mx::Dtype dtype = logits.dtype();
  if (dtype != mx::float32 && dtype != mx::bfloat16 && dtype != mx::float16)
    fail("logits must be float32, bfloat16 or float16");
  const int64_t batch = logits.shape(0), vocab = logits.shape(1);
  if (static_cast<int64_t>(rows.size()) != batch || static_cast<int64_t>(picks.size()) != batch)
    fail("need one row id and one table pick per row of logits");
  for (const auto& t : tables) {
    if (t.ndim() != 2 || t.dtype() != mx::uint32) fail("mask tables must be 2-D uint32");
    if (t.shape(1) > (vocab + 31) / 32) fail("a mask table is wider than the logits' vocabulary");
  }
  for (int64_t b = 0; b < batch; ++b) {
    const int32_t k = picks[b];
    if (k < -1 || k >= static_cast<int32_t>(tables.size())) fail("table pick out of range");
    if (k >= 0 && (rows[b] < 0 || rows[b] >= tables[k].shape(0))) fail("row id out of range");
  }
  std::vector<mx::array> inputs{logits};
  inputs.insert(inputs.end(), tables.begin(), tables.end());
  return mx::array(logits.shape(), dtype, std::make_shared<TokenBitmask>(cpu_stream(), std::move(picks), std::move(rows)),
                   std::move(inputs));
}

}  // namespace

NB_MODULE(_gm_token_bitmask, m) {
  m.doc() = "grammar_mlx's cpu-native token bitmask primitive (kernels/token_bitmask_cpu.cpp)";
  m.def(
      "apply_rows",
      [](const mx::array& logits, const mx::array& table, std::vector<int32_t> rows) {
        std::vector<int32_t> picks(rows.size(), 0);
        return masked(logits, {table}, std::move(picks), std::move(rows));
      },
      nb::arg("logits"), nb::arg("table"), nb::arg("rows"),
      "Mask (B, V) logits by rows `rows` (B ints) of one packed uint32 table.");
  m.def("apply_picks", &masked, nb::arg("logits"), nb::arg("tables"), nb::arg("picks"), nb::arg("rows"),
        "Mask (B, V) logits row b by row rows[b] of tables[picks[b]] (picks[b] = -1: all allowed).");
}
