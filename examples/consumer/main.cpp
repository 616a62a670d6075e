// The consumer project's program: shards a Linear layer, runs forward and backward, saves a
// checkpoint.
// Usage: consumer CHECKPOINT_DIR (one rank without launcher variables; any number with fsdp-run).
#include <fsdp/checkpoint.h>
#include <fsdp/fsdp.h>
#include <torch/nn/modules/linear.h>
#include <torch/utils.h>

#include <iostream>

int main(int argc, char** argv) try {
  auto world = fsdp::init_process_group();
  torch::manual_seed(0);
  fsdp::Sharded<torch::nn::Linear> layer(8, 4);
  auto root = fsdp::fully_shard(layer, world);
  auto loss = layer(torch::ones({2, 8})).square().sum();
  loss.backward();
  auto dir = fsdp::checkpoint::save(argc > 1 ? argv[1] : "ckpt", root, nullptr, {}, *world);
  std::cout << "consumer ok: loss " << loss.item<float>() << ", saved " << dir << std::endl;
  return 0;
} catch (const std::exception& e) {
  std::cerr << e.what() << "\n";
  return 1;
}
