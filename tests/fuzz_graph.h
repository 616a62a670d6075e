// Random training programs over sharded modules, for the guarantee fuzzer (guarantee_fuzz_test).
//
// A Net is a root with 2-5 blocks. Each block is sharded through its fsdp::Sharded holder, as a
// container element gathered on first use, or not at all (its parameters then belong to the
// root's group), with its own reshard setting and, for holders, activation checkpointing. Blocks
// have unequal or equal sizes, tied weights within a group, frozen weights, weights on a branch
// that does not reach the input, outputs that ignore the input, and one kind modifies its input in
// place (the caller uses the modified input afterwards, as `h = a(x); y = ip(h); f(y, h)` does).
//
// A training program is 3-4 iterations; each is 1-3 micro-batches (gradient sync only on the
// last, on every one, or under HSDP the all-reduce only on the last), then optionally
// clip_grad_norm_, then an SGD (momentum, weight decay), Adam or AdamW step on the shards
// (LibTorch's, or fsdp::optim's fused SGD and AdamW), then zero_grad one of three ways. Every
// forward draws its own pass: which block is called on which earlier value (blocks called several
// times or never), and per rank which values enter the loss, which block inputs are detached and
// whether the root's parameters are used. Extra forwards, evaluation (no grad) or grad mode without
// backward, come at random places: before, between and after the micro-batches, and after the
// step; so do the user's writes to parameters outside autograd (through .data() or in place under
// NoGradGuard).
//
// FSDP2's settings vary too: a gradient divide factor per group, unshard(async) on a block before
// an iteration (waited or not, called by the pass or not), set_unshard_in_backward(false) on
// blocks whose backward reads no weight, blocks called through another method (Sharded::call).
//
// Ranks call different blocks: a third of the passes give some ranks calls of their own (other
// blocks, subsets, repeats, other orders, their own loss terms), and a tenth of the programs are
// one forward in which the ranks call different blocks of equal size (what used to exchange the
// wrong groups' bytes). Gradients must still equal the unsharded model's (mean over ranks, a block
// a rank did not call contributing zeros there). Everything in fp64.
#pragma once

#include <fsdp/fsdp.h>
#include <fsdp/quantized.h>
#include <torch/torch.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

