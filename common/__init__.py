"""Shared pieces that are not what a recipe teaches: meters, logging, data, models, DataLoaderX."""

from common.data import build_datasets, prepare_dataset
from common.loader import DataLoaderX
from common.models import build_model, check_arch, unused_parameters_error
from common.utils import AverageMeter, Throughput, accuracy, die, peak_memory_mb, print0, result_line

__all__ = [
    "AverageMeter",
    "DataLoaderX",
    "Throughput",
    "accuracy",
    "build_datasets",
    "build_model",
    "check_arch",
    "die",
    "peak_memory_mb",
    "prepare_dataset",
    "print0",
    "result_line",
    "unused_parameters_error",
]
