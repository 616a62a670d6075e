// Building the model and optimizer of fsdp-train (model_setup.h). Shares the models' precompiled
// <torch/torch.h>.
#include "train/model_setup.h"

#include <fsdp/deferred_init.h>
#include <fsdp/error.h>
#include <fsdp/optim.h>
#include <fsdp/quantized.h>
#include <torch/torch.h>

#include <sstream>

#include "train/rounding_collectives.h"

namespace fsdp::train {

MixedPrecisionPolicy mixed_precision_policy(const std::string& name, const std::string& reduce,
                                            bool root) {
  FSDP_CHECK(name != "fp16",
             "--mixed-precision fp16 computes in float16, which LibTorch 1.13's CPU kernels lack "
             "(no Half LayerNorm or matmul; it would work on CUDA): use bf16 or none");
  FSDP_CHECK(name == "none" || name == "bf16", "--mixed-precision is '", name,
             "'; expected bf16, fp16 or none");
  MixedPrecisionPolicy p;
  if (name == "none") return p;
  p.param_dtype = torch::kBFloat16;
  // The reduce-scatter in bf16 too (half its bytes), or left unset: the parameters' fp32, the
  // default of fsdp-cpp and of torch 2.15's FSDP2.
  if (reduce != "fp32") p.reduce_dtype = torch::kBFloat16;
  if (root) p.output_dtype = torch::kFloat;
  return p;
}

namespace {
// --forward-prefetch: off or unshard replace the implicit forward prefetch (backward's stays).
void set_forward_prefetch(const std::string& how, TrainModel& m,
                          std::function<void(size_t)>& before_block,
                          const std::vector<FSDPModule>& blocks) {
  if (how == "auto") return;
  for (auto b : blocks) b.set_modules_to_forward_prefetch({});
  m.root.set_modules_to_forward_prefetch({});
  if (how == "unshard")
    before_block = [blocks = std::vector<FSDPModule>(blocks)](size_t i) mutable {
      if (i + 1 < blocks.size()) blocks[i + 1].unshard(/*async_op=*/true);  // forward waits
    };
}
// --custom-collectives bf16-round on one group.
void set_rounding_collectives(FSDPModule& group) {
  group.set_custom_all_gather(std::make_shared<Bf16RoundingAllGather>());
  group.set_custom_reduce_scatter(std::make_shared<Bf16RoundingReduceScatter>());
}
// --ignored-params: the named parameters, per block ("<prefix><i>." names) and the root's (the
// rest, last entry); an unknown name is an error listing what names look like.
std::vector<std::vector<at::Tensor>> ignored_params(const std::string& names,
                                                    torch::nn::Module& model, size_t blocks,
                                                    const std::string& prefix) {
  std::vector<std::vector<at::Tensor>> out(blocks + 1);
  const auto params = model.named_parameters();
  std::stringstream list(names);
  for (std::string name; std::getline(list, name, ',');) {
    if (name.empty()) continue;
    const at::Tensor* p = params.find(name);
    FSDP_CHECK(p != nullptr, "--ignored-params: '", name,
               "' is not a parameter of the model; names are those of its checkpoints, e.g. ",
               prefix == "h." ? "ln_f.weight, wpe.weight, h.0.ln_1.bias"
                              : "model.norm.weight, model.layers.0.input_layernorm.weight");
    size_t group = blocks;
    for (size_t i = 0; i < blocks; ++i)
      if (name.rfind(prefix + std::to_string(i) + ".", 0) == 0) group = i;
    out[group].push_back(*p);
  }
  return out;
}

// The blocks' and the root's options of the settings (before the per-block exceptions).
std::pair<ShardOptions, ShardOptions> shard_options(const TrainConfig& cfg) {
  ShardOptions block_options;
  block_options.reshard_after_forward = cfg.reshard_after_forward;
  if (cfg.reshard_after_forward && cfg.reshard_after_forward_world > 0)
    block_options.reshard_after_forward = cfg.reshard_after_forward_world;
  block_options.runtime.activation_checkpointing = cfg.activation_checkpointing;
  block_options.mixed_precision =
      mixed_precision_policy(cfg.mixed_precision, cfg.mixed_precision_reduce, false);
  ShardOptions root_options;
  root_options.mixed_precision =
      mixed_precision_policy(cfg.mixed_precision, cfg.mixed_precision_reduce, true);
  root_options.runtime.verify_collectives = cfg.verify_collectives != "off";
  root_options.runtime.verify_period = cfg.verify_collectives == "full" ? 1 : 8;
  block_options.gather_transform_fn = root_options.gather_transform_fn =
      quantized_gather(parse_quantization(cfg.quantize_gather));
  if (cfg.shard_dim != 0) {
    const int64_t dim = cfg.shard_dim;
    block_options.shard_placement_fn = root_options.shard_placement_fn =
        [dim](const std::string&, const at::Tensor& p) -> std::optional<fsdp::Shard> {
      if (p.dim() >= 2) return fsdp::Shard{dim};
      return std::nullopt;
    };
  }
  return {block_options, root_options};
}

// fully_shard over the mesh as models::shard_gpt / shard_llama lay it out (one group per block,
// the root another), with the settings' options. The last block keeps its parameters from
// forward into backward, whose first use they are (torchtitan does the same): resharding it would
// gather it again at once, exposed.
template <class Root, class Block>
void shard_model(const TrainConfig& cfg, TrainModel& m, fsdp::Sharded<Root>& root,
                 std::vector<fsdp::Sharded<Block>>& blocks, const std::string& prefix) {
  auto [block_options, root_options] = shard_options(cfg);
  const auto ignored = ignored_params(cfg.ignored_params, *root, blocks.size(), prefix);
  root_options.ignored_params = ignored.back();
  std::vector<FSDPModule> handles;
  for (size_t i = 0; i < blocks.size(); ++i) {
    ShardOptions o = block_options;
    o.ignored_params = ignored[i];
    if (i + 1 == blocks.size()) o.reshard_after_forward = false;
    handles.push_back(fully_shard(blocks[i], m.mesh, o));
    if (o.reshard_after_forward.value_or(true).world() != 1)
      for (const auto& p : blocks[i]->parameters()) m.regathered_count += p.numel();
  }
  m.root = fully_shard(root, m.mesh, root_options);
  if (cfg.custom_collectives == "bf16-round") {
    for (FSDPModule h : handles) set_rounding_collectives(h);
    set_rounding_collectives(m.root);
  }
  std::vector<FSDPModule> groups = handles;
  groups.push_back(m.root);
  set_quantized_reduce_scatter(groups, parse_quantization(cfg.quantize_reduce));
  set_forward_prefetch(cfg.forward_prefetch, m, root->before_block, handles);
}
}  // namespace

at::Tensor TrainModel::logits(const at::Tensor& idx) { return llama ? llama(idx) : gpt(idx); }

torch::nn::Module& TrainModel::module() {
  return llama ? static_cast<torch::nn::Module&>(*llama) : static_cast<torch::nn::Module&>(*gpt);
}

std::unique_ptr<TrainModel> build_model(const TrainConfig& cfg,
                                        const std::shared_ptr<Communicator>& comm,
                                        const DeviceMesh* mesh) {
  models::GPTConfig mc;
  models::LlamaConfig lc;
  if (cfg.model == "llama") {
    lc = llama_config_of(cfg);
  } else {
    mc.vocab_size = cfg.vocab;
    mc.seq_len = cfg.seq;
    mc.n_layer = cfg.layers;
    mc.n_head = cfg.heads;
    mc.n_embd = cfg.width;
    mc.validate();
  }
  // Every rank (and the unsharded reference) draws the same initial weights from the same seed.
  torch::manual_seed(cfg.seed);
  auto m = std::make_unique<TrainModel>();
  // Sharded: built under deferred_init, so a rank never holds the whole model (only its shards,
  // filled by materialize with the values an eager build gives, bitwise); eagerly with
  // --ignored-params, which need their values before fully_shard.
  const bool deferred = comm && cfg.ignored_params.empty();
  if (cfg.model == "llama")
    m->llama = deferred ? fsdp::deferred_init([&] { return fsdp::Sharded<models::Llama>(lc); })
                        : fsdp::Sharded<models::Llama>(lc);
  else
    m->gpt = deferred ? fsdp::deferred_init([&] { return fsdp::Sharded<models::GPT>(mc); })
                      : fsdp::Sharded<models::GPT>(mc);
  if (comm) {
    m->mesh = mesh ? *mesh : init_mesh(comm, cfg.hsdp);
    if (m->llama) {
      shard_model(cfg, *m, m->llama, m->llama->model->layers, "model.layers.");
      if (deferred) fsdp::materialize(m->llama);
    } else {
      shard_model(cfg, *m, m->gpt, m->gpt->blocks, "h.");
      if (deferred) fsdp::materialize(m->gpt);
    }
    for (const ShardInfo& s : m->root.shards()) {
      int64_t numel = 1;
      for (int64_t d : s.global_shape) numel *= d;
      m->parameter_count += numel;
      if (!s.requires_grad) continue;
      (s.global_shape.size() >= 2 ? m->decay : m->no_decay).push_back(s.shard);
    }
  } else {
    for (const auto& p : m->module().parameters()) {
      m->parameter_count += p.numel();
      (p.dim() >= 2 ? m->decay : m->no_decay).push_back(p);
    }
  }
  return m;
}

std::unique_ptr<torch::optim::AdamW> build_optimizer(const TrainConfig& cfg, TrainModel& m) {
  auto options = [&](double wd) {
    return std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(cfg.lr)
                                                            .betas({cfg.beta1, cfg.beta2})
                                                            .eps(cfg.eps)
                                                            .weight_decay(wd));
  };
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(m.decay, options(cfg.weight_decay));
  groups.emplace_back(m.no_decay, options(0.0));
  if (cfg.optimizer == "torch")
    return std::make_unique<torch::optim::AdamW>(std::move(groups), *options(0.0));
  return std::make_unique<fsdp::optim::AdamW>(std::move(groups), *options(0.0));
}

}  // namespace fsdp::train
