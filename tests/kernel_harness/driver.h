// main() for the kernel harness. Reads problems from stdin until EOF, each:
//   int32 dtype (0 = float32, 1 = bfloat16, 2 = float16), batch, vocab, num_rows, num_words,
//   grid[3], threadgroup[3] (what the caller passes to MLX, in threads),
//   logits (batch * vocab elements of the dtype's width), mask table (num_rows * num_words uint32),
//   rows (batch uint32);
// runs the kernel over MLX's launch grid and writes the batch * vocab output elements to stdout.
// The generated translation unit defines harness_launch() before including this file.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <vector>

struct HarnessProblem {
  int32_t dtype, batch, vocab, num_rows, num_words;
  int32_t grid[3], group_size[3];  // not "threadgroup": a Metal keyword the shim defines away
  std::vector<unsigned char> logits;
  std::vector<uint32_t> mask_table;
  std::vector<uint32_t> rows;
};

// Launches the kernel for `p` and writes into `out` (batch * vocab elements).
void harness_launch(const HarnessProblem& p, unsigned char* out);

static bool harness_read(void* dst, size_t bytes) {
  return bytes == 0 || std::fread(dst, 1, bytes, stdin) == bytes;
}

int main() {
  for (;;) {
    HarnessProblem p;  // fresh, exact-size buffers per problem: AddressSanitizer sees any overrun
    if (!harness_read(&p.dtype, sizeof(int32_t))) {
      break;
    }
    if (!harness_read(&p.batch, sizeof(int32_t)) || !harness_read(&p.vocab, sizeof(int32_t)) ||
        !harness_read(&p.num_rows, sizeof(int32_t)) || !harness_read(&p.num_words, sizeof(int32_t)) ||
        !harness_read(p.grid, sizeof p.grid) || !harness_read(p.group_size, sizeof p.group_size)) {
      std::fprintf(stderr, "truncated header\n");
      return 2;
    }
    const size_t width = p.dtype == 0 ? 4 : 2;
    const size_t count = static_cast<size_t>(p.batch) * p.vocab;
    p.logits.resize(count * width);
    p.mask_table.resize(static_cast<size_t>(p.num_rows) * p.num_words);
    p.rows.resize(p.batch);
    if (!harness_read(p.logits.data(), p.logits.size()) ||
        !harness_read(p.mask_table.data(), p.mask_table.size() * 4) ||
        !harness_read(p.rows.data(), p.rows.size() * 4)) {
      std::fprintf(stderr, "truncated problem\n");
      return 2;
    }
    std::vector<unsigned char> out(count * width, 0xAB);  // a pattern no kernel writes on its own
    harness_launch(p, out.data());
    if (std::fwrite(out.data(), 1, out.size(), stdout) != out.size()) {
      return 3;
    }
  }
  return 0;
}
