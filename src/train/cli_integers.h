// Integer flags whose value does not fit: CLI11 2.1 converts with strtoll/strtoull and keeps the
// clamped result (--steps 99999999999999999999 became 2^63-1 and the run started; --seed -1 became
// 2^64-1). check_integer_ranges() gives every integer option of an app a check that refuses such a
// value by name, on the command line and in a config file alike. Torch-free.
// Thread-safety: call while building the app, before parsing.
#pragma once

namespace CLI {
class App;
}

namespace fsdp::train {

// Adds the check to every option of `app` whose type is an integer (CLI11's INT or UINT).
void check_integer_ranges(CLI::App& app);

}  // namespace fsdp::train
