"""Prints this rank's OMP_NUM_THREADS and torch's intra-op thread count (launcher tests)."""

import os

import torch

print(f"rank {os.environ['RANK']} OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')} threads={torch.get_num_threads()}")