namespace fsdp::testing::fuzz {

constexpr int64_t kWidth = 5;

enum class BlockKind { kTied, kBranch, kIgnoresInput, kFrozenTied, kInPlace, kCount };
const char* const kKindNames[] = {"tied", "branch", "ignores-input", "frozen-tied", "in-place"};

// How a block's parameters lie in memory (Program::layout): each a contiguous tensor of its own,
// or as users build them: transposed, a column slice of a wider tensor, views into one buffer.
enum class Layout { kOwn, kTransposedA, kSharedBuffer, kTransposedB, kSlicedB, kCount };
const char* const kLayoutNames[] = {"own", "wa transposed", "wa+ba one buffer", "wb transposed",
                                    "wb sliced"};

struct BlockImpl : torch::nn::Module {
  BlockImpl(BlockKind kind, int64_t rows, Layout layout = Layout::kOwn) : kind(kind) {
    const auto f64 = torch::kDouble;
    // kIgnoresInput never multiplies x by wa: one row, so that wa.sum(0)'s gradient is ba's
    // gradient viewed as wa (gradients of one node that share storage).
    const int64_t wa_rows = kind == BlockKind::kIgnoresInput ? 1 : kWidth;
    at::Tensor a, b, c;
    switch (layout) {
      case Layout::kTransposedA:
        a = (torch::randn({kWidth, wa_rows}, f64) * 0.4).t();
        break;
      case Layout::kSharedBuffer: {  // wa and ba at offsets of one buffer (ba first)
        auto buf = torch::randn({2 + kWidth + wa_rows * kWidth}, f64) * 0.3;
        b = buf.narrow(0, 1, kWidth);
        a = buf.narrow(0, 1 + kWidth, wa_rows * kWidth).view({wa_rows, kWidth});
        break;
      }
      case Layout::kTransposedB:
        c = (torch::randn({kWidth, rows}, f64) * 0.3).t();
        break;
      case Layout::kSlicedB:
        c = (torch::randn({rows, kWidth + 3}, f64) * 0.3).narrow(1, 2, kWidth);
        break;
      default:
        break;
    }
    wa = register_parameter("wa", a.defined() ? a : torch::randn({wa_rows, kWidth}, f64) * 0.4);
    ba = register_parameter("ba", b.defined() ? b : torch::randn({kWidth}, f64) * 0.1);
    wb = register_parameter("wb", c.defined() ? c : torch::randn({rows, kWidth}, f64) * 0.3,
                            /*requires_grad=*/kind != BlockKind::kFrozenTied);
  }
  // A weight in the dtype of the input it multiplies (a no-op unless mixed precision kept some
  // parameters in fp64: Program::keep).
  static torch::Tensor as(const torch::Tensor& w, const torch::Tensor& x) {
    return w.to(x.scalar_type());
  }
  // Two outputs, (B, kWidth) each.
  std::vector<torch::Tensor> forward(torch::Tensor x) {
    if (kind == BlockKind::kInPlace) x.mul_(1.5);  // the caller's tensor changes too
    // Both outputs of kIgnoresInput ignore x: its input-side node and anything only it leads to
    // get no gradient.
    auto a = kind == BlockKind::kIgnoresInput
                 ? torch::tanh(wa.sum(0) + ba).expand({x.size(0), kWidth})
                 : torch::tanh(x.matmul(as(wa, x)) + ba);
    torch::Tensor b;
    switch (kind) {
      case BlockKind::kTied:
      case BlockKind::kFrozenTied:
        b = x.matmul(as(wb, x).t()).matmul(as(wb, x));  // wb used twice
        break;
      case BlockKind::kBranch:
        b = a * wb.pow(2).sum(0);  // wb on a branch that does not reach x
        break;
      case BlockKind::kInPlace:
        b = x * wb.sum(0);
        break;
      default:
        b = wb.sum(0).expand({x.size(0), kWidth});  // ignores x
    }
    // In the input's dtype: under mixed precision a parameter kept in fp64 would otherwise turn
    // values fp64, and a holder casts such an input to fp32, a copy that an in-place block then
    // changes instead of the caller's tensor (as FSDP2's cast does), which the fp64 reference
    // cannot follow.
    return {a.to(x.scalar_type()), b.to(x.scalar_type())};
  }
  // Another method, called through Sharded::call (FSDP2's register_fsdp_forward_method).
  std::vector<torch::Tensor> encode(torch::Tensor x) {
    const auto dtype = x.scalar_type();
    auto outs = forward(std::move(x));
    outs[0] = (outs[0] * 0.5 + ba).to(dtype);
    return outs;
  }
  BlockKind kind;
  torch::Tensor wa, ba, wb;
};
TORCH_MODULE(Block);

struct Call {
  int block;  // which child
  int input;  // index into the value pool
};
// What one rank does with a pass's values.
struct RankChoice {
  std::vector<char> detach;  // per call: detach the block's input
  std::vector<int> loss_terms;
  bool use_root_w = true, use_root_scale = true;
};
// One forward of the model: the calls of each rank and each rank's choices. Pool: value 0 is the
// root's input projection; call c appends its two outputs and its input as the block left it
// (values 1 + 3c, 2 + 3c, 3 + 3c).
struct Pass {
  std::vector<std::vector<Call>> calls;  // per rank
  std::vector<RankChoice> ranks;
  bool same_calls() const {
    for (const auto& c : calls)
      if (c.size() != calls[0].size() ||
          !std::equal(c.begin(), c.end(), calls[0].begin(), [](const Call& a, const Call& b) {
            return a.block == b.block && a.input == b.input;
          }))
        return false;
    return true;
  }
};

enum class BlockMode { kHolder, kOnUse, kInRoot };
enum class Optim { kSGD, kAdamW, kAdam };
enum class ZeroGrad { kSetToNone, kZeroInPlace, kOptimizer };
enum class Extra { kEval, kGrad };  // a forward without backward: no grad / grad mode
// How micro-batches reduce: only the last syncs (set_requires_gradient_sync), every one syncs, or
// (HSDP) every one reduce-scatters and only the last all-reduces (set_requires_all_reduce).
// kFinalize: every micro-batch without sync, then FSDPModule::finalize_backward reduces them.
enum class Accumulate { kSyncLast, kSyncEvery, kAllReduceLast, kFinalize };
const char* const kAccumulateNames[] = {"sync-last", "sync-every", "all-reduce-last", "finalize"};

// A write to the sharded parameters by the user, outside autograd: at a forward's boundary (`at`
// as ExtraForward's), each parameter Program::writes_to picks becomes a * p + b elementwise, the
// same on the shards and the reference's full tensors. kData writes through `.data()` (no version
// bump: what LibTorch 1.13's optimizers and hand-written updates do), kNoGrad in place under
// NoGradGuard (a version bump).
enum class WriteKind { kData, kNoGrad };
struct Write {
  int at;
  WriteKind kind;
  double a, b;
};

struct ExtraForward {
  int at;  // before micro-batch `at`; == micro-batches: after the last, before the step; +1: after
  Extra kind;
  Pass pass;
};
struct Iteration {
  std::vector<Pass> micro;  // the last one syncs gradients
  std::vector<ExtraForward> extras;
  std::vector<Write> writes;
  double clip = 0;  // max norm for clip_grad_norm_; 0: no clipping
  ZeroGrad zero = ZeroGrad::kSetToNone;
  // Before the first micro-batch: unshard(/*async_op=*/true) on this holder block (-1: none),
  // waited explicitly or left to its forward (a block the pass never calls: to the backward's end).
  int async_unshard = -1;
  bool async_wait = false;
};

struct Program {
  uint64_t seed = 0;
  int world = 2;
  int replicas = 1;  // HSDP: 2 at world 4 when drawn
  std::vector<BlockKind> kinds;
  std::vector<int64_t> rows;
  std::vector<BlockMode> modes;
  std::vector<int> child_reshard;  // per block: -1 default, 0 false, 1 true, k >= 2: world k
  std::vector<bool> checkpointed;  // activation checkpointing (holders only)
  int root_reshard = -1;
  int max_unsharded_groups = 2;
  bool audit = true;
  // Verified collectives (on by default): the period drawn (1: every byte, 8: the default's
  // rotating part), or off (0). The check changes no value: the exactness is the same.
  int verify_period = 8;
  bool input_requires_grad = false;
  Optim optim = Optim::kSGD;
  // The sharded side steps with fsdp::optim's fused SGD / AdamW (flat runs over the shards'
  // storage, raw writes) instead of LibTorch's; the reference keeps LibTorch's.
  bool fused = false;
  // Iteration::writes: 0 none, else a salt that picks about half of the parameters written.
  uint32_t write = 0;
  // The sharded side's model is built under fsdp::deferred_init and materialised after
  // fully_shard (the same values as the eager build; not with ignored parameters, which must
  // have values when sharded).
  bool deferred = false;
  double lr = 0.1, momentum = 0, weight_decay = 0;
  bool swapped = false;  // one forward in which ranks call other blocks of equal size
  // The first call's first output enters every loss (so that the loss needs grad). Hand-written
  // programs may leave it out; they must then make the loss depend on a trainable weight.
  bool anchor_loss = true;
  // The communicator's transport (FSDP_TRANSPORT): "" for the default (shared memory between
  // local ranks), or "tcp" (Gloo point-to-point), "collective" (Gloo's own collectives).
  std::string transport;
  // FSDP2's settings, drawn after the transport: set_gradient_divide_factor per holder block and
  // for the root (last entry; 0: the mean), and how micro-batches reduce.
  std::vector<double> divide;
  Accumulate accumulate = Accumulate::kSyncLast;
  // Per block: set_unshard_in_backward(false) (holders of a kind whose backward reads no weight).
  std::vector<char> no_backward_unshard;
  // Per block: its calls go to BlockImpl::encode through Sharded::call instead of forward.
  std::vector<char> encode;
  // set_all_reduce_hook per holder block and for the root (last entry; 0: none): a hook that
  // all-reduces a tensor of ones over the ranks (a collective inside backward) and scales the
  // reduced block by this factor.
  std::vector<double> hook;
  // Per block and for the root (last entry): set_keep_unsharded_storage(true).
  std::vector<char> keep_storage;
  // ShardOptions::offload_policy for every group: 0 none, 1 CPUOffloadPolicy{}, 2 with
  // pin_memory false. On CPU parameters it must change nothing (and pin nothing).
  int offload = 0;
  // Per block and for the root (last entry): custom collectives (bit 1: set_custom_all_gather,
  // bit 2: set_custom_reduce_scatter), exact re-implementations through other collectives.
  std::vector<char> custom;
  // ShardOptions::shard_placement_fn for every group: 0 none (dim 0), else a salt that picks, for
  // each parameter of two or more dims, a dim (sometimes counted from the end) or dim 0
  // (shard_dim below).
  uint32_t placement = 0;
  // Per block: 1 when it and the next block are sharded together as one group (fully_shard of a
  // module list); the next block then has this one's group settings.
  std::vector<char> listed;
  // Per block: how its parameters lie in memory (empty: each a contiguous tensor of its own).
  std::vector<Layout> layout;
  // ShardOptions::mixed_precision for every group (SGD programs): 0 none; param_dtype fp32
  // (forward and backward in fp32 on fp64 shards) with reduce_dtype 1: fp32, 2: fp64. mixed_output:
  // the root casts its output (the loss) back to fp64.
  int mixed = 0;
  bool mixed_output = false;
  // With mixed precision: 0, or a salt that picks about a third of the parameters (keeps below)
  // for MixedPrecisionPolicy::param_dtype_override_fn to keep in fp64.
  uint32_t keep = 0;
  // ShardOptions::ignored_params: 0 none, else a salt that picks about a quarter of the parameters
  // (ignores below), each passed to the fully_shard call of its group. Every rank keeps and steps
  // its own copy of those. Not with mixed precision, which leaves them in fp64.
  uint32_t ignore = 0;
  // FSDPModule::set_reduce_scatter_unused_params(true) on the root (recursively): a parameter no
  // rank gave a gradient gets zeros instead of keeping what it had.
  bool reduce_unused = false;
  // ShardOptions::broadcast_buffers on the root: rank 0's buffers before every forward of the root.
  bool broadcast_buffers = false;
  // After the last step: a checkpoint saved, consolidated (rank 0) and loaded at another world size
  // (the first world - 1 ranks, plain FSDP), each against the reference.
  bool checkpoint = false;
  // RuntimeOptions::calls_may_differ on the root: every forward gather through a round. A program
  // whose ranks' calls differ anywhere declares it in any case (calls_differ); `undeclared` leaves
  // it off even then (such a program must fail by name).
  bool calls_may_differ = false;
  bool undeclared = false;
  // ShardOptions::gather_transform_fn for every group: 0 none, else a salt that picks about half
  // of the parameters to travel through an exact GatherTransform (the shard's own bytes on a byte
  // wire, decoded and cast as the plain gather casts).
  uint32_t transform = 0;
  // Quantized collectives (fsdp/quantized.h) for every group: quantized_gather and
  // set_quantized_reduce_scatter (the groups with a handle: holders and the root), each none, bf16
  // or int8. The reference puts the same values through the same wire (tests'
  // guarantee_fuzz_test.cpp), so the sharded side must still equal it at fp64's rounding.
  Quantization quant_gather = Quantization::kNone, quant_reduce = Quantization::kNone;
  std::vector<Iteration> iterations;

