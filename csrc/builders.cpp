// Index builders: see builders.h.
#include "builders.h"

void register_builders(pybind11::module_ &m) { (void)m; }
