// fsdp-cpp umbrella header: rendezvous, communicator, fully_shard, whole-model state.
#pragma once

#include <fsdp/communicator.h>
#include <fsdp/error.h>
#include <fsdp/fully_shard.h>
#include <fsdp/init.h>
#include <fsdp/mesh.h>
#include <fsdp/options.h>
#include <fsdp/state_dict.h>