  // Some forward (a micro-batch or an extra one) gives some rank calls of its own.
  bool calls_differ() const {
    for (const auto& it : iterations) {
      for (const auto& pass : it.micro)
        if (!pass.same_calls()) return true;
      for (const auto& e : it.extras)
        if (!e.pass.same_calls()) return true;
    }
    return false;
  }
  bool declares() const { return !undeclared && (calls_may_differ || calls_differ()); }

  // Whether parameter `name` (the model's name, e.g. "b1.wa") is one of the ignored ones.
  bool ignores(const std::string& name) const { return ignore && salted(ignore, name) % 4 == 0; }
  // Whether the user's writes (Iteration::writes) change parameter `name`.
  bool writes_to(const std::string& name) const { return write && salted(write, name) % 2 == 0; }
  // Whether parameter `name` travels through the exact gather transform.
  bool transforms(const std::string& name) const {
    return transform && salted(transform, name) % 2 == 0;
  }
  // Whether mixed precision keeps parameter `name` in fp64.
  bool keeps(const std::string& name) const { return keep && salted(keep, name) % 3 == 0; }
  // The group parameter `name` (the model's name) is sharded in: "b<k>" for holder block k (the
  // first block's of a listed pair for both), "on<k>" for block k sharded on use, "root" for the
  // root's own parameters and the blocks left in it.
  std::string group_of(const std::string& name) const {
    for (size_t b = 0; b < kinds.size(); ++b) {
      if (name.rfind("b" + std::to_string(b) + ".", 0) != 0) continue;
      if (modes[b] == BlockMode::kOnUse) return "on" + std::to_string(b);
      if (modes[b] == BlockMode::kInRoot) return "root";
      const size_t first = b > 0 && b - 1 < listed.size() && listed[b - 1] ? b - 1 : b;
      return "b" + std::to_string(first);
    }
    return "root";
  }
  static uint32_t salted(uint32_t salt, const std::string& name) {
    uint32_t h = 2166136261u ^ (salt * 2654435761u);  // FNV-1a over the salted name
    for (char c : name) h = (h ^ static_cast<unsigned char>(c)) * 16777619u;
    return h >> 7;
  }

