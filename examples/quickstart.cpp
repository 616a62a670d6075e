// The README's quick-start example: an ordinary torch::nn model, sharded with two one-word changes.
// Run it on two local ranks with: build/bin/fsdp-run -n 2 build/bin/fsdp-example
#include <fsdp/fsdp.h>
#include <torch/torch.h>

#include <iostream>

struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int64_t d)
      : fc1(register_module("fc1", torch::nn::Linear(d, 4 * d))),
        fc2(register_module("fc2", torch::nn::Linear(4 * d, d))) {}
  torch::Tensor forward(const torch::Tensor& x) { return x + fc2(torch::gelu(fc1(x))); }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Block);

struct NetImpl : torch::nn::Module {
  NetImpl(int64_t d, int64_t depth) {
    for (int64_t i = 0; i < depth; ++i)
      blocks.push_back(register_module("block" + std::to_string(i), Block(d)));
    head = register_module("head", torch::nn::Linear(d, 1));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = x;
    for (auto& b : blocks) h = b(h);
    return head(h);
  }
  std::vector<fsdp::Sharded<Block>> blocks;  // instead of std::vector<Block>
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Net);

int main() try {
  auto world = fsdp::init_process_group();  // torchrun / mpirun / srun / fsdp-run variables
  torch::manual_seed(0);                    // the same initial model on every rank
  fsdp::Sharded<Net> model(64, 4);          // instead of Net model(64, 4);
  for (auto& block : model->blocks) fsdp::fully_shard(block, world);  // one group per block
  auto root = fsdp::fully_shard(model, world);                        // the rest: the head
  torch::optim::AdamW opt(root.parameters(), torch::optim::AdamWOptions(1e-3));
  for (int step = 0; step < 20; ++step) {
    torch::manual_seed(1000 * step + world->rank());  // each rank its own data
    auto x = torch::randn({8, 64});
    auto loss = torch::mse_loss(model(x), x.sum(1, true));
    loss.backward();  // gradients: reduce-scattered, the mean over ranks, in root.parameters()
    opt.step();
    opt.zero_grad();
    if (world->rank() == 0 && step % 5 == 0)
      std::cout << "step " << step << " loss " << loss.item<float>() << std::endl;
  }
  return 0;
} catch (const std::exception& e) {
  std::cerr << e.what() << "\n";
  return 1;
}
