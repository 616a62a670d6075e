// fsdp-coordinator: serves the c10d TCPStore in which the replicas of an elastic job meet
// (fsdp/elastic.h): their memberships, votes and lane rendezvous. It holds no training state and
// lives apart from every rank, so that no replica's death takes the store with it. `fsdp-run
// --replicas R` starts one; across hosts, start it by hand on a host that stays up and give its
// address to every rank as FSDP_ELASTIC_COORDINATOR=host:port.
#include <signal.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "compat.h"

int main(int argc, char** argv) {
  CLI::App app{
      "fsdp-coordinator: serves the store an elastic job's replicas meet in (its memberships, "
      "votes and lane rendezvous) on PORT of every interface, until SIGTERM or SIGINT.\n"
      "Usage: fsdp-coordinator --port P"};
  int port = 0;
  app.add_option("--port", port, "TCP port to serve the store on")
      ->required()
      ->check(CLI::Range(1, 65535));
  CLI11_PARSE(app, argc, argv);
  sigset_t stop;
  sigemptyset(&stop);
  sigaddset(&stop, SIGTERM);
  sigaddset(&stop, SIGINT);
  sigaddset(&stop, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &stop, nullptr);  // before the store's threads start
  c10d::TCPStoreOptions o;
  o.port = static_cast<uint16_t>(port);
  o.isServer = true;
  o.waitWorkers = false;
  c10::intrusive_ptr<c10d::Store> store;
  try {
    store = fsdp::compat::make_tcp_store("0.0.0.0", o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fsdp-coordinator: cannot serve the store on port %d: %s\n", port,
                 e.what());
    return 1;
  }
  std::printf("fsdp-coordinator: serving the elastic job's store on port %d\n", port);
  std::fflush(stdout);
  int sig = 0;
  sigwait(&stop, &sig);
  return 0;
}
