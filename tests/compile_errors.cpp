// Misuse that must not compile, each with a message that names the fix (issue 10, item 5).
// tests/compile_errors.cmake compiles this file once per FSDP_CASE with -fsyntax-only and checks
// the compiler's output for the message.
#include <fsdp/fsdp.h>
#include <torch/torch.h>

struct PairImpl : torch::nn::Module {
  torch::Tensor forward(const torch::Tensor& x) { return x; }
};
TORCH_MODULE(Pair);

struct Unsupported {
  torch::Tensor t;
};
struct OddImpl : torch::nn::Module {
  Unsupported forward(const torch::Tensor& x) { return {x}; }
};
TORCH_MODULE(Odd);

void misuse(std::shared_ptr<fsdp::Communicator> comm) {
#if FSDP_CASE == 1  // a plain holder
  Pair plain;
  fsdp::fully_shard(plain, comm);
#elif FSDP_CASE == 2  // a forward result fsdp-cpp cannot look into
  fsdp::Sharded<Odd> odd;
  fsdp::fully_shard(odd, comm);
  odd(torch::ones({1}));
#elif FSDP_CASE == 3  // a module that is not a supported container
  Pair plain;
  fsdp::fully_shard_elements(plain, comm);
#endif
}
