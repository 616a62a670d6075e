// fsdp-cpp umbrella header: rendezvous, communicator, fully_shard, whole-model state,
// clip_grad_norm_, activation checkpointing, containers, deferred initialisation.
#pragma once

#include <fsdp/activation_checkpoint.h>
#include <fsdp/clip_grad_norm.h>
#include <fsdp/communicator.h>
#include <fsdp/containers.h>
#include <fsdp/deferred_init.h>
#include <fsdp/elastic.h>
#include <fsdp/error.h>
#include <fsdp/fully_shard.h>
#include <fsdp/init.h>
#include <fsdp/mesh.h>
#include <fsdp/options.h>
#include <fsdp/quantized.h>
#include <fsdp/state_dict.h>