  // How close the sharded side must come to the fp64 reference: to rounding in fp64, or, under
  // mixed precision, to fp32's, relative to each tensor's largest value (a dropped, repeated or
  // misrouted gradient is off by far more).
  double rtol() const { return mixed ? 1e-5 : 1e-9; }
  double atol() const { return mixed ? 1e-7 : 1e-12; }

  // The entry of per-group settings `v` (per block, the root last; empty: none) for parameter
  // `name`'s group: its holder block's, the root's for a block in the root, 0 for an element.
  double of_group(const std::vector<double>& v, const std::string& name) const {
    double f = v.empty() ? 0 : v.back();
    for (size_t b = 0; b + 1 < v.size(); ++b)
      if (name.rfind("b" + std::to_string(b) + ".", 0) == 0)
        f = modes[b] == BlockMode::kHolder ? v[b] : modes[b] == BlockMode::kInRoot ? f : 0;
    return f;
  }
  // The divisor of parameter `name`'s reduced gradient: its group's factor, else the world size.
  double divisor(const std::string& name) const {
    const double f = of_group(divide, name);
    return f > 0 ? f : world;
  }
  // What the group's all-reduce hook multiplies the reduced gradient by (1: no hook).
  double hook_scale(const std::string& name) const {
    const double f = of_group(hook, name);
    return f > 0 ? f : 1;
  }

