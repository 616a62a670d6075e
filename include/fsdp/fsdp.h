// fsdp-cpp umbrella header: rendezvous, communicator, fully_shard.
#pragma once

#include <fsdp/communicator.h>
#include <fsdp/error.h>
#include <fsdp/fully_shard.h>
#include <fsdp/init.h>
#include <fsdp/mesh.h>
#include <fsdp/options.h>
