// The tiny GPT configuration shared by tests that train a few steps (parity, checkpoints).
#pragma once

#include <fsdp/models/gpt.h>

namespace fsdp::testing {

inline fsdp::models::GPTConfig tiny_gpt() {
  fsdp::models::GPTConfig c;
  c.vocab_size = 32;
  c.seq_len = 8;
  c.n_layer = 2;
  c.n_head = 2;
  c.n_embd = 16;
  return c;
}

}  // namespace fsdp::testing