  std::string describe() const {
    std::string s = "seed " + std::to_string(seed) + " world " + std::to_string(world) +
                    (replicas > 1 ? " (HSDP 2x2)" : "") + ": " + std::to_string(kinds.size()) +
                    " blocks [";
    for (size_t b = 0; b < kinds.size(); ++b) {
      s +=
          std::string(b ? ", " : "") + kKindNames[static_cast<int>(kinds[b])] + " " +
          std::to_string(rows[b]) + " rows " +
          (modes[b] == BlockMode::kHolder  ? "holder"
           : modes[b] == BlockMode::kOnUse ? "on-use"
                                           : "in-root") +
          " reshard " + std::to_string(child_reshard[b]) + (checkpointed[b] ? " AC" : "") +
          (b < no_backward_unshard.size() && no_backward_unshard[b] ? " no-backward-unshard" : "") +
          (b < encode.size() && encode[b] ? " encode" : "") +
          (b < keep_storage.size() && keep_storage[b] ? " keep-storage" : "") +
          (b < custom.size() && custom[b] ? " custom" + std::to_string(custom[b]) : "") +
          (b < listed.size() && listed[b] ? " LISTED with the next" : "") +
          (b < layout.size() && layout[b] != Layout::kOwn
               ? std::string(" ") + kLayoutNames[static_cast<int>(layout[b])]
               : "");
    }
    s +=
        "], root reshard " + std::to_string(root_reshard) +
        (keep_storage.size() > kinds.size() && keep_storage.back() ? " keep-storage" : "") +
        (custom.size() > kinds.size() && custom.back() ? " custom" + std::to_string(custom.back())
                                                       : "") +
        (offload ? offload == 1 ? ", offload pinned" : ", offload" : "") +
        (placement ? ", placement " + std::to_string(placement) : "") +
        (mixed ? std::string(", mixed precision fp32, reduce ") + (mixed == 1 ? "fp32" : "fp64") +
                     (mixed_output ? ", output fp64" : "") +
                     (keep ? ", keeping fp64 " + std::to_string(keep) : "")
               : "") +
        (ignore ? ", ignored params " + std::to_string(ignore) : "") +
        (reduce_unused ? ", reduce-scatter unused params" : "") +
        (broadcast_buffers ? ", broadcast buffers" : "") +
        (checkpoint ? ", checkpoint round trip" : "") + (declares() ? ", calls_may_differ" : "") +
        (transform ? ", gather transforms " + std::to_string(transform) : "") +
        (quant_gather != Quantization::kNone
             ? std::string(", quantized gathers ") + fsdp::to_string(quant_gather)
             : "") +
        (quant_reduce != Quantization::kNone
             ? std::string(", quantized reductions ") + fsdp::to_string(quant_reduce)
             : "") +
        (verify_period == 0 ? ", verify off" : ", verify period " + std::to_string(verify_period)) +
        ", audit " + (audit ? "on" : "off") + ", max_unsharded_groups " +
        std::to_string(max_unsharded_groups) + ", " +
        (optim == Optim::kSGD    ? "SGD momentum " + std::to_string(momentum)
         : optim == Optim::kAdam ? std::string("Adam")
                                 : std::string("AdamW")) +
        " wd " + std::to_string(weight_decay) + (fused ? " fused" : "") +
        (write ? ", writes " + std::to_string(write) : "") + (deferred ? ", deferred_init" : "") +
        (swapped ? ", SWAPPED CALLS" : "") + (transport.empty() ? "" : ", transport " + transport) +
        ", " + kAccumulateNames[static_cast<int>(accumulate)];
    for (size_t b = 0; b < divide.size(); ++b)
      if (divide[b] > 0)
        s += ", divide " + (b + 1 < divide.size() ? "b" + std::to_string(b) : std::string("root")) +
             " by " + std::to_string(divide[b]);
    for (size_t b = 0; b < hook.size(); ++b)
      if (hook[b] > 0)
        s += ", hook " + (b + 1 < hook.size() ? "b" + std::to_string(b) : std::string("root")) +
             " x" + std::to_string(hook[b]);
    for (size_t i = 0; i < iterations.size(); ++i) {
      const auto& it = iterations[i];
      s += "; it" + std::to_string(i) + ": " + std::to_string(it.micro.size()) + " micro";
      for (size_t m = 0; m < it.micro.size(); ++m)
        if (!it.micro[m].same_calls()) s += " (m" + std::to_string(m) + ": calls differ)";
      for (const auto& e : it.extras)
        s += std::string(", ") + (e.kind == Extra::kEval ? "eval" : "grad") + "@" +
             std::to_string(e.at);
      for (const auto& w : it.writes)
        s += std::string(", write ") + (w.kind == WriteKind::kData ? "data" : "no-grad") + "@" +
             std::to_string(w.at);
      if (it.clip > 0) s += ", clip " + std::to_string(it.clip);
      if (it.async_unshard >= 0)
        s += ", unshard(async) b" + std::to_string(it.async_unshard) +
             (it.async_wait ? " waited" : "");
      s += ", zero " + std::to_string(static_cast<int>(it.zero));
    }
    return s;
  }
};

class Drawer {
 public:
  Drawer(uint64_t seed, int world) : rng_(seed * 7919 + static_cast<uint64_t>(world) * 104729) {}
  int pick(int n) { return static_cast<int>(rng_() % static_cast<uint64_t>(n)); }
  bool chance(int one_in) { return pick(one_in) == 0; }
  double uniform(double lo, double hi) {
    return lo + (hi - lo) * static_cast<double>(rng_() % 1000000) / 1e6;
  }

  // 1-5 calls of the given blocks, each on an earlier value.
  std::vector<Call> calls(const std::vector<int>& blocks) {
    const int n = 1 + pick(5);
    std::vector<Call> cs;
    for (int c = 0; c < n; ++c) {
      const int pool = 1 + 3 * c;
      cs.push_back(Call{blocks[pick(static_cast<int>(blocks.size()))],
                        chance(2) ? pick(pool) : pool - 1 - pick(std::min(pool, 3))});
    }
    return cs;
  }
  RankChoice choice(size_t calls) {
    RankChoice rc;
    for (size_t c = 0; c < calls; ++c) rc.detach.push_back(chance(6));
    const int values = 1 + 3 * static_cast<int>(calls);
    const int terms = 1 + pick(3);
    for (int t = 0; t < terms; ++t) rc.loss_terms.push_back(1 + pick(values - 1));
    rc.use_root_w = !chance(4);
    rc.use_root_scale = !chance(3);
    return rc;
  }
  Pass pass(int blocks, int world) {
    Pass p;
    std::vector<int> all(blocks);
    for (int b = 0; b < blocks; ++b) all[b] = b;
    const auto cs = calls(all);
    for (int r = 0; r < world; ++r) {
      p.calls.push_back(cs);
      p.ranks.push_back(choice(cs.size()));
    }
    return p;
  }
  // Some ranks make calls of their own: any blocks or a subset of them, repeated, in any order.
  void diverge(Pass& p, int blocks) {
    for (size_t r = 0; r < p.calls.size(); ++r) {
      if (!chance(2)) continue;
      std::vector<int> subset;
      for (int b = 0; b < blocks; ++b)
        if (!chance(3)) subset.push_back(b);
      if (subset.empty()) subset.push_back(pick(blocks));
      p.calls[r] = calls(subset);
      p.ranks[r] = choice(p.calls[r].size());
    }
  }

