// Precompiled header for the core library: ATen, autograd and c10d, never torch/torch.h.
// Not ProcessGroupGloo.hpp: only src/compat/gloo.cpp includes it (its gloo headers).
#pragma once
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/variable.h>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
