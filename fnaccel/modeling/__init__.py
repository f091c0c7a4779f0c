"""Modelling utilities: sizes, device maps, empty init, offload, unwrapping, memory and quantization.

Re-exported here: what is needed to plan where a big model goes before any
weight is loaded (`init_empty_weights`, `compute_module_sizes`,
`infer_auto_device_map`, `find_tied_parameters`...). `fnaccel.utils`
re-exports them under Accelerate's names.
"""

from fnaccel.modeling.device_map import check_device_map, clean_device_map, infer_auto_device_map
from fnaccel.modeling.empty import init_empty_weights, init_on_device
from fnaccel.modeling.memory_budget import convert_file_size_to_int, get_balanced_memory, get_max_memory
from fnaccel.modeling.sizes import (
    calculate_maximum_sizes,
    compute_module_sizes,
    compute_module_total_buffer_size,
    dtype_byte_size,
    get_max_layer_size,
    named_module_tensors,
)
from fnaccel.modeling.tied import find_tied_parameters, retie_parameters

__all__ = [
    "calculate_maximum_sizes",
    "check_device_map",
    "clean_device_map",
    "compute_module_sizes",
    "compute_module_total_buffer_size",
    "convert_file_size_to_int",
    "dtype_byte_size",
    "find_tied_parameters",
    "get_balanced_memory",
    "get_max_layer_size",
    "get_max_memory",
    "infer_auto_device_map",
    "init_empty_weights",
    "init_on_device",
    "named_module_tensors",
    "retie_parameters",
]
