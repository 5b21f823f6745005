// Index builders for the T5 datasets (packed-sample index, blending indices, sentence/span
// mappings). Implemented in builders.cpp and registered on the `_helpers` module by helpers.cpp.
#pragma once

#include <pybind11/pybind11.h>

void register_builders(pybind11::module_ &m);