 private:
  std::mt19937_64 rng_;
};

// Drawn last, so that a seed's other draws stay what they were before transports were drawn.
inline std::string draw_transport(Drawer& d) {
  const int t = d.pick(4);
  return t < 2 ? std::string() : t == 2 ? "tcp" : "collective";
}

// FSDP2's FSDPModule settings, drawn after the transport (the earlier draws stay as they were).
// Drawn after every other setting (the earlier draws stay as they were): the fused optimizers on
// the sharded side, and the user's writes to parameters between forwards: before a micro-batch,
// after the backwards (before the step) or after the step, where a group may still be gathered
// (reshard_after_forward false, an extra forward before the step, kept storage).
inline void draw_writes(Drawer& d, Program& p) {
  if (p.optim != Optim::kAdam) p.fused = d.chance(3);
  if (!d.chance(3)) return;
  p.write = 1 + static_cast<uint32_t>(d.pick(1 << 20));
  for (auto& it : p.iterations) {
    const int micro = static_cast<int>(it.micro.size());
    const int n = d.pick(3);
    for (int w = 0; w < n; ++w)
      it.writes.push_back(Write{d.pick(micro + 2),
                                d.chance(2) ? WriteKind::kData : WriteKind::kNoGrad,
                                d.uniform(0.8, 1.1), d.uniform(-0.05, 0.05)});
  }
}

inline void draw_fsdp2_settings(Drawer& d, Program& p) {
  const int blocks = static_cast<int>(p.kinds.size());
  if (d.chance(3))
    for (int g = 0; g <= blocks; ++g) p.divide.push_back(d.chance(2) ? d.uniform(0.5, 8) : 0);
  const int a = d.pick(3);
  p.accumulate = a == 2 && p.replicas == 1 ? Accumulate::kSyncEvery : static_cast<Accumulate>(a);
  std::vector<int> holders;
  for (int b = 0; b < blocks; ++b)
    if (p.modes[b] == BlockMode::kHolder) holders.push_back(b);
  for (auto& it : p.iterations) {
    if (holders.empty() || !d.chance(3)) continue;
    it.async_unshard = holders[d.pick(static_cast<int>(holders.size()))];
    it.async_wait = d.chance(2);
  }
  // Only kIgnoresInput's backward reads none of its weights (sums and tanh of its own output).
  p.no_backward_unshard.assign(blocks, 0);
  for (int b : holders)
    if (p.kinds[b] == BlockKind::kIgnoresInput && !p.checkpointed[b] && d.chance(2))
      p.no_backward_unshard[b] = 1;
  for (int b = 0; b < blocks; ++b) p.encode.push_back(d.chance(4));
}

inline Program make_program(uint64_t seed, int world) {
  Drawer d(seed, world);
  Program p;
  p.seed = seed;
  p.world = world;
  p.swapped = d.chance(10);
  if (world == 4 && d.chance(2)) p.replicas = 2;
  const int blocks = 2 + d.pick(4);
  const bool equal_sizes = p.swapped || d.chance(3);
  for (int b = 0; b < blocks; ++b) {
    p.kinds.push_back(static_cast<BlockKind>(d.pick(static_cast<int>(BlockKind::kCount))));
    p.rows.push_back(equal_sizes ? 3 : 1 + d.pick(7));
    p.child_reshard.push_back(d.pick(3) - 1);
    const int mode = d.pick(5);
    p.modes.push_back(mode < 3    ? BlockMode::kHolder
                      : mode == 3 ? BlockMode::kOnUse
                                  : BlockMode::kInRoot);
    // Checkpointing replays forward, which must not see its input changed in place by itself
    // (refused by name: ActivationCheckpointTest).
    p.checkpointed.push_back(p.modes[b] == BlockMode::kHolder &&
                             p.kinds[b] != BlockKind::kInPlace && d.chance(3));
  }
  p.root_reshard = d.pick(3) - 1;
  p.max_unsharded_groups = 1 + d.pick(2);
  p.audit = d.chance(3);
  p.input_requires_grad = d.chance(2);
  // Adam's weight decay is added to the gradient: a parameter with a zero gradient moves, one
  // with none does not (as AdamW's decoupled decay and SGD's momentum).
  p.optim = d.chance(2) ? Optim::kSGD : d.chance(3) ? Optim::kAdam : Optim::kAdamW;
  p.lr = p.optim == Optim::kSGD ? 0.1 : 0.01;
  if (p.optim == Optim::kSGD && !d.chance(3)) p.momentum = 0.9;
  if (!d.chance(2)) p.weight_decay = 0.05;
  if (p.swapped) {
    // Every block through its holder with the same settings, one synced forward and backward:
    // the ranks gather as many groups of the same sizes, only other ones.
    for (int b = 0; b < blocks; ++b) {
      p.kinds[b] = BlockKind::kTied;
      p.modes[b] = BlockMode::kHolder;
      p.child_reshard[b] = -1;
      p.checkpointed[b] = false;
    }
    Iteration it;
    it.micro.push_back(d.pass(blocks, world));
    for (int r = 1; r < world; ++r) {
      auto& c = it.micro[0].calls[r][0];
      c.block = (c.block + 1 + d.pick(blocks - 1)) % blocks;
    }
    p.iterations.push_back(it);
    p.transport = draw_transport(d);
    draw_fsdp2_settings(d, p);
    return p;
  }
  const int iterations = 3 + d.pick(2);
  for (int i = 0; i < iterations; ++i) {
    Iteration it;
    const int micro = 1 + d.pick(3);
    for (int m = 0; m < micro; ++m) it.micro.push_back(d.pass(blocks, world));
    const int extras = d.chance(2) ? 0 : 1 + d.pick(2);
    for (int e = 0; e < extras; ++e)
      it.extras.push_back(ExtraForward{d.pick(micro + 2), d.chance(2) ? Extra::kEval : Extra::kGrad,
                                       d.pass(blocks, world)});
    if (d.chance(3)) it.clip = d.chance(2) ? d.uniform(0.001, 0.05) : d.uniform(0.5, 5);
    it.zero = static_cast<ZeroGrad>(d.pick(3));
    p.iterations.push_back(it);
  }
  p.transport = draw_transport(d);
  draw_fsdp2_settings(d, p);
  // Drawn last (the earlier draws stay as they were): ranks whose calls differ.
  for (auto& it : p.iterations) {
    for (auto& pass : it.micro)
      if (d.chance(3)) d.diverge(pass, blocks);
    for (auto& e : it.extras)
      if (d.chance(3)) d.diverge(e.pass, blocks);
  }
  // Then all-reduce hooks.
  if (d.chance(3))
    for (int g = 0; g <= blocks; ++g) p.hook.push_back(d.chance(2) ? d.uniform(0.5, 3) : 0);
  // Then smaller post-forward worlds (hpZ): a group that reshards after forward keeps 1/k and
  // gathers within k ranks in backward, k a divisor of the shard group's size above 1.
  const int shard = world / p.replicas;
  auto draw_world = [&](int& reshard) {
    if (reshard == 0 || !d.chance(2)) return;
    std::vector<int> ks;
    for (int k = 2; k <= shard; ++k)
      if (shard % k == 0) ks.push_back(k);
    if (!ks.empty()) reshard = ks[d.pick(static_cast<int>(ks.size()))];
  };
  for (int b = 0; b < blocks; ++b)
    if (p.modes[b] == BlockMode::kHolder) draw_world(p.child_reshard[b]);
  draw_world(p.root_reshard);
  // Then gathered storage kept across reshards (holders and the root).
  if (d.chance(3))
    for (int g = 0; g <= blocks; ++g)
      p.keep_storage.push_back((g == blocks || p.modes[g] == BlockMode::kHolder) && d.chance(2));
  // Then CPUOffloadPolicy.
  if (d.chance(4)) p.offload = 1 + d.pick(2);
  // Then custom collectives (holders and the root).
  if (d.chance(4))
    for (int g = 0; g <= blocks; ++g)
      p.custom.push_back(g == blocks || p.modes[g] == BlockMode::kHolder ? d.pick(4) : 0);
  // Then shard placements other than dim 0.
  if (d.chance(3)) p.placement = 1 + static_cast<uint32_t>(d.pick(1 << 20));
  // Then finalize_backward after backwards without sync.
  if (d.chance(6)) p.accumulate = Accumulate::kFinalize;
  // Then module lists: two neighbouring holders as one group, the second taking the first's
  // group settings (the reference reads them per block).
  if (d.chance(3)) {
    p.listed.assign(blocks, 0);
    for (int b = 0; b + 1 < blocks; ++b) {
      const bool pair = p.modes[b] == BlockMode::kHolder && p.modes[b + 1] == BlockMode::kHolder &&
                        !p.no_backward_unshard[b] && !p.no_backward_unshard[b + 1] &&
                        !(p.checkpointed[b] && p.kinds[b + 1] == BlockKind::kInPlace) &&
                        (b == 0 || !p.listed[b - 1]);
      if (!pair || !d.chance(2)) continue;
      p.listed[b] = 1;
      p.child_reshard[b + 1] = p.child_reshard[b];
      p.checkpointed[b + 1] = p.checkpointed[b];
      for (auto* v : {&p.divide, &p.hook})
        if (!v->empty()) (*v)[b + 1] = (*v)[b];
      for (auto* v : {&p.keep_storage, &p.custom})
        if (!v->empty()) (*v)[b + 1] = (*v)[b];
    }
  }
  // Then parameters that are not contiguous tensors of their own.
  if (d.chance(3))
    for (int b = 0; b < blocks; ++b)
      p.layout.push_back(
          d.chance(2) ? Layout::kOwn
                      : static_cast<Layout>(1 + d.pick(static_cast<int>(Layout::kCount) - 1)));
  // Then mixed precision, with SGD only: AdamW divides each gradient by its own running scale, so
  // fp32's rounding of a gradient near zero can move a weight by up to the learning rate, beyond
  // any bound that would still tell a wrong gradient from rounding.
  if (d.chance(5) && p.optim == Optim::kSGD) {
    p.mixed = 1 + d.pick(2);
    p.mixed_output = d.chance(2);
    if (d.chance(2)) p.keep = 1 + static_cast<uint32_t>(d.pick(1 << 20));
  }
  // Then ignored parameters.
  if (d.chance(4) && !p.mixed) p.ignore = 1 + static_cast<uint32_t>(d.pick(1 << 20));
  // Then zero gradients for parameters no rank used, buffers broadcast, a checkpoint round trip
  // (at another world size: needs two ranks; parameters in their own dtypes: no mixed precision).
  p.reduce_unused = d.chance(6);
  p.broadcast_buffers = d.chance(4);
  p.checkpoint = world > 1 && !p.mixed && d.chance(5);
  // Then the declaration where calls never differ (rounds with identical calls).
  p.calls_may_differ = d.chance(4);
  // Then gather transforms.
  if (d.chance(6)) p.transform = 1 + static_cast<uint32_t>(d.pick(1 << 20));
  // Then verified collectives: the full check, the default's rotating part, or off.
  p.verify_period = d.chance(3) ? 1 : d.chance(4) ? 0 : 8;
  // Then quantized collectives, where the reference's model of the wire holds: plain FSDP on
  // parameters in fp64 sharded on dim 0, no other gather transform or custom collective in the
  // way; quantized gathers with the backward gathering over the whole group (no hpZ), quantized
  // reductions once per iteration (a wire per micro-batch rounds each micro-batch's part alone,
  // which the reference's one accumulated gradient per rank cannot show).
  if (d.chance(4) && p.replicas == 1 && !p.mixed) {
    p.quant_gather = static_cast<Quantization>(d.pick(3));
    p.quant_reduce = static_cast<Quantization>(d.pick(3));
    if (p.quant_gather != Quantization::kNone || p.quant_reduce != Quantization::kNone) {
      p.placement = 0;
      p.transform = 0;
    }
    const int custom_bits = (p.quant_gather != Quantization::kNone ? 1 : 0) |
                            (p.quant_reduce != Quantization::kNone ? 2 : 0);
    for (auto& c : p.custom) c = static_cast<char>(c & ~custom_bits);
    if (p.quant_gather != Quantization::kNone) {
      p.root_reshard = std::min(p.root_reshard, 1);
      for (auto& k : p.child_reshard) k = std::min(k, 1);
    }
    if (p.quant_reduce != Quantization::kNone && p.accumulate == Accumulate::kSyncEvery)
      p.accumulate = Accumulate::kSyncLast;
  }
  draw_writes(d, p);
  p.deferred = !p.ignore && d.chance(4);
  return p;
}

// Program::placement's choice for a parameter (the same on every rank: a hash of its name).
inline std::optional<fsdp::Shard> shard_dim(uint32_t placement, const std::string& name,
                                            const at::Tensor& t) {
  if (!placement || t.dim() < 2) return std::nullopt;
  uint32_t h = 2166136261u ^ placement;  // FNV-1a
  for (char c : name) h = (h ^ static_cast<unsigned char>(c)) * 16777619u;
  const int64_t pick = h % (t.dim() + 1);
  if (pick == t.dim()) return std::nullopt;
  return fsdp::Shard{(h >> 16) & 1 ? pick - t.dim() : pick};
}

struct NetImpl : torch::nn::Module {
  explicit NetImpl(const Program& p) : anchor_loss(p.anchor_loss), encode(p.encode) {
    root_w = register_parameter("root_w", torch::randn({kWidth, kWidth}, torch::kDouble) * 0.4);
    root_scale = register_parameter("root_scale", torch::randn({3}, torch::kDouble) * 0.2);
    root_bias = register_parameter("root_bias", torch::randn({}, torch::kDouble) * 0.3);  // 0-d
    root_buf = register_buffer("root_buf", torch::arange(2, torch::kDouble));  // never read
    for (size_t b = 0; b < p.kinds.size(); ++b)
      blocks.push_back(register_module(
          "b" + std::to_string(b),
          Block(p.kinds[b], p.rows[b], b < p.layout.size() ? p.layout[b] : Layout::kOwn)));
  }
  // x: (B, kWidth). Returns this rank's scalar loss for `pass`.
  torch::Tensor forward(const torch::Tensor& x, const Pass& pass, int rank) {
    const RankChoice& rc = pass.ranks[rank];
    const auto& calls = pass.calls[rank];
    std::vector<torch::Tensor> pool{rc.use_root_w ? torch::tanh(x.matmul(BlockImpl::as(root_w, x)))
                                                  : x * 0.5};
    for (size_t c = 0; c < calls.size(); ++c) {
      auto in = pool[calls[c].input];
      if (rc.detach[c]) in = in.detach();
      // A value of its own for a block that changes its input in place: no node saved it.
      if (blocks[calls[c].block]->kind == BlockKind::kInPlace) in = in + 1;
      const int b = calls[c].block;
      auto outs = b < static_cast<int>(encode.size()) && encode[b]
                      ? blocks[b].call(&BlockImpl::encode, in)
                      : blocks[b](in);
      pool.push_back(outs[0]);
      pool.push_back(outs[1]);
      pool.push_back(in);  // as the block left it
    }
    // The first call's first output always depends on a trainable weight: the loss needs grad.
    auto loss = anchor_loss ? pool[1].sum() * 0.01 : torch::zeros({}, torch::kDouble);
    for (int t : rc.loss_terms) loss = loss + (pool[t] * 0.7).pow(2).mean();
    if (rc.use_root_scale)
      loss = loss * (1 + root_scale.pow(2).sum()) +
             0.1 * BlockImpl::as(root_bias, pool[1]) * pool[1].mean();
    return loss;
  }
  bool anchor_loss;
  std::vector<char> encode;
  torch::Tensor root_w, root_scale, root_bias, root_buf;
  std::vector<fsdp::Sharded<Block>> blocks;
};
TORCH_MODULE(Net);

// The input of rank `rank` for forward `which` of iteration `iteration`.
inline torch::Tensor input_for(const Program& p, int rank, int iteration, int which) {
  torch::manual_seed(static_cast<int64_t>(p.seed * 131 + static_cast<uint64_t>(rank) * 17 +
                                          static_cast<uint64_t>(iteration) * 7 +
                                          static_cast<uint64_t>(which)));
  return torch::randn({3, kWidth}, torch::kDouble).set_requires_grad(p.input_requires_grad);
}

}  // namespace fsdp::testing::fuzz
