// What every source here needs of torch, and no more: ATen (tensors, ops, parallel_for) and
// pybind11 with torch's tensor casters. torch/extension.h also brings the C++ frontend (nn, optim,
// data loaders), which nearly doubled each file's compile time (55 s of CPU against 31 s).

#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>
